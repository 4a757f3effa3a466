"""Where one GPU ``Pipeline.run`` spends its time: seconds inside its main calls, per thread.

Run on a CUDA machine::

    python benchmarks/trace_gpu_run.py SLIDE [--runs 2]

Wraps the calls that carry a run (nvJPEG decoding, a loader batch's assembly,
the hand-off wait, reading stored tiles, a worker's batch, waiting on CUDA
events, the host decoder, the stitcher) with timers that add up wall seconds
per call site and thread (names without their numbers), then runs the
pipeline (torch backend, no outputs) once to warm up and ``--runs`` times
measured. Prints, for the last run, each thread's seconds per call site next
to the run's wall time. Nested calls are counted in both (a batch's
assembly includes its nvJPEG call).
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import threading
import time

import torch
import torchvision.io

from wsi_pipeline import Pipeline
from wsi_pipeline.inference import executor, torch_backend
from wsi_pipeline.slide import tiff_backend
from wsi_pipeline.stitch import stitcher
from wsi_pipeline.tiling import gpu_loader

_totals: dict = collections.defaultdict(lambda: [0.0, 0])
_lock = threading.Lock()


def _thread() -> str:
    return re.sub(r"[_-]?\d+(_\d+)?$", "", threading.current_thread().name)


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                entry = _totals[(_thread(), label)]
                entry[0] += dt
                entry[1] += 1

    setattr(owner, name, wrapped)


def install() -> None:
    for owner, name, label in [
        (torchvision.io, "decode_jpeg", "nvJPEG decode_jpeg"),
        (gpu_loader.GpuTileDecoder, "decode_after", "loader batch (all of it)"),
        (gpu_loader._HandOff, "take", "loader hand-off wait"),
        (tiff_backend.TiffSlide, "raw_tile_jpeg", "read stored tile bytes"),
        (executor._CudaWorker, "process", "worker batch (all of it)"),
        (executor._DeviceDecoder, "reduce", "device output reduction"),
        (executor._DeviceDecoder, "finish", "host decoder"),
        (torch.cuda.Event, "synchronize", "CUDA event wait"),
        (torch_backend.TorchRunner, "run", "model launch (graph replay)"),
        (stitcher.Stitcher, "add_batch", "stitcher add_batch"),
        (stitcher.Stitcher, "finish", "stitcher finish"),
    ]:
        _timed(owner, name, label)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    install()
    with Pipeline.from_card(backend="torch") as pipe:
        pipe.run(args.slide)
        for _ in range(args.runs):
            _totals.clear()
            t0 = time.perf_counter()
            r = pipe.run(args.slide)
            wall = time.perf_counter() - t0
            tiles = r.summary["tiles"]["read"]
            print(f"run: {wall:.3f} s, {tiles / wall:,.0f} tiles/s; tile_decode {r.summary.get('tile_decode')}")
        for (thread, label), (sec, calls) in sorted(_totals.items(), key=lambda kv: (kv[0][0], -kv[1][0])):
            print(f"  {thread:<16} {label:<30} {sec:7.3f} s {sec / wall:6.1%} of the run  {calls:6d} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
