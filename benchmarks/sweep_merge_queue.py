"""``Pipeline.run`` tiles/s on one slide, box merging on a thread or in the merging process, per queue length.

Usage: ``python benchmarks/sweep_merge_queue.py SLIDE [--rounds 3]
[--variants process:8,thread:8,thread:64] [--backend torch]``.

The stitching thread hands each row's mapped boxes to the merge policy
(``stitch.stitcher.MERGE_QUEUE`` calls may wait). A variant ``WHERE:N``
runs it in the pipeline's merging process (``process``, what slides of at
least ``pipeline.MERGE_PROCESS_MIN_TILES`` tiles do) or on a thread of the
run's own process (``thread``: the threshold is raised past the slide), with
a queue of N calls. One process, one pipeline; each round runs every
variant once, so machine drift spreads over all of them. Prints the median
tiles/s and the median seconds of the run's ``stitch`` stage (the merging
left at the end) per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline, pipeline
from wsi_pipeline.stitch import stitcher


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="process:8,thread:8,thread:64")
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args()
    variants = [(w, int(n)) for w, n in (v.split(":") for v in args.variants.split(","))]
    if any(w not in ("process", "thread") for w, _ in variants):
        ap.error(f"--variants: WHERE is process or thread, found {args.variants!r}")
    rates: dict[str, list[float]] = {f"{w}:{n}": [] for w, n in variants}
    stitch: dict[str, list[float]] = {k: [] for k in rates}
    defaults = stitcher.MERGE_QUEUE, pipeline.MERGE_PROCESS_MIN_TILES
    with Pipeline.from_card(backend=args.backend) as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN, the merging process
        for _ in range(args.rounds):
            for where, n in variants:
                stitcher.MERGE_QUEUE = n
                pipeline.MERGE_PROCESS_MIN_TILES = defaults[1] if where == "process" else 1 << 62
                try:
                    t0 = time.perf_counter()
                    r = pipe.run(args.slide)
                    seconds = time.perf_counter() - t0
                finally:
                    stitcher.MERGE_QUEUE, pipeline.MERGE_PROCESS_MIN_TILES = defaults
                if r.summary["box_merge"] != where:
                    raise SystemExit(f"{where}:{n} ran its merge on a {r.summary['box_merge']}")
                rates[f"{where}:{n}"].append(round(r.summary["tiles"]["read"] / seconds, 1))
                stitch[f"{where}:{n}"].append(r.summary["seconds"]["stitch"])
    out = {
        k: {"median_tiles_per_s": statistics.median(v), "runs": v, "median_stitch_s": statistics.median(stitch[k])}
        for k, v in rates.items()
    }
    print(json.dumps({"merge": out, "tile_decode": r.summary.get("tile_decode")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
