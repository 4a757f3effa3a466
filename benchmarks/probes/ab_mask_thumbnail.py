"""Probe (2026-12-06), fed benchmarks/HISTORY.md "2026-12-06 04:4x UTC: the tissue mask from a stored level".

``Pipeline.run`` on the CPU with the tissue mask's thumbnail as before (2,048 px a side, shrunk from
the finest level that covers it) and as now (``tissue.thumbnail_side``: a stored level between 1,024
and 2,048 px read as it is), interleaved in one process::

    python benchmarks/probes/ab_mask_thumbnail.py SLIDE [SLIDE ...] [--rounds 5] [--mpp 0.5]

Prints, per slide and setting, the median run time, the tissue mask's seconds and the tiles selected.
"""

from __future__ import annotations

import argparse
import statistics
import time

from wsi_pipeline import Pipeline
from wsi_pipeline.tiling import tissue


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slides", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mpp", type=float, default=0.0)
    ap.add_argument("--backend", default="ort")
    args = ap.parse_args()
    now = tissue.thumbnail_side
    settings = {
        "before (2,048 px shrunk)": lambda slide, largest_px=tissue.DEFAULT_THUMBNAIL_SIZE: largest_px,
        "now": now,
    }
    with Pipeline.from_card(backend=args.backend, **({"mpp": args.mpp} if args.mpp else {})) as pipe:
        for slide in args.slides:
            pipe.run(slide)  # warm-up
            seen: dict[str, list] = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name, rule in settings.items():
                    tissue.thumbnail_side = rule
                    t0 = time.perf_counter()
                    r = pipe.run(slide)
                    seen[name].append(
                        (time.perf_counter() - t0, r.summary["seconds"]["tissue_mask"], r.summary["tiles"]["read"])
                    )
            tissue.thumbnail_side = now
            base = statistics.median(s[0] for s in seen["before (2,048 px shrunk)"])
            for name, runs in seen.items():
                wall = statistics.median(s[0] for s in runs)
                mask = statistics.median(s[1] for s in runs)
                speed = f"{base / wall:.2f}x before"
                print(f"{slide} {name:26} run {wall:.3f} s ({speed}), tissue mask {mask:.3f} s, tiles {runs[-1][2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
