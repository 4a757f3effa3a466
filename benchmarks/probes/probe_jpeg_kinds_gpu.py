"""Probe (2026-12-04, fed BENCHMARKS.md "Storage kinds"): per JPEG kind, what the GPU decoders do
with a slide's stored tiles, and where a GPU run of each kind spends its time.

    python benchmarks/probes/probe_jpeg_kinds_gpu.py [--slide-px 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from wsi_pipeline import Pipeline  # noqa: E402
from wsi_pipeline.slide import open_slide  # noqa: E402
from wsi_pipeline.synthetic import write_synthetic_slide  # noqa: E402
from wsi_pipeline.synthetic.storage import STORAGE_KINDS, write_storage  # noqa: E402
from wsi_pipeline.tiling import TileGrid  # noqa: E402

CARD = ROOT / "engines" / "nuclei_pathology.card.json"


def stored(path: str, n: int = 2048) -> tuple[list[bytes], list[np.ndarray]]:
    import imagecodecs

    with open_slide(path) as s:
        tw, th, across, down = s.tile_grid_shape(0)
        coords = [(x, y) for y in range(down) for x in range(across)][:n]
        raw = [s.raw_tile_jpeg(0, x, y) for x, y in coords]
        ref = [s.read_region((int(x * tw), int(y * th)), 0, (tw, th)) for x, y in coords[:64]]
    del imagecodecs
    return raw, ref


def rate(fn, data, batch=1024, reps=3):
    fn(data[:batch])
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(0, len(data), batch):
            fn(data[i : i + batch])
        torch.cuda.synchronize()
        best = max(best, len(data) / (time.perf_counter() - t0))
    return round(best, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slide-px", type=int, default=16384)
    ap.add_argument("--json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe_kinds_"))
    synth = str(work / "synth.tiff")
    write_synthetic_slide(synth, args.slide_px, args.slide_px, seed=7)
    paths = {"synth": synth}
    with open_slide(synth) as src:
        for k in STORAGE_KINDS:
            paths[k] = write_storage(src, work / (k + (".svs" if k == "svs" else ".tiff")), k)["path"]
    res: dict = {}
    import torchvision.io

    try:
        from nvidia import nvimgcodec

        decs = {
            "nvimgcodec-default": nvimgcodec.Decoder(),
            "nvimgcodec-hw": nvimgcodec.Decoder(backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]),
            "nvimgcodec-cuda": nvimgcodec.Decoder(backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)]),
        }
    except Exception as exc:
        print("nvimgcodec:", exc)
        decs = {}
    for kind, path in paths.items():
        raw, ref = stored(path)
        data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
        row: dict = {}

        def tv(batch):
            return torchvision.io.decode_jpeg(batch, device="cuda", mode=torchvision.io.ImageReadMode.RGB)

        row["torchvision"] = rate(tv, data)
        out = tv(data[:64])
        row["torchvision_err"] = round(
            float(
                np.mean(
                    [
                        np.abs(o.permute(1, 2, 0).cpu().numpy().astype(int) - r).mean()
                        for o, r in zip(out, ref, strict=True)
                    ]
                )
            ),
            3,
        )
        for name, d in decs.items():
            for cs in ("SYCC", "SRGB"):
                params = nvimgcodec.DecodeParams(color_spec=getattr(nvimgcodec.ColorSpec, cs))
                npraw = [np.frombuffer(r, np.uint8) for r in raw]

                def nv(batch, d=d, params=params):
                    return d.decode(batch, params=params, cuda_stream=torch.cuda.current_stream().cuda_stream)

                try:
                    row[f"{name}-{cs}"] = rate(nv, npraw)
                    imgs = nv(npraw[:64])
                    errs = [
                        np.abs(torch.as_tensor(im, device="cuda").cpu().numpy().astype(int) - r).mean()
                        for im, r in zip(imgs, ref, strict=True)
                    ]
                    row[f"{name}-{cs}_err"] = round(float(np.mean(errs)), 3)
                except Exception as exc:
                    row[f"{name}-{cs}"] = f"{type(exc).__name__}: {exc}"[:200]
        # the loader alone and the product
        pipe = Pipeline.from_card(CARD, backend="torch", decode="gpu" if kind not in ("tiff-rgb", "svs") else "auto")
        pipe.run(path)
        t0 = time.perf_counter()
        r = pipe.run(path)
        dt = time.perf_counter() - t0
        row["product_tiles_per_s"] = round(r.summary["tiles"]["read"] / dt, 1)
        row["tile_decode"] = r.summary["tile_decode"]
        if r.summary["tile_decode"]["where"] == "gpu":
            from wsi_pipeline.tiling.gpu_loader import GpuTileLoader

            with open_slide(path) as s:
                tiles = list(TileGrid(s))
                for helpers in (None, pipe.jpeg_helpers):
                    loader = GpuTileLoader(s, tiles, batch_size=pipe.batch_size * 4, device="cuda", helpers=helpers)
                    t0 = time.perf_counter()
                    n = sum(len(b) for b in loader)
                    torch.cuda.synchronize()
                    row[f"loader_alone_{'helpers' if helpers else 'nvjpeg'}"] = round(n / (time.perf_counter() - t0), 1)
                    row[f"loader_fallbacks_{'helpers' if helpers else 'nvjpeg'}"] = loader.decoder.cpu_fallback_batches
        pipe.close()
        res[kind] = row
        print(kind, json.dumps(row, default=str), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
