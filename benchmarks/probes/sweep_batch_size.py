"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 07:0x–07:4x UTC: the batch runs two slides ahead, more
writer processes, a faster heatmap pyramid".

``Pipeline.run`` tiles/s on one slide for batch sizes and stream counts, in interleaved rounds.

Usage (a CUDA machine)::

    python benchmarks/probes/sweep_batch_size.py SLIDE [--settings 64x4,128x4,128x2,256x2] [--rounds 3]

One pipeline per setting (``batch_size`` x ``streams``, torch backend, no outputs), each warmed
up by one run; then each round runs every pipeline once, so machine drift spreads over all of
them. Prints the median tiles/s per setting and its peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--settings", default="64x4,128x4,128x2,256x2")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    settings = [tuple(int(v) for v in s.split("x")) for s in args.settings.split(",")]
    pipes = {f"{b}x{s}": Pipeline.from_card(backend="torch", batch_size=b, streams=s) for b, s in settings}
    rates: dict[str, list[float]] = {k: [] for k in pipes}
    gpu_mb: dict[str, float] = {}
    try:
        for pipe in pipes.values():
            pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for name, pipe in pipes.items():
                t0 = time.perf_counter()
                r = pipe.run(args.slide)
                rates[name].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                gpu_mb[name] = r.summary["peak_gpu_memory_mb"]
    finally:
        for pipe in pipes.values():
            pipe.close()
    out = {
        k: {"median": statistics.median(v), "runs": v, "peak_gpu_memory_mb": gpu_mb.get(k)} for k, v in rates.items()
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
