"""Stitcher benchmarks: global NMS speed and heatmap-blending memory.

Run by hand:  .venv/bin/python benchmarks/bench_stitch.py [--quick] [--no-writer] [--json out.json]
(``--smoke``: 10k boxes, one small slide, one round: seconds, to check the tool runs.)

1. global_nms on 100k and 1M boxes (10-20 px objects spread over a
   100k x 100k slide, 1-3 jittered duplicates each as tile seams produce),
   one core, best of 3.
2. Peak memory (tracemalloc: numpy and Python allocations) of blending the
   heatmap of 20k x 20k, 100k x 20k and 100k x 100k slides (tiles 512,
   overlap 64, stride 8, downsample 1: a 100k x 100k slide is a 12.5k x 12.5k
   canvas; 2 channels, every fifth tile skipped), each in a fresh process,
   into a null sink and into the OME-TIFF writer (spooled in the temp
   directory). The band is as wide as the canvas, so the peak follows the
   slide's width; it must not grow with its height (100k x 20k vs 100k x 100k).
   Peak RSS (VmHWM) also counts the spool memmap's file pages that were touched.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402
from harness import SMOKE_ROUNDS, add_common_args, machine, timed_rounds, write_json  # noqa: E402


def seam_boxes(n_boxes: int, slide_px: int = 100_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_objects = int(n_boxes / 2.0) + 1
    centres = rng.uniform(0, slide_px, (n_objects, 2))
    sides = rng.uniform(10, 20, (n_objects, 1))
    reps = rng.integers(1, 4, n_objects)
    c = np.repeat(centres, reps, 0) + rng.normal(0, 1.5, (reps.sum(), 2))
    s = np.repeat(sides, reps, 0) * rng.uniform(0.85, 1.15, (reps.sum(), 1))
    boxes = np.concatenate([c - s / 2, c + s / 2], 1).astype(np.float32)[:n_boxes]
    scores = rng.random(len(boxes)).astype(np.float32)
    return boxes, scores


def bench_nms(n_boxes: int, rounds: int = 3) -> tuple[float, int]:
    """Best seconds of ``rounds`` global NMS calls over ``n_boxes`` seam boxes, and the boxes kept."""
    from wsi_pipeline.stitch import global_nms

    boxes, scores = seam_boxes(n_boxes)
    kept = len(global_nms(boxes, scores, iou_threshold=0.5))
    return min(timed_rounds(lambda: global_nms(boxes, scores, iou_threshold=0.5), rounds)), kept


def _blend_case(width_px: int, height_px: int, use_writer: bool) -> tuple[int, int, float, tuple[int, int]]:
    from wsi_pipeline.geometry import TilingGeometry
    from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter
    from wsi_pipeline.stitch import BlendGeometry, HeatmapBlender, tile_weights

    geom = BlendGeometry.from_tiling(TilingGeometry(width_px, height_px, 512, 64, heatmap_stride=8))
    channels = 2
    t = geom.tile_size_out
    tiles = [np.full((channels, t, t), v, dtype=np.float32) for v in np.linspace(0, 1, 7)]
    tmp = tempfile.TemporaryDirectory()
    tracemalloc.start()
    t0 = time.perf_counter()
    if use_writer:
        sink = OmeTiffHeatmapWriter(
            os.path.join(tmp.name, "heatmap.ome.tif"), geom.out_width, geom.out_height, channels, tile=256
        )
    else:

        def sink(y0: int, rows: np.ndarray) -> None:
            return None

    blender = HeatmapBlender(geom, channels, tile_weights(t, "gaussian"), sink, window_rows=3)
    for r in range(geom.n_rows):
        for c in range(geom.n_cols):
            if (r * 7 + c) % 5 == 0:
                blender.skip(r, c)
            else:
                blender.add(r, c, tiles[(r + c) % len(tiles)])
    blender.close()
    if use_writer:
        sink.close()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tmp.cleanup()
    return peak, _peak_rss_kib(), seconds, (geom.out_height, geom.out_width)


def _peak_rss_kib() -> int:
    # VmHWM is this process's own high-water mark; ru_maxrss on Linux carries
    # the parent's peak across fork + exec.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def bench_blend(width_px: int, height_px: int, use_writer: bool) -> tuple[int, int, float, tuple[int, int]]:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_blend_case, (width_px, height_px, use_writer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (100k boxes, 20k and 40k slides)")
    parser.add_argument("--no-writer", action="store_true", help="skip the OME-TIFF writer runs")
    add_common_args(parser)
    args = parser.parse_args()
    record: dict = {**machine(), "smoke": args.smoke, "global_nms": [], "blending": []}

    print(f"{'global_nms':<34}{'boxes':>10}{'kept':>10}{'seconds':>10}")
    counts = (10_000,) if args.smoke else (100_000,) if args.quick else (100_000, 1_000_000)
    for n in counts:
        seconds, kept = bench_nms(n, SMOKE_ROUNDS if args.smoke else 3)
        print(f"{'iou 0.5, one class':<34}{n:>10,}{kept:>10,}{seconds:>10.2f}")
        record["global_nms"].append({"boxes": n, "kept": kept, "seconds": seconds})

    print()
    print(
        f"{'blending (2 ch, stride 8)':<26}{'slide w x h':>16}{'canvas':>14}{'peak MiB':>10}"
        f"{'peak RSS MiB':>14}{'seconds':>9}"
    )
    if args.smoke:
        sizes = ((4096, 4096),)
    elif args.quick:
        sizes = ((20_000, 20_000), (40_000, 20_000), (40_000, 40_000))
    else:
        sizes = ((20_000, 20_000), (100_000, 20_000), (100_000, 100_000))
    sinks = [False] if args.no_writer else [False, True]
    for use_writer in sinks:
        for width, height in sizes:
            peak, rss, seconds, shape = bench_blend(width, height, use_writer)
            name = "OME-TIFF writer" if use_writer else "null sink"
            canvas = f"{shape[0]}x{shape[1]}"
            slide = f"{width // 1000}k x {height // 1000}k"
            print(f"{name:<26}{slide:>16}{canvas:>14}{peak / 2**20:>10.1f}{rss / 1024:>14.1f}{seconds:>9.1f}")
            record["blending"].append(
                {"sink": name, "slide_px": [width, height], "peak_mib": peak / 2**20, "seconds": seconds}
            )
    write_json(args.json, record)


if __name__ == "__main__":
    main()
