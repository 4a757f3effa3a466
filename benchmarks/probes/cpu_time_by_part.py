"""Probe (2026-12-06), fed benchmarks/HISTORY.md "2026-12-06 08:2x-09:0x UTC: every storage kind on
the CPU at 16k, and where a CPU run's time goes".

Where the CPU time of ``Pipeline.run`` on the CPU (ONNX Runtime) goes, against the model alone in
the same process::

    python benchmarks/probes/cpu_time_by_part.py SLIDE [SLIDE ...] [--mpp 0.5 [--resample reduced]] [--rounds 2]
    python benchmarks/probes/cpu_time_by_part.py SLIDE --ab-region-threads [--rounds 6]
    python benchmarks/probes/cpu_time_by_part.py SLIDE --decoders

For each slide, after a warm-up run: the run's wall and process CPU seconds (the busy cores are
their ratio), and the CPU seconds (``time.thread_time`` of the threads doing it) of the model's
session runs, the tile reads and, inside them, the stored tiles' JPEG decoding (decoding in the
region threads counted apart), the stitcher (the boxes' hand-off to the merge process included),
the heatmap sinks' thread (the heatmap's statistics and array) and the executor's box decoding;
"the rest" is the
process CPU time less these (the tissue mask, the main loop, the hand-offs, the thread pools). Then the
model alone (the pipeline's own sessions on the same number of tiles in memory,
``bench_cpu_pipeline.model_alone``): its CPU seconds and the ratio of the two wall times.

``--decoders``: the stored JPEG tiles of each slide's level 0 (60 from its middle, as
``raw_tile_jpeg`` gives them) decoded by simplejpeg (the reader's decoder), imagecodecs, OpenCV and
Pillow: microseconds a tile.

``--ab-region-threads``: the run as it is (the model on the CPU: each reader thread decodes its
regions' stored tiles itself, ``slide.base.decoding_in_this_thread``) and as before 2026-12-06
09:2x (a region of ``stored_tiles.PARALLEL_REGION_TILES`` stored tiles or more handed to the
region threads), interleaved.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from wsi_pipeline import Pipeline
from wsi_pipeline.inference import executor, ort_backend
from wsi_pipeline.slide import stored_jpeg, stored_tiles
from wsi_pipeline.stitch import sinks, stitcher
from wsi_pipeline.tiling import slide_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_cpu_pipeline import model_alone  # noqa: E402

PARTS = {
    "model session runs": (ort_backend.OrtBackend, "infer"),
    "tile reads": (slide_loader, "read_tile"),
    "stitcher": (stitcher.Stitcher, "add_batch"),
    "heatmap sinks (their thread)": (sinks, "_after_copy"),
    "box decoding": (executor, "decode_batch"),
}
# Stored JPEG tiles decoded: by a reader thread (part of "tile reads") or by the region threads
# that decode a large region's tiles for it (not part of it).
DECODE = (stored_jpeg.StoredJpegTiles, "_decode_jpeg_checked")
IN_READS, IN_REGION_THREADS = "  of which JPEG decoding", "JPEG decoding in the region threads"


class PartClock:
    """Thread CPU seconds spent in the wrapped functions (outermost call only, per thread)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, owner: object, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, label, 0)
            setattr(self._depth, label, depth + 1)
            t0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                setattr(self._depth, label, depth)
                if depth == 0:
                    where = label
                    if label == IN_READS and not getattr(self._depth, "tile reads", 0):
                        where = IN_REGION_THREADS
                    with self._lock:
                        self.seconds[where] += time.thread_time() - t0

        setattr(owner, name, timed)


def one_run(pipe: Pipeline, slide: str) -> tuple[float, float, int]:
    c0, t0 = time.process_time(), time.perf_counter()
    result = pipe.run(slide)
    return time.perf_counter() - t0, time.process_time() - c0, int(result.summary["tiles"]["read"])


