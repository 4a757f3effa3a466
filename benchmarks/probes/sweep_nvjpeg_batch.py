"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 13:1x–13:5x UTC: the slide process's start, the run's first
and last 0.1 s".

nvJPEG stored tiles/s and seconds per call against the number of stored tiles a call decodes.

Usage: ``python benchmarks/probes/sweep_nvjpeg_batch.py SLIDE [--batches 128,256,512,1024,2048] [--rounds 3]
[--with-model]`` (a CUDA machine). Decodes every stored tile of level 0 with
``torchvision.io.decode_jpeg(list, device="cuda")`` in calls of each size, interleaved over the
rounds; prints the median rate and the median milliseconds per call, from which a call's fixed
cost can be read. ``--with-model``: the same, then again while the shipped model (torch backend,
fp16, batch 64, CUDA graph) runs without pause on a stream of its own, as it does during a run:
what sharing the GPU with the model costs nvJPEG. ``--pinned``: each size also with the streams
in page-locked host memory (views of one pinned buffer), interleaved with the pageable ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torchvision.io

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_product_gpu import stored_tiles  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--batches", default="128,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--with-model", action="store_true")
    ap.add_argument("--pinned", action="store_true", help="also with the streams in page-locked memory")
    args = ap.parse_args()
    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in stored_tiles(args.slide) if r]
    sizes: list = [int(b) for b in args.batches.split(",")]
    if args.pinned:
        pinned = torch.cat(data).pin_memory()
        views = list(torch.split(pinned, [len(d) for d in data]))
        sizes = [*sizes, *((b, views) for b in sizes)]
    torchvision.io.decode_jpeg(data[:2048], device="cuda")
    torch.cuda.synchronize()
    out = {"stored_tiles": len(data), "alone": sweep(data, sizes, args.rounds)}
    print(f"alone: {out['alone']}", file=sys.stderr, flush=True)
    if args.with_model:
        from wsi_pipeline.inference.backend import create_backend
        from wsi_pipeline.inference.card import load_card
        from wsi_pipeline.inference.shipped import shipped_card

        backend = create_backend(load_card(shipped_card()), "torch", device="cuda", max_batch=64)
        stream = torch.cuda.Stream()
        runner = backend.create_runner(stream)
        with torch.cuda.stream(stream):  # its CUDA graph is captured before any decoding runs beside it
            for _ in range(3):
                runner.run(64)
        stream.synchronize()
        stop = threading.Event()
        batches = [0]

        def run_model() -> None:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    runner.run(64)
                    batches[0] += 1
                    if batches[0] % 8 == 0:
                        stream.synchronize()  # keep a few batches queued, not thousands

        model = threading.Thread(target=run_model, daemon=True)
        model.start()
        t0 = time.perf_counter()
        out["with_the_model"] = sweep(data, sizes, args.rounds)
        stop.set()
        model.join()
        out["model_tiles_per_s_meanwhile"] = round(batches[0] * 64 / (time.perf_counter() - t0))
    print(json.dumps(out, indent=1))
    return 0


def sweep(data: list, sizes: list, rounds: int) -> dict:
    """``sizes``: call sizes, each an int (``data``) or ``(size, streams)`` (those streams instead)."""
    names = [str(b) if isinstance(b, int) else f"{b[0]} pinned" for b in sizes]
    rates: dict[str, list[float]] = {name: [] for name in names}
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, spec in zip(names, sizes, strict=True):
            b, streams = (spec, data) if isinstance(spec, int) else spec
            t0 = time.perf_counter()
            calls = 0
            for i in range(0, len(streams), b):
                torchvision.io.decode_jpeg(streams[i : i + b], device="cuda")
                calls += 1
            torch.cuda.current_stream().synchronize()  # the decoded tiles are ready on it
            dt = time.perf_counter() - t0
            rates[name].append(len(streams) / dt)
            per_call[name].append(dt / calls * 1000)
    return {
        name: {
            "stored_tiles_per_s": round(statistics.median(rates[name])),
            "ms_per_call": round(statistics.median(per_call[name]), 2),
        }
        for name in rates
    }


if __name__ == "__main__":
    raise SystemExit(main())
