"""Where a shipped model stops working: recall by object size, and how often it splits an object.

Renders held-out synthetic scenes (seeds 9000+) of the model's kind at level 0 (JPEG quality 85)
at several pixel sizes, so the same objects appear larger or smaller in pixels than in training
(pathology: nuclei 8-20 px across at 0.25 um/px, 16-40 px at 0.125), runs the model on 512 px
tiles with ONNX Runtime, and reports per bin of object size (the longer side of the truth box, in
tile pixels): the objects, the recall at IoU 0.5 (COCO matching, :mod:`wsi_pipeline.models.evaluate`)
and the fraction of objects with two or more detections centred inside their box (split).
Objects less than half inside their tile are left out. Industrial tiles are placed on a defect
three times in four, as in training.

    python benchmarks/bench_object_size.py [--kind pathology] [--scenes 4] [--tiles-per-scene 6] [--json out.json]
    python benchmarks/bench_object_size.py --smoke      # seconds: one scene, one tile, one scale
"""

from __future__ import annotations

import argparse

import numpy as np
from harness import ROOT, add_common_args, machine, require, write_json

from wsi_pipeline.inference.card import load_card
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.ort_backend import OrtBackend
from wsi_pipeline.models.data import EVAL_SEEDS, SCENE_SAMPLING, render_tile, tile_origins
from wsi_pipeline.models.evaluate import detection_counts
from wsi_pipeline.synthetic import SyntheticScene

BINS_PX = (0, 8, 14, 20, 26, 32, 40, 52, 64, 128, 256)
MODELS = {
    "pathology": (ROOT / "engines" / "nuclei_pathology.card.json", (0.25, 0.167, 0.125)),
    "industrial": (ROOT / "engines" / "defects_industrial.card.json", (None,)),
}


def measure(kind: str, scene_mpp: float | None, scenes: int, tiles_per_scene: int) -> list[tuple]:
    card_path, _ = MODELS[kind]
    card = load_card(card_path)
    backend = OrtBackend(card, max_batch=8)
    tile = card.input.size_hw[0]
    truth_sides, hits, splits = [], [], []
    for seed in EVAL_SEEDS[:scenes]:
        scene = SyntheticScene(2048, 2048, seed, kind=kind, mpp=scene_mpp)
        centred = SCENE_SAMPLING[kind]["object_centred"]  # industrial defects are sparse
        for x0, y0 in tile_origins(scene, seed, tiles_per_scene, 2048, tile, centred):
            s = render_tile(scene, x0, y0, tile, 8, jpeg_quality=85)
            det = decode(backend.infer(s.image[None]), card)[0]
            keep = s.visible >= 0.5
            boxes, labels = s.boxes[keep], s.labels[keep]
            for i, b in enumerate(boxes):
                one = detection_counts([det.boxes], [det.scores], [det.labels], [b[None]], [labels[i : i + 1]])
                hits.append(one.tp)
                cx = (det.boxes[:, 0] + det.boxes[:, 2]) / 2
                cy = (det.boxes[:, 1] + det.boxes[:, 3]) / 2
                inside = (cx >= b[0]) & (cx <= b[2]) & (cy >= b[1]) & (cy <= b[3])
                splits.append(int(inside.sum()) >= 2)
                truth_sides.append(float(max(b[2] - b[0], b[3] - b[1])))
    backend.close()
    sides, hits, splits = np.array(truth_sides), np.array(hits), np.array(splits)
    rows = []
    for lo, hi in zip(BINS_PX[:-1], BINS_PX[1:], strict=True):
        m = (sides >= lo) & (sides < hi)
        if m.sum():
            rows.append((f"{lo}-{hi}", int(m.sum()), hits[m].mean(), splits[m].mean()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(MODELS), default="pathology")
    parser.add_argument("--scenes", type=int, default=4)
    parser.add_argument("--tiles-per-scene", type=int, default=6)
    add_common_args(parser)
    args = parser.parse_args()
    require("bench_object_size.py", "pycocotools")  # detection_counts matches with it
    scales = MODELS[args.kind][1]
    if args.smoke:
        args.scenes, args.tiles_per_scene, scales = 1, 1, scales[:1]
    print("| scene mpp | object size px | objects | recall | split |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for mpp in scales:
        for size, n, recall, split in measure(args.kind, mpp, args.scenes, args.tiles_per_scene):
            print(f"| {mpp} | {size} | {n} | {recall:.2f} | {split:.2f} |", flush=True)
            rows.append({"scene_mpp": mpp, "object_px": size, "objects": n, "recall": recall, "split": split})
    write_json(args.json, {**machine(), "smoke": args.smoke, "kind": args.kind, "rows": rows})


if __name__ == "__main__":
    main()
