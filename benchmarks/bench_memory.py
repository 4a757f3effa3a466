"""Peak host memory of a slide run against the slide's size: it should stay flat.

Writes synthetic pathology slides of each ``--sizes`` (squared), then runs
``wsi-pipeline run`` on each in a fresh process and reads that process's peak
resident memory (``ru_maxrss`` of the child) and the run's own figures.

    python benchmarks/bench_memory.py [--sizes 10000,40000] [--backend ort] [--json out.json]
    python benchmarks/bench_memory.py --smoke      # seconds: two tiny slides
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from harness import SMOKE_SLIDE_PX, add_common_args, machine, synthetic_slide, work_folder, write_json

from wsi_pipeline.batch.folder import slide_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,40000")
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.sizes = f"{SMOKE_SLIDE_PX},{SMOKE_SLIDE_PX * 3 // 2}"
    work = work_folder("bench_memory_", args.dir)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        slide = work / f"slide_{size}.tiff"
        if not slide.exists():
            synthetic_slide(slide, size, seed=900)
        out = work / f"out_{size}"
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t = time.perf_counter()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "wsi_pipeline",
                "run",
                str(slide),
                "--out",
                str(out),
                "--force",
                "--backend",
                args.backend,
            ],
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(r.stdout + r.stderr)
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if peak_mb <= before / 1024:
            print("warning: a previous child had a higher peak; run sizes in ascending order")
        s = json.loads((slide_dir(out, slide.stem) / "summary.json").read_text())
        rows.append(
            {
                "size": size,
                "peak_rss_mb": round(peak_mb, 1),
                "seconds": round(seconds, 1),
                "tiles_read": s["tiles"]["read"],
                "detections": s["detections_total"],
                "heatmap_px": s["heatmap"]["scale_level0"] and (size // int(s["heatmap"]["scale_level0"])) ** 2,
            }
        )
        print(rows[-1])
    base = rows[0]["peak_rss_mb"]
    for r in rows:
        r["ratio_to_first"] = round(r["peak_rss_mb"] / base, 3)
    print(json.dumps(rows, indent=1))
    write_json(args.json, {**machine(), "smoke": args.smoke, "rows": rows})


if __name__ == "__main__":
    main()
