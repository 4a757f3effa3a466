"""Probe (2026-12-06), fed benchmarks/HISTORY.md "2026-12-06 02:33 UTC: every storage kind on the CPU".

``resample = reduced`` against ``area`` on the same tiles, and the decoder alone (side path) on one
240 px tile of each JPEG kind, whole and at 1/2::

    python benchmarks/probes/probe_reduced_decode.py

Writes a 4000 x 3000 SVS of another writer's layout (tests/helpers/slide_corpus.py) in RGB
(component ids 0, 1, 2, JPEGTables) and in YCbCr 4:2:0, reads tiles at a 2x and 4x factor with
``read_tile`` both ways, and prints the mean, 99.9th percentile and largest absolute difference
per tile (the last tile reaches past the slide's edge).
"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import simplejpeg

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import smooth_rgb  # noqa: E402
from helpers.slide_corpus import aperio_layouts, encode_tile, write_layout  # noqa: E402

from wsi_pipeline.slide import open_slide  # noqa: E402
from wsi_pipeline.tiling.grid import Tile, read_tile  # noqa: E402


def main() -> None:
    origins = [(0, 0), (896, 896), (2048, 1024), (3584, 2688)]
    for flavour in ("rgb-012+tables", "ycbcr-jfif"):
        layout = next(lay for lay in aperio_layouts(flavour, 4000, 3000) if lay.name == "aperio-reduced-flagged")
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "s.svs")
            write_layout(path, layout, smooth_rgb(3000, 4000, 3))
            with open_slide(path, "tifffile") as s:
                for k in (2, 4):
                    rows = []
                    for i, (x, y) in enumerate(origins):
                        t = Tile(i, 0, 0, x, y, 512, float(k), 0, 512 * k)
                        s.reduced_decode = False
                        area = read_tile(s, t).astype(int)
                        s.reduced_decode = True
                        d = np.abs(area - read_tile(s, t))
                        rows.append((round(float(d.mean()), 2), int(np.percentile(d, 99.9)), int(d.max())))
                    print(flavour, f"1/{k}", "(mean, 99.9 %, max) per tile:", rows)
    tile = smooth_rgb(240, 240, 3)
    for flavour in ("rgb-adobe", "ycbcr-jfif"):
        stream = encode_tile(tile, flavour)
        for what, kw in (("whole", {}), ("1/2", {"min_width": 120, "min_height": 120})):
            simplejpeg.decode_jpeg(stream, **kw)
            t0 = time.perf_counter()
            for _ in range(300):
                simplejpeg.decode_jpeg(stream, strict=True, **kw)
            print(
                f"decoder alone (side path), {flavour} 240 px, {what}: {(time.perf_counter() - t0) / 300 * 1e6:.0f} us"
            )


if __name__ == "__main__":
    main()
