"""``Pipeline.run`` tiles/s on one slide for GPU-decoding loader settings, in interleaved rounds.

Usage: ``python benchmarks/sweep_gpu_decode.py SLIDE [--rounds 3]``. One process, one pipeline; each
round runs every setting once (``GPU_DECODE_BATCHES`` executor batches per loader batch,
``GPU_DECODE_THREADS`` loader batches assembled at once), so machine drift spreads over all of them.
Prints the median tiles/s per setting and the stored tiles the loader decoded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline
from wsi_pipeline.tiling import slide_loader

SETTINGS = [(4, 2), (8, 2), (16, 2), (4, 1), (4, 3), (8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {f"{b}x{t}": [] for b, t in SETTINGS}
    with Pipeline.from_card(backend="torch") as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for b, t in SETTINGS:
                slide_loader.GPU_DECODE_BATCHES, slide_loader.GPU_DECODE_THREADS = b, t
                t0 = time.perf_counter()
                r = pipe.run(args.slide)
                rates[f"{b}x{t}"].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
    out = {k: {"median": statistics.median(v), "runs": v} for k, v in rates.items()}
    print(json.dumps({"batches_x_threads": out, "tile_decode": r.summary["tile_decode"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
