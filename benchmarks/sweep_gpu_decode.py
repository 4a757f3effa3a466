"""``Pipeline.run`` tiles/s on one slide for GPU-decoding loader settings, in interleaved rounds.

Usage: ``python benchmarks/sweep_gpu_decode.py SLIDE [--rounds 3] [--cpu-shares 0,0.3,0.5]``. One
process, one pipeline; each round runs every setting once (``GPU_DECODE_BATCHES`` executor batches
per loader batch, ``GPU_DECODE_THREADS`` loader batches assembled at once), so machine drift
spreads over all of them. Prints the median tiles/s per setting and the stored tiles the loader
decoded. With ``--cpu-shares``, the settings are instead the shares of each nvJPEG call's stored
tiles decoded by libjpeg-turbo threads meanwhile (``GPU_DECODE_CPU_SHARE``), at the default
batches and threads.
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
    ap.add_argument("--cpu-shares", help="comma-separated fractions, e.g. 0,0.3,0.5")
    args = ap.parse_args()
    sl = slide_loader
    defaults = sl.GPU_DECODE_BATCHES, sl.GPU_DECODE_THREADS, sl.GPU_DECODE_CPU_SHARE
    if args.cpu_shares:
        settings = {f"cpu_share {v}": (defaults[0], defaults[1], float(v)) for v in args.cpu_shares.split(",")}
    else:
        settings = {f"{b}x{t}": (b, t, defaults[2]) for b, t in SETTINGS}
    rates: dict[str, list[float]] = {k: [] for k in settings}
    decode: dict[str, dict] = {}
    with Pipeline.from_card(backend="torch") as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for name, setting in settings.items():
                sl.GPU_DECODE_BATCHES, sl.GPU_DECODE_THREADS, sl.GPU_DECODE_CPU_SHARE = setting
                try:
                    t0 = time.perf_counter()
                    r = pipe.run(args.slide)
                    rates[name].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                finally:
                    sl.GPU_DECODE_BATCHES, sl.GPU_DECODE_THREADS, sl.GPU_DECODE_CPU_SHARE = defaults
                decode[name] = r.summary["tile_decode"]
    out = {k: {"median": statistics.median(v), "runs": v, "tile_decode": decode[k]} for k, v in rates.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
