"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 20:5x–21:4x UTC: the heatmap file written by a writer
process, job arrays through files".

What a busy Python thread does to work that needs the interpreter lock now and then (a component).

Usage: ``python benchmarks/probes/bench_lock_contention.py [--rounds 2]``.

A slide's run keeps Python threads busy (stitching, loading); whatever else its process does
competes with them for the interpreter lock. Timed here, alone and beside one thread that only
counts (the stand-in for a busy run):

- ``OmeTiffHeatmapWriter.close()`` of a 4096 x 4096 heatmap of 2 channels (the 32k slide's at
  stride 8): its pyramid and the tile generator that feeds tifffile's compression threads;
- pickling a 16 MB float32 array (as a job's argument is sent to a writer process), against
  writing it to a file (``ArrayFile``).

Prints wall seconds of each, and the counting thread's rate (millions a second) meanwhile.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np

from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter
from wsi_pipeline.io.writer_pool import ArrayFile


def _count(stop: threading.Event, out: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def timed(fn: Callable[[], object], busy: bool) -> tuple[float, float | None]:
    """Seconds of ``fn()`` and, with ``busy``, the counting thread's rate (millions a second)."""
    stop, counted = threading.Event(), []
    counter = threading.Thread(target=_count, args=(stop, counted)) if busy else None
    if counter is not None:
        counter.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    stop.set()
    if counter is None:
        return seconds, None
    counter.join()
    return seconds, counted[0] / seconds / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:4096, 0:4096].astype(np.float32) / 4096
    heat = np.stack([np.sin(6 * xx) * np.cos(5 * yy) * 0.5 + 0.5, xx * yy]).astype(np.float32)
    heat[:, :, :1800] = 0  # background without tissue
    array = rng.random((1, 2048, 2048), dtype=np.float32)

    def heatmap_close(k: int) -> Callable[[], object]:
        writer = OmeTiffHeatmapWriter(folder / f"h{k}.ome.tif", 4096, 4096, 2, ["a", "b"], (2.0, 2.0))
        for y in range(0, 4096, 64):
            writer(y, heat[:, y : y + 64])
        return writer.close

    cases: dict[str, Callable[[int], Callable[[], object]]] = {
        "heatmap file close()": heatmap_close,
        "pickle a 16 MB array": lambda k: lambda: ForkingPickler.dumps(array),
        "write it to a file (ArrayFile)": lambda k: lambda: ArrayFile(folder / f"a{k}.bin", array),
    }
    k = 0
    for name, make in cases.items():
        for r in range(args.rounds):
            for busy in (False, True):
                k += 1
                seconds, rate = timed(make(k), busy)
                beside = f"beside a busy thread (it counted {rate:.2f} M/s)" if busy else "alone"
                print(f"{name:32s} round {r + 1}: {seconds:7.3f} s {beside}")
    idle, rate = timed(lambda: time.sleep(0.3), True)
    print(f"{'(the busy thread, nothing else)':32s}        : {idle:7.3f} s, it counted {rate:.2f} M/s")
    for p in folder.iterdir():
        p.unlink()
    os.rmdir(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
