"""``Pipeline.run`` tiles/s on one slide for GPU-decoding loader settings, in interleaved rounds.

Usage::

    python benchmarks/sweep_gpu_decode.py SLIDE [--rounds 3]
    python benchmarks/sweep_gpu_decode.py SLIDE --cpu-shares 0,0.2,0.35,0.5 [--rounds 3]

One process, one pipeline; each round runs every setting once, so machine drift spreads over all
of them. The settings: ``GPU_DECODE_BATCHES`` executor batches per loader batch x
``GPU_DECODE_THREADS`` loader batches assembled at once; or, with ``--cpu-shares``, the share of
each batch's stored tiles decoded by libjpeg-turbo threads beside nvJPEG (``gpu_loader.CPU_SHARE``).
Prints the median tiles/s per setting and the run's ``tile_decode`` record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline
from wsi_pipeline.tiling import gpu_loader, slide_loader

SETTINGS = [(4, 2), (8, 2), (16, 2), (4, 1), (4, 3), (8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-shares", help="comma-separated shares to compare instead of batches x threads")
    args = ap.parse_args()
    if args.cpu_shares:
        settings = {f"share {v}": {"CPU_SHARE": float(v)} for v in args.cpu_shares.split(",")}
    else:
        settings = {f"{b}x{t}": {"GPU_DECODE_BATCHES": b, "GPU_DECODE_THREADS": t} for b, t in SETTINGS}
    rates: dict[str, list[float]] = {k: [] for k in settings}
    records = {}
    with Pipeline.from_card(backend="torch") as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for name, values in settings.items():
                for attr, v in values.items():
                    setattr(gpu_loader if attr == "CPU_SHARE" else slide_loader, attr, v)
                t0 = time.perf_counter()
                r = pipe.run(args.slide)
                rates[name].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                records[name] = r.summary["tile_decode"]
    out = {k: {"median": statistics.median(v), "runs": v, "tile_decode": records[k]} for k, v in rates.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
