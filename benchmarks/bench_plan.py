"""Seconds of ``Pipeline.plan`` (open the slide, find its tissue, select its tiles), repeated.

Usage: ``python benchmarks/bench_plan.py SLIDE [--calls 6]``. One pipeline (ONNX Runtime: the plan
does not use the model); prints each call's seconds (the first opens the slide's files cold) and
the number of tiles selected.
"""

from __future__ import annotations

import argparse
import time

from wsi_pipeline import Pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    seconds, tiles = [], 0
    with Pipeline.from_card(backend="ort") as pipe:
        for _ in range(args.calls):
            t0 = time.perf_counter()
            plan = pipe.plan(args.slide)
            seconds.append(round(time.perf_counter() - t0, 3))
            tiles = len(plan.tiles)
            plan.close()
    print(f"plan seconds {seconds}; {tiles} tiles selected")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
