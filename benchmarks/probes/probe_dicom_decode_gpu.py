"""Probe (2026-12-04, fed BENCHMARKS.md "Storage kinds"): why a DICOM WSI of 4:2:2 JPEG frames ran at
0.62 of synth's TIFF on the GPU when a tiled TIFF of 4:2:2 JPEG ran at 0.94: nvJPEG's rate on each
file's stored streams, and the GPU loader alone on each.

    python benchmarks/probes/probe_dicom_decode_gpu.py [--slide-px 12288]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import write_dicom_wsi  # noqa: E402

from wsi_pipeline.slide import open_slide  # noqa: E402
from wsi_pipeline.synthetic import write_synthetic_slide  # noqa: E402
from wsi_pipeline.synthetic.storage import write_storage  # noqa: E402
from wsi_pipeline.tiling import TileGrid  # noqa: E402
from wsi_pipeline.tiling.gpu_codecs import nvjpeg_decode  # noqa: E402
from wsi_pipeline.tiling.gpu_loader import GpuTileLoader  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slide-px", type=int, default=12288)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe_dicom_"))
    synth = work / "synth.tiff"
    write_synthetic_slide(synth, args.slide_px, args.slide_px, seed=7)
    paths = {}
    with open_slide(synth) as src:
        paths["tiff-422-256"] = write_storage(src, work / "t422.tiff", "tiff-ycbcr422", tile_size=256)["path"]
        image = src.read_region((0, 0), 0, src.dimensions)
    (work / "dcm").mkdir()
    write_dicom_wsi(work / "dcm", "slide", image, levels=4, mpp=0.25, jpeg="YBR_FULL_422")
    paths["dicom-422-256"] = str(work / "dcm")
    device = torch.device("cuda")
    for name, path in paths.items():
        with open_slide(path) as s:
            _, _, across, down = s.tile_grid_shape(0)
            coords = [(x, y) for y in range(down) for x in range(across)]
            buf, lengths = s.raw_tiles_jpeg(0, coords)
            data = list(torch.split(torch.from_numpy(buf), lengths.tolist()))
            nvjpeg_decode(data[:1024], device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(0, len(data), 1024):
                nvjpeg_decode(data[i : i + 1024], device)
            torch.cuda.synchronize()
            rate = len(data) / (time.perf_counter() - t0)
            sizes = np.asarray(lengths)
            tiles = list(TileGrid(s))
            best = 0.0
            for _ in range(3):
                loader = GpuTileLoader(s, tiles, batch_size=256, device="cuda")
                t0 = time.perf_counter()
                n = sum(len(b) for b in loader)
                torch.cuda.synchronize()
                best = max(best, n / (time.perf_counter() - t0))
            print(
                f"{name}: {len(data)} streams, mean {sizes.mean():.0f} B; nvJPEG {rate:.0f} streams/s; "
                f"loader alone (no helpers) {best:.0f} tiles/s of {len(tiles)}; levels {s.level_dimensions}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
