"""Reader throughput: the tifffile grid path against OpenSlide's read_region.

Writes a synthetic pathology slide (default 20,000 x 20,000, JPEG tiles of
256 px), then reads the same 512 px / 448 px-step grid:

1. OpenSlide ``read_region`` on one thread;
2. the tifffile backend on one thread (stored tiles decoded once, cached);
3. the TileLoader with 1 and with 2 worker threads over the tifffile backend.

Figures are patches of 512 x 512 per second, and ratios taken in the same
run (the machine is shared and noisy, ratios less so).

    python benchmarks/bench_reader.py [--size 20000] [--tiles 600] [--slide PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from wsi_pipeline import open_slide
from wsi_pipeline.slide.synthetic import write_synthetic_slide
from wsi_pipeline.tiling import TileGrid, TileLoader, read_tile


def _rate(fn, tiles) -> float:
    t = time.perf_counter()
    fn(tiles)
    return len(tiles) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=20000, help="slide width and height (px)")
    ap.add_argument("--tiles", type=int, default=600, help="grid patches read per measurement")
    ap.add_argument("--slide", help="use this slide instead of writing one")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench_reader_")
    path = args.slide
    if path is None:
        path = os.path.join(tmp, "bench.tiff")
        t = time.perf_counter()
        write_synthetic_slide(path, args.size, args.size, seed=7, kind="pathology")
        print(f"wrote {args.size}x{args.size} synthetic slide in {time.perf_counter() - t:.1f} s "
              f"({os.path.getsize(path) / 1e6:.0f} MB)")

    with open_slide(path, "openslide") as ref, open_slide(path, "tifffile") as fast:
        grid = TileGrid(fast, 512, 64)
        # A contiguous band of grid rows from the middle, where the tissue is.
        start = (grid.n_rows // 3) * grid.n_cols
        tiles = list(grid)[start:start + args.tiles]
        print(f"grid {grid.n_rows}x{grid.n_cols}, measuring {len(tiles)} patches of 512 px, step 448")

        def run_openslide(ts):
            for t in ts:
                ref.read_region((t.x0_level0, t.y0_level0), 0, (512, 512))

        def run_tiff(ts):
            for t in ts:
                read_tile(fast, t)

        def run_loader(workers):
            def go(ts):
                with open_slide(path, "tifffile") as s:  # cold cache for each run
                    for _ in TileLoader(s, ts, batch_size=16, workers=workers, prefetch=4):
                        pass
            return go

        r_os = _rate(run_openslide, tiles)
        r_tf = _rate(run_tiff, tiles)
        r_l1 = _rate(run_loader(1), tiles)
        r_l2 = _rate(run_loader(2), tiles)

    print(f"{'path':<34}{'patches/s':>12}")
    print(f"{'openslide read_region, 1 thread':<34}{r_os:>12.1f}")
    print(f"{'tifffile grid reader, 1 thread':<34}{r_tf:>12.1f}")
    print(f"{'TileLoader tifffile, 1 worker':<34}{r_l1:>12.1f}")
    print(f"{'TileLoader tifffile, 2 workers':<34}{r_l2:>12.1f}")
    print(f"ratio tifffile / openslide (1 thread): {r_tf / r_os:.2f}x")
    print(f"ratio loader 2 workers / 1 worker:     {r_l2 / r_l1:.2f}x")


if __name__ == "__main__":
    main()
