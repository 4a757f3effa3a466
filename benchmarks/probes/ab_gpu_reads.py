"""Probe (2026-12-06), fed benchmarks/HISTORY.md "2026-12-06 06:45-07:30 UTC: stored bytes read in spans".

``Pipeline.run`` on the GPU with a batch's stored JPEG bytes read as before (one read over the span
from its first to its last tile, or one read per tile where that span is over four times their bytes)
and as now (``stored_jpeg.read_spans``: a read per run of nearby tiles), with the JPEG helpers'
default share, interleaved in one process::

    python benchmarks/probes/ab_gpu_reads.py SLIDE[@MPP] [SLIDE[@MPP] ...] [--rounds 4] [--shares 6,8]

``@MPP`` runs that slide at that resolution (resampled reads). ``--shares`` adds settings with the
reads of now and that share of the stored tiles to the helpers (out of 16). Prints, per slide and
setting, the median tiles/s, its ratio to the first setting's and the run's ``tile_decode`` record.
(The runs of 06:58 and 07:28 had a third setting, a share by JPEG kind, since dropped.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import numpy as np

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import SlideError
from wsi_pipeline.slide.base import Slide
from wsi_pipeline.slide.stored_jpeg import StoredJpegTiles


def one_span_reads(self, level: int, tiles: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``StoredJpegTiles.raw_tiles_jpeg``'s reads as they were before ``read_spans`` (commit 94bcda3);
    the streams are then assembled as now."""
    if not tiles:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    offsets, counts = self._stored_ranges(level, tiles)
    has = counts > 0
    if not has.any():
        return np.zeros(0, np.uint8), np.zeros(len(tiles), np.int64)
    start = int(offsets[has].min())
    span = int((offsets + counts)[has].max()) - start
    if span > max(4 * int(counts.sum()), 1 << 24) or span > 1 << 28:
        return Slide.raw_tiles_jpeg(self, level, tiles)
    buf = np.frombuffer(os.pread(self._level_fd(level), span, start), np.uint8)
    if len(buf) < span:
        raise SlideError(self.path, f"level {level}: the file ends inside its stored tiles")
    rel = np.where(has, offsets - start, 0)
    return self._streams_from(level, tiles, buf, rel, counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slides", nargs="+")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shares", default="", help="comma-separated fixed shares (out of 16) to add")
    ap.add_argument("--backend", default="torch", help="(ort: a CPU smoke run of the probe itself)")
    args = ap.parse_args()
    spans = StoredJpegTiles.raw_tiles_jpeg
    settings: dict[str, tuple] = {"before: one span": (one_span_reads, None), "now: spans": (spans, None)}
    for share in (int(s) for s in args.shares.split(",") if s):
        settings[f"spans, share {share}"] = (spans, share)
    pipes: dict[float, Pipeline] = {}
    try:
        for spec in args.slides:
            slide, _, mpp_text = spec.partition("@")
            mpp = float(mpp_text or 0)
            if mpp not in pipes:
                pipes[mpp] = Pipeline.from_card(backend=args.backend, **({"mpp": mpp} if mpp else {}))
            pipe = pipes[mpp]
            helpers = pipe.jpeg_helpers
            default = helpers.tile_share if helpers is not None else 0
            pipe.run(slide)  # warm-up
            rates: dict[str, list[float]] = {name: [] for name in settings}
            records: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, (reads, share) in settings.items():
                    StoredJpegTiles.raw_tiles_jpeg = reads
                    if helpers is not None:
                        helpers.tile_share = default if share is None else share
                    t0 = time.perf_counter()
                    r = pipe.run(slide)
                    rates[name].append(r.summary["tiles"]["read"] / (time.perf_counter() - t0))
                    records[name] = r.summary["tile_decode"]
            StoredJpegTiles.raw_tiles_jpeg = spans
            if helpers is not None:
                helpers.tile_share = default
            base = statistics.median(rates[next(iter(settings))])
            for name, runs in rates.items():
                med = statistics.median(runs)
                runs_text = " ".join(f"{v:.0f}" for v in runs)
                print(f"{spec} | {name:28} | {med:7.0f} tiles/s | {med / base:.3f}x | runs {runs_text}")
                print(f"    {records[name]}")
    finally:
        for pipe in pipes.values():
            pipe.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
