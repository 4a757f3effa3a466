"""Seconds of ``Pipeline.plan`` (open the slide, find its tissue, select its tiles), repeated.

Usage: ``python benchmarks/bench_plan.py SLIDE [--calls 6] [--thumbnail] [--serial-regions] [--json out.json]``
(``--smoke`` without SLIDE: a tiny synthetic slide and one call, to check the tool runs).
One pipeline (ONNX Runtime: the plan does not use the model); prints each call's seconds (the
first opens the slide's files cold) and the number of tiles selected. ``--thumbnail`` times
only the tissue mask's thumbnail read, the slide opened afresh for each call (its tiles not
cached), and prints the median; ``--serial-regions`` decodes a region's stored tiles in the
calling thread only (no region threads), for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import SMOKE_ROUNDS, SMOKE_SLIDE_PX, add_common_args, machine, synthetic_slide, work_folder, write_json

from wsi_pipeline import Pipeline, open_slide
from wsi_pipeline.slide import stored_tiles
from wsi_pipeline.tiling.tissue import DEFAULT_THUMBNAIL_SIZE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide", nargs="?", help="the slide (with --smoke: a tiny synthetic one when left out)")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--thumbnail", action="store_true", help="time the thumbnail read only")
    ap.add_argument("--serial-regions", action="store_true", help="no region threads")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.calls = SMOKE_ROUNDS
        args.slide = args.slide or str(synthetic_slide(work_folder("bench_plan_") / "s.tiff", SMOKE_SLIDE_PX))
    elif args.slide is None:
        ap.error("the slide is needed (or --smoke)")
    if args.serial_regions:
        stored_tiles.PARALLEL_REGION_TILES = 1 << 62
    seconds, tiles = [], 0
    if args.thumbnail:
        for _ in range(args.calls):
            with open_slide(args.slide) as slide:
                t0 = time.perf_counter()
                slide.get_thumbnail(DEFAULT_THUMBNAIL_SIZE)
                seconds.append(round(time.perf_counter() - t0, 4))
        print(f"thumbnail seconds {seconds}; median {statistics.median(seconds):.4f}")
        write_json(args.json, {**machine(), "smoke": args.smoke, "thumbnail_seconds": seconds})
        return 0
    with Pipeline.from_card(backend="ort") as pipe:
        for _ in range(args.calls):
            t0 = time.perf_counter()
            plan = pipe.plan(args.slide)
            seconds.append(round(time.perf_counter() - t0, 3))
            tiles = len(plan.tiles)
            plan.close()
    print(f"plan seconds {seconds}; {tiles} tiles selected")
    write_json(args.json, {**machine(), "smoke": args.smoke, "plan_seconds": seconds, "tiles": tiles})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
