"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 08:5x–09:4x UTC: heatmaps blended on the GPU, tiles
selected as arrays, the next slide planned ahead".

``Pipeline.run`` tiles/s on one slide, box merging on a thread or in the merging process, per queue length.

Usage: ``python benchmarks/probes/sweep_merge_queue.py SLIDE [--rounds 3]
[--variants process,thread:8,thread:64] [--backend torch]``.

The stitching thread hands each row's mapped boxes to the merge policy
A variant ``process`` runs it in the pipeline's merging process (what
slides of at least ``slide_run.MERGE_PROCESS_MIN_TILES`` tiles do), ``thread:N``
on a thread of the run's own process (the threshold is raised past the
slide) with ``stitch.stitcher.MERGE_QUEUE`` = N calls that may wait. One process, one pipeline; each round runs every
variant once, so machine drift spreads over all of them. Prints the median
tiles/s and the median seconds of the run's ``stitch`` stage (the merging
left at the end) per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline, slide_run
from wsi_pipeline.stitch import stitcher


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="process,thread:8,thread:64")
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args()
    names = args.variants.split(",")
    if any(v != "process" and not (v.startswith("thread:") and v[7:].isdigit()) for v in names):
        ap.error(f"--variants: process or thread:N, found {args.variants!r}")
    variants = [(v, 0) if v == "process" else ("thread", int(v[7:])) for v in names]
    rates: dict[str, list[float]] = {v: [] for v in names}
    stitch: dict[str, list[float]] = {k: [] for k in rates}
    defaults = stitcher.MERGE_QUEUE, slide_run.MERGE_PROCESS_MIN_TILES
    with Pipeline.from_card(backend=args.backend) as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN, the merging process
        for _ in range(args.rounds):
            for name, (where, n) in zip(names, variants, strict=True):
                stitcher.MERGE_QUEUE = n or defaults[0]
                slide_run.MERGE_PROCESS_MIN_TILES = defaults[1] if where == "process" else 1 << 62
                try:
                    t0 = time.perf_counter()
                    r = pipe.run(args.slide)
                    seconds = time.perf_counter() - t0
                finally:
                    stitcher.MERGE_QUEUE, slide_run.MERGE_PROCESS_MIN_TILES = defaults
                if r.summary["box_merge"] != where:
                    raise SystemExit(f"{name} ran its merge on a {r.summary['box_merge']}")
                rates[name].append(round(r.summary["tiles"]["read"] / seconds, 1))
                stitch[name].append(r.summary["seconds"]["stitch"])
    out = {
        k: {"median_tiles_per_s": statistics.median(v), "runs": v, "median_stitch_s": statistics.median(stitch[k])}
        for k, v in rates.items()
    }
    print(json.dumps({"merge": out, "tile_decode": r.summary.get("tile_decode")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
