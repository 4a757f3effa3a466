"""nvJPEG stored tiles/s and seconds per call against the number of stored tiles a call decodes.

Usage: ``python benchmarks/sweep_nvjpeg_batch.py SLIDE [--batches 128,256,512,1024,2048] [--rounds 3]``
(a CUDA machine). Decodes every stored tile of level 0 with ``torchvision.io.decode_jpeg(list,
device="cuda")`` in calls of each size, interleaved over the rounds; prints the median rate and
the median milliseconds per call, from which a call's fixed cost can be read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision.io

sys.path.insert(0, str(Path(__file__).parent))
from bench_product_gpu import stored_tiles  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--batches", default="128,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in stored_tiles(args.slide) if r]
    sizes = [int(b) for b in args.batches.split(",")]
    torchvision.io.decode_jpeg(data[: max(sizes)], device="cuda")
    torch.cuda.synchronize()
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    per_call: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(args.rounds):
        for b in sizes:
            t0 = time.perf_counter()
            calls = 0
            for i in range(0, len(data), b):
                torchvision.io.decode_jpeg(data[i : i + b], device="cuda")
                calls += 1
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rates[b].append(len(data) / dt)
            per_call[b].append(dt / calls * 1000)
    out = {
        b: {
            "stored_tiles_per_s": round(statistics.median(rates[b])),
            "ms_per_call": round(statistics.median(per_call[b]), 2),
        }
        for b in sizes
    }
    print(json.dumps({"stored_tiles": len(data), "by_call_size": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
