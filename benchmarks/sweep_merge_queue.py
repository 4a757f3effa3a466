"""``Pipeline.run`` tiles/s on one slide for queue lengths of the box-merging thread, in interleaved rounds.

Usage: ``python benchmarks/sweep_merge_queue.py SLIDE [--rounds 3] [--sizes 8,64,100000] [--backend torch]``.

The stitching thread hands each row's mapped boxes to the box-merging thread
(``stitch.stitcher.MERGE_QUEUE`` calls may wait); when that thread falls
behind, the stitching thread blocks, and with it the executor and the
loader. A longer queue lets them go on and leaves the merging to finish
later. One process, one pipeline; each round runs every size once, so
machine drift spreads over all of them. Prints the median tiles/s and the
median seconds of the run's ``stitch`` stage (the merging left at the end)
per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline
from wsi_pipeline.stitch import stitcher


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="8,64,100000")
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args()
    sizes = [int(v) for v in args.sizes.split(",")]
    rates: dict[int, list[float]] = {v: [] for v in sizes}
    stitch: dict[int, list[float]] = {v: [] for v in sizes}
    default = stitcher.MERGE_QUEUE
    with Pipeline.from_card(backend=args.backend) as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for v in sizes:
                stitcher.MERGE_QUEUE = v
                try:
                    t0 = time.perf_counter()
                    r = pipe.run(args.slide)
                    rates[v].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                    stitch[v].append(r.summary["seconds"]["stitch"])
                finally:
                    stitcher.MERGE_QUEUE = default
    out = {
        str(k): {"median_tiles_per_s": statistics.median(v), "runs": v, "median_stitch_s": statistics.median(stitch[k])}
        for k, v in rates.items()
    }
    print(json.dumps({"merge_queue": out, "tile_decode": r.summary.get("tile_decode")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
