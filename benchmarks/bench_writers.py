"""Detection writers on a slide's worth of boxes: the GeoJSON and CSV writers (rows as byte arrays)
against ``json.dump`` of the same FeatureCollection as nested dicts and ``csv.writer`` row by row;
and the overlay of the same boxes on a 2048 x 2048 thumbnail with a 512 x 512 heatmap.

    python benchmarks/bench_writers.py [--n 117513] [--json out.json]
    python benchmarks/bench_writers.py --smoke      # seconds: 2,000 detections, one round
"""

from __future__ import annotations

import argparse
import csv
import json
import os

import numpy as np
from harness import SMOKE_ROUNDS, add_common_args, machine, timed_rounds, work_folder, write_json

from wsi_pipeline.io.detections import detection_boxes, make_detections, to_geojson, write_csv, write_geojson
from wsi_pipeline.io.overlay import write_overlay

CLASSES = [{"name": "nucleus", "color": "#7b2cbf"}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=117513, help="detections (a 24k x 24k pathology slide has ~10^5)")
    add_common_args(ap)
    args = ap.parse_args()
    repeats = SMOKE_ROUNDS if args.smoke else 3
    if args.smoke:
        args.n = 2000

    def _best_of(fn) -> float:
        return min(timed_rounds(fn, repeats))

    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 24576, (args.n, 2))
    dets = make_detections(np.c_[xy, xy + rng.uniform(4, 20, (args.n, 2))], rng.random(args.n), np.zeros(args.n))
    tmp = str(work_folder("bench_writers_"))
    doc = to_geojson(dets, CLASSES)

    def dict_geojson():
        with open(os.path.join(tmp, "dict.geojson"), "w") as f:
            json.dump(doc, f, separators=(",", ":"))

    def row_csv():
        with open(os.path.join(tmp, "rows.csv"), "w", newline="") as f:
            w = csv.writer(f)
            for d in dets:
                w.writerow(
                    [
                        f"{d['x0']:.2f}",
                        f"{d['y0']:.2f}",
                        f"{d['x1']:.2f}",
                        f"{d['y1']:.2f}",
                        f"{d['score']:.5f}",
                        int(d["label"]),
                        "nucleus",
                    ]
                )

    t_geo = _best_of(lambda: write_geojson(os.path.join(tmp, "d.geojson"), dets, CLASSES))
    t_dict = _best_of(dict_geojson)
    t_csv = _best_of(lambda: write_csv(os.path.join(tmp, "d.csv"), dets, CLASSES))
    t_rows = _best_of(row_csv)
    thumb = rng.integers(0, 256, (2048, 2048, 3), dtype=np.uint8)
    heat = rng.integers(0, 256, (1, 512, 512), dtype=np.uint8)
    boxes, labels = detection_boxes(dets), dets["label"]
    downsample = 24576 / 2048
    t_overlay = _best_of(
        lambda: write_overlay(
            os.path.join(tmp, "overlay.png"), thumb, downsample, heat, 4 * downsample, boxes, labels, [(123, 44, 191)]
        )
    )
    print(f"{args.n} detections, best of {repeats}")
    print(f"GeoJSON: write_geojson {t_geo:.3f} s, json.dump of dicts {t_dict:.3f} s ({t_dict / t_geo:.1f}x)")
    print(f"CSV:     write_csv     {t_csv:.3f} s, csv.writer per row {t_rows:.3f} s ({t_rows / t_csv:.1f}x)")
    print(f"overlay: write_overlay {t_overlay:.3f} s")
    write_json(
        args.json,
        {
            **machine(),
            "smoke": args.smoke,
            "detections": args.n,
            "seconds": {
                "write_geojson": t_geo,
                "json_dump_of_dicts": t_dict,
                "write_csv": t_csv,
                "csv_writer_per_row": t_rows,
                "write_overlay": t_overlay,
            },
        },
    )


if __name__ == "__main__":
    main()
