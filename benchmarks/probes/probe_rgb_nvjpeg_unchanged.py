"""Probe (2026-12-06, not yet run; for benchmarks/HISTORY.md): can nvJPEG decode RGB JPEG tiles
exactly, and how fast beside nvImageCodec?

RGB JPEG levels (Aperio's SVS, RGB JPEG TIFFs) go to nvImageCodec because torchvision's nvJPEG,
asked for RGB, converts every 3-component stream from YCbCr. In the 32k runs of 2026-12-06
nvImageCodec decoded about 4,700-5,100 stored tiles/s (derived from the runs' counts) and seems to
bound those rows, against nvJPEG's 15,200. Asked for ``ImageReadMode.UNCHANGED``, torchvision's
nvJPEG returns the components as decoded (``NVJPEG_OUTPUT_UNCHANGED``): for a 4:4:4 stream whose
components are R, G, B, the pixels without any conversion. This probe checks, on a CUDA machine,
with the stored streams the reader hands the GPU decoders (``raw_tiles_jpeg``)::

    python benchmarks/probes/probe_rgb_nvjpeg_unchanged.py SLIDE [--tiles 512] [--rounds 5]

1. that the UNCHANGED decode equals the CPU reader's (libjpeg-turbo) pixels, tile by tile;
2. the batched decode rate of nvJPEG (UNCHANGED) and of nvImageCodec on the same streams.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from wsi_pipeline.slide import open_slide
from wsi_pipeline.tiling.gpu_codecs import decode_stream, image_ops_loaded, nvimgcodec_decode

READ_MODE_UNCHANGED = 0  # torchvision.io.ImageReadMode.UNCHANGED


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide", help="a slide whose level 0 holds RGB JPEG tiles")
    ap.add_argument("--tiles", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not image_ops_loaded():
        raise SystemExit("needs CUDA and torchvision's JPEG ops")
    device = torch.device("cuda")
    with open_slide(args.slide) as slide:
        print("level 0:", slide.stored_tile_format(0))
        tw, th, across, down = slide.tile_grid_shape(0)
        tiles = [(x, y) for y in range(down) for x in range(across)][: args.tiles]
        buf, lengths = slide.raw_tiles_jpeg(0, tiles)
        bounds = np.cumsum([0, *lengths.tolist()]).tolist()
        streams = [buf[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        cpu = np.empty((len(tiles), th, tw, 3), np.uint8)
        for i, (x, y) in enumerate(tiles):
            slide.decode_stored_tile(0, x, y, cpu[i])
    data = [torch.from_numpy(np.ascontiguousarray(s)) for s in streams]
    as_bytes = [s.tobytes() for s in streams]

    out = torch.ops.image.decode_jpegs_cuda(data, READ_MODE_UNCHANGED, device)
    got = torch.stack([o.permute(1, 2, 0) for o in out]).cpu().numpy()
    diff = np.abs(got.astype(np.int16) - cpu.astype(np.int16))
    print(
        f"nvJPEG UNCHANGED against the CPU reader: shape {got.shape}, max {diff.max()}, "
        f"mean {diff.mean():.4f}, tiles equal {int((diff.reshape(len(tiles), -1).max(1) == 0).sum())}/{len(tiles)}"
    )
    stream = decode_stream(device, 0)
    rates: dict[str, list[float]] = {"nvjpeg unchanged": [], "nvimgcodec": []}
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.ops.image.decode_jpegs_cuda(data, READ_MODE_UNCHANGED, device)
        torch.cuda.synchronize()
        rates["nvjpeg unchanged"].append(len(data) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            tensors, images = nvimgcodec_decode(as_bytes, device, stream)
        stream.synchronize()
        rates["nvimgcodec"].append(len(data) / (time.perf_counter() - t0))
        del tensors, images
    for name, r in rates.items():
        print(
            f"{name:18} {statistics.median(r):9.0f} stored tiles/s (median of {len(r)}), runs {[round(v) for v in r]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