def split(pipe: Pipeline, slide: str, rounds: int, clock: PartClock) -> None:
    pipe.run(slide)  # warm-up
    clock.seconds.clear()
    walls, cpus, n = [], [], 0
    for _ in range(rounds):
        wall, cpu, n = one_run(pipe, slide)
        walls.append(wall)
        cpus.append(cpu)
    wall, cpu = sum(walls) / rounds, sum(cpus) / rounds
    parts = {k: v / rounds for k, v in clock.seconds.items()}
    print(f"\n{slide}: {n} tiles, wall {wall:.2f} s, CPU {cpu:.2f} s ({cpu / wall:.2f} cores busy)")
    print("| part | CPU s a run | ms a tile |\n| --- | --- | --- |")
    model, reads, *others = PARTS
    for label in [model, reads, IN_READS, IN_REGION_THREADS, *others]:
        print(f"| {label} | {parts.get(label, 0):.3f} | {1e3 * parts.get(label, 0) / n:.2f} |")
    rest = cpu - sum(parts.get(label, 0) for label in [*PARTS, IN_REGION_THREADS])
    print(f"| the rest | {rest:.3f} | {1e3 * rest / n:.2f} |")
    tiles = np.random.default_rng(0).integers(0, 256, (n, *pipe.card.input.size_hw, 3), np.uint8)
    batch = pipe.batch_size
    model_alone(pipe, tiles[:batch], batch)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        model_alone(pipe, tiles, batch)
    alone_wall, alone_cpu = (time.perf_counter() - t0) / rounds, (time.process_time() - c0) / rounds
    print(
        f"model alone on {n} tiles: wall {alone_wall:.2f} s, CPU {alone_cpu:.2f} s "
        f"({alone_cpu / alone_wall:.2f} cores busy); Pipeline.run / model alone {alone_wall / wall:.3f}"
    )


def ab_region_threads(pipe: Pipeline, slide: str, rounds: int) -> None:
    shipped = stored_tiles.decodes_in_this_thread
    settings = {
        "each reader decodes its regions (now, the model on the CPU)": shipped,
        "large regions to the region threads (before)": lambda: False,
    }
    pipe.run(slide)
    seen: dict[str, list[float]] = {k: [] for k in settings}
    try:
        for r in range(rounds):
            for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
                stored_tiles.decodes_in_this_thread = settings[name]
                seen[name].append(one_run(pipe, slide)[0])
    finally:
        stored_tiles.decodes_in_this_thread = shipped
    base = statistics.median(seen[next(iter(settings))])
    for name, runs in seen.items():
        med = statistics.median(runs)
        print(f"{slide}: {name}: median {med:.3f} s ({med / base:.3f}x the time), runs {[round(x, 2) for x in runs]}")


def decoders(slide_path: str) -> None:
    import io

    import cv2
    import imagecodecs
    import simplejpeg
    from PIL import Image

    from wsi_pipeline.slide import open_slide

    with open_slide(slide_path) as slide:
        tw, th, across, down = slide.tile_grid_shape(0)
        streams = [
            slide.raw_tile_jpeg(0, tx, ty)
            for ty in range(down // 2 - 3, down // 2 + 3)
            for tx in range(across // 2 - 5, across // 2 + 5)
        ]
    ways = {
        "simplejpeg": lambda d: simplejpeg.decode_jpeg(d, colorspace="RGB"),
        "imagecodecs": lambda d: imagecodecs.jpeg8_decode(d),
        "OpenCV": lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_UNCHANGED),
        "Pillow": lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB")),
    }
    kb = sum(map(len, streams)) / len(streams) / 1024
    for name, decode in ways.items():
        decode(streams[0])
        t0 = time.perf_counter()
        for _ in range(5):
            for d in streams:
                decode(d)
        us = 1e6 * (time.perf_counter() - t0) / (5 * len(streams))
        print(f"{slide_path}: {name}: {us:.0f} us a {tw} x {th} px tile ({kb:.1f} KB on average)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slides", nargs="+")
    ap.add_argument("--mpp", type=float, default=0.0)
    ap.add_argument("--resample", default="area", choices=["area", "reduced"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ab-region-threads", action="store_true")
    ap.add_argument("--decoders", action="store_true")
    args = ap.parse_args()
    if args.decoders:
        for slide in args.slides:
            decoders(slide)
        return 0
    with Pipeline.from_card(backend="ort", resample=args.resample, **({"mpp": args.mpp} if args.mpp else {})) as pipe:
        if args.ab_region_threads:
            for slide in args.slides:
                ab_region_threads(pipe, slide, args.rounds)
            return 0
        clock = PartClock()
        for label, (owner, name) in {**PARTS, IN_READS: DECODE}.items():
            clock.wrap(owner, name, label)
        for slide in args.slides:
            split(pipe, slide, args.rounds, clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
