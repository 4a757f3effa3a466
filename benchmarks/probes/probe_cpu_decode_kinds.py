"""Probe (2026-12-04, fed BENCHMARKS.md "Storage kinds"): one CPU core's rate of decoding a slide's
stored tiles, per JPEG kind, as the reader decodes them (``decode_stored_tile``: the CPU path's and
the GPU path's helper processes' decoder), and with simplejpeg and imagecodecs called directly.

    python benchmarks/probes/probe_cpu_decode_kinds.py [--slide-px 3072]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import imagecodecs
import numpy as np
import simplejpeg

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from wsi_pipeline.slide import open_slide  # noqa: E402
from wsi_pipeline.slide.jpeg_kind import with_tables as _with_tables  # noqa: E402
from wsi_pipeline.synthetic import write_synthetic_slide  # noqa: E402
from wsi_pipeline.synthetic.storage import write_storage  # noqa: E402


def rate(fn, items, rounds: int = 3) -> float:
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        best = max(best, len(items) / (time.perf_counter() - t0))
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slide-px", type=int, default=3072)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe_cpu_decode_"))
    write_synthetic_slide(work / "synth.tiff", args.slide_px, args.slide_px, seed=7)
    with open_slide(work / "synth.tiff") as src:
        paths = {
            k: write_storage(src, work / f"{k}.{'svs' if k == 'svs' else 'tiff'}", k)["path"]
            for k in ("tiff-ycbcr420", "tiff-ycbcr444", "tiff-rgb", "svs")
        }
    for kind, path in paths.items():
        with open_slide(path) as s:
            lv = s._levels[0]
            coords = [(x, y) for y in range(lv.tiles_down) for x in range(lv.tiles_across)]
            out = np.empty((lv.tile_h, lv.tile_w, 3), np.uint8)
            streams = [_with_tables(lv.jpegtables, s.raw_tile(0, x, y)) for x, y in coords]
            reader = rate(lambda c, s=s, out=out: s.decode_stored_tile(0, c[0], c[1], out), coords)
            simple = rate(lambda r, out=out: simplejpeg.decode_jpeg(r, buffer=out), streams)
            codecs = rate(lambda r, out=out: imagecodecs.jpeg8_decode(r, out=out), streams)
            print(
                f"{kind}: {s.stored_tile_format(0)['jpeg_kind']}, {len(coords)} tiles of {lv.tile_w} px: reader "
                f"{reader:.0f}/s, simplejpeg {simple:.0f}/s, imagecodecs {codecs:.0f}/s (best of 3)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
