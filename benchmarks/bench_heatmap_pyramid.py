"""Closing a heatmap OME-TIFF: its reduced levels (2x2 means) and the compressed file, timed.

    python benchmarks/bench_heatmap_pyramid.py [--size 4096] [--channels 2] [--rounds 3] [--json out.json]
    python benchmarks/bench_heatmap_pyramid.py --smoke      # seconds: a small heatmap, one round

Streams a random ``channels x size x size`` heatmap (uint8, the default) into
:class:`~wsi_pipeline.io.ome_tiff.OmeTiffHeatmapWriter`, then times ``close()``:
the pyramid built from the spooled level 0 and the tiled, compressed file
written. A side path: the writer alone, as a run with an output folder uses it
(the 32k benchmark slide's heatmap is 2 x 4096 x 4096). Prints the best of
``--rounds`` and a digest of the file's pixels (equal digests: equal levels).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import tifffile
from harness import SMOKE_ROUNDS, SMOKE_SLIDE_PX, add_common_args, machine, work_folder, write_json

from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size, args.rounds = SMOKE_SLIDE_PX, SMOKE_ROUNDS
    rows = np.random.default_rng(1).random((args.channels, args.size, args.size), dtype=np.float32)
    best, digest = float("inf"), ""
    for _ in range(args.rounds):
        path = str(work_folder("bench_pyramid_") / "heatmap.ome.tif")
        writer = OmeTiffHeatmapWriter(path, args.size, args.size, args.channels)
        for y in range(0, args.size, 256):
            writer(y, rows[:, y : y + 256])
        t0 = time.perf_counter()
        writer.close()
        best = min(best, time.perf_counter() - t0)
        h = hashlib.sha1()
        with tifffile.TiffFile(path) as tif:
            for top in tif.pages:  # one page per channel, its reduced levels in its SubIFDs
                for page in [top, *top.pages]:
                    h.update(page.asarray().tobytes())
        digest = h.hexdigest()[:12]
    print(f"{args.channels} x {args.size}^2 heatmap: close() {best:.3f} s (best of {args.rounds}); levels {digest}")
    write_json(
        args.json,
        {**machine(), "smoke": args.smoke, "size": args.size, "channels": args.channels, "close_s": best},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
