"""The stitcher alone: synthetic tile results shaped like a 32k x 32k slide's, through ``Stitcher``.

Usage: ``python benchmarks/bench_stitcher.py [--rounds 3] [--profile] [--merge thread|process] [--json out.json]``
(``--smoke``: an 8192 px slide, one round: seconds, to check the tool runs).
A 32768 x 32768 slide at the pathology model's geometry (512 px tiles, overlap 64, heatmap
stride 8, two heatmap classes), a disc of tissue (2,413 of 5,329 tiles), 98 boxes a tile, batches
of 64 in grid order; heatmap sinks as ``Pipeline.run`` builds them without an output folder
(statistics, reduced copy). A side path: no reading, no model. ``--merge process``: the boxes
merged in a box-merging process, as ``Pipeline.run`` merges a slide of 256 tiles or more. Prints
seconds and tiles/s per round, and the seconds of its ``Stitcher.finish``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
from harness import SMOKE_ROUNDS, add_common_args, machine, write_json

from wsi_pipeline.config import RunConfig
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.inference.tile_detections import BatchDetections, TileDetections
from wsi_pipeline.outputs import SlideOutputs
from wsi_pipeline.pipeline import DEFAULT_MODEL
from wsi_pipeline.stitch.merge_runner import MergeProcess
from wsi_pipeline.stitch.policies import merge_policy
from wsi_pipeline.stitch.stitcher import Stitcher
from wsi_pipeline.tiling.grid import TileGrid
from wsi_pipeline.tiling.tissue import TissueMask


class _Slide:
    """The little of a slide the geometry and the outputs read."""

    path = "synthetic 32k"
    dimensions = (32768, 32768)
    mpp = (0.25, 0.25)
    level_count = 1
    level_downsamples = (1.0,)

    def best_level_for_downsample(self, downsample: float) -> int:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print a cProfile summary of one more round")
    ap.add_argument("--merge", choices=("thread", "process"), default="thread")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds = SMOKE_ROUNDS
    merging = MergeProcess() if args.merge == "process" else None
    card, cfg, slide = load_card(DEFAULT_MODEL), RunConfig(), _Slide()
    if args.smoke:
        slide.dimensions, slide.path = (8192, 8192), "synthetic 8k"
    geometry = TilingGeometry.for_slide(slide, 512, 64, heatmap_stride=8)
    grid = TileGrid(slide, geometry=geometry)
    yy, xx = np.mgrid[0:256, 0:256]
    mask_downsample = slide.dimensions[0] / 256
    mask = TissueMask(((yy - 128) ** 2 + (xx - 128) ** 2) < 95**2, (mask_downsample, mask_downsample))
    tiles = grid.select(mask.tile_fractions(grid), 0.05)
    rng = np.random.default_rng(0)

    def detections() -> TileDetections:
        xy = rng.uniform(0, 500, (98, 2)).astype(np.float32)
        wh = rng.uniform(8, 16, (98, 2)).astype(np.float32)
        return TileDetections(
            np.concatenate([xy, xy + wh], 1),
            rng.uniform(0.3, 1, 98).astype(np.float32),
            rng.integers(0, 2, 98),
            rng.random((2, 64, 64), dtype=np.float32),
        )

    pool = [detections() for _ in range(256)]
    # As the executor hands them over: one BatchDetections per batch of 64.
    batches = [
        BatchDetections.from_tiles([pool[(i + j) % len(pool)] for j in range(len(tiles[i : i + 64]))])
        for i in range(0, len(tiles), 64)
    ]

    def run() -> tuple[int, float]:
        outputs = SlideOutputs(geometry, card, cfg, slide, mask, None, False)
        policy = merge_policy("nms")
        merge = merging.merge(policy) if merging is not None else None
        stitcher = Stitcher(geometry, policy, None, outputs.heatmap_sink, outputs.heatmap_weights, 2, merge=merge)
        for k, i in enumerate(range(0, len(tiles), 64)):
            stitcher.add_batch(tiles[i : i + 64], batches[k])
        t0 = time.perf_counter()
        n = len(stitcher.finish()[0])
        finish_s = time.perf_counter() - t0
        outputs.close_heatmap()  # the sinks' thread done too
        return n, finish_s

    print(f"{len(tiles)} of {len(grid)} tiles")
    rounds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        n, finish_s = run()
        dt = time.perf_counter() - t0
        print(f"{dt:.2f} s, {len(tiles) / dt:,.0f} tiles/s, {n} boxes kept; finish {finish_s * 1000:.0f} ms")
        rounds.append({"seconds": dt, "tiles_per_s": len(tiles) / dt, "boxes_kept": n, "finish_s": finish_s})
    write_json(
        args.json,
        {**machine(), "smoke": args.smoke, "slide_px": slide.dimensions[0], "tiles": len(tiles), "rounds": rounds},
    )
    if args.profile:
        cProfile.runctx("run()", globals(), {"run": run}, "/tmp/bench_stitcher.prof")
        pstats.Stats("/tmp/bench_stitcher.prof").sort_stats("tottime").print_stats(20)
    if merging is not None:
        merging.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
