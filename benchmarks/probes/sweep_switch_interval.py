"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 05:5x–06:3x UTC: batch arrays, the stitching threads, each
stored tile decoded once".

``Pipeline.run`` tiles/s on one slide for interpreter switch intervals, in interleaved rounds.

Usage: ``python benchmarks/probes/sweep_switch_interval.py SLIDE [--rounds 3] [--intervals 0.005,0.001,0.0002]``.

A GPU run's threads (stitching, loader, executor workers) all take the
interpreter lock between short native calls that release it; a thread that
wants it back waits until the holder drops it, at the latest after
``sys.getswitchinterval()`` (5 ms by default). One process, one pipeline
(the torch backend); each round runs every interval once, so machine drift
spreads over all of them. Prints the median tiles/s per interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from wsi_pipeline import Pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--intervals", default="0.005,0.001,0.0002")
    args = ap.parse_args()
    intervals = [float(v) for v in args.intervals.split(",")]
    rates: dict[float, list[float]] = {v: [] for v in intervals}
    default = sys.getswitchinterval()
    with Pipeline.from_card(backend="torch") as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for v in intervals:
                sys.setswitchinterval(v)
                try:
                    t0 = time.perf_counter()
                    r = pipe.run(args.slide)
                    rates[v].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                finally:
                    sys.setswitchinterval(default)
    out = {str(k): {"median": statistics.median(v), "runs": v} for k, v in rates.items()}
    print(json.dumps({"switch_interval_s": out, "tile_decode": r.summary.get("tile_decode")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
