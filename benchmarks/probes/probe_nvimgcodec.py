"""Probe (2026-12-04, fed BENCHMARKS.md "Storage kinds"): can nvImageCodec make a decoder here, and
does it decode RGB JPEG exactly with ColorSpec.SYCC?

    python benchmarks/probes/probe_nvimgcodec.py
"""

from __future__ import annotations

import os
import time

import imagecodecs
import numpy as np
import torch


def main() -> int:
    from nvidia import nvimgcodec as nv

    print("nvimgcodec", nv.__version__, "cuda", getattr(nv, "__cuda_version__", "?"), "from", nv.__file__)
    print("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"))
    torch.cuda.init()
    rng = np.random.default_rng(0)
    img = np.repeat(np.repeat(rng.integers(0, 255, (30, 30, 3), dtype=np.uint8), 8, 0), 8, 1)
    rgb = imagecodecs.jpeg8_encode(img, level=90, colorspace="RGB", outcolorspace="RGB")
    ycc = imagecodecs.jpeg8_encode(img, level=90, colorspace="RGB", outcolorspace="YCBCR", subsampling=(1, 1))
    ref_rgb, ref_ycc = imagecodecs.jpeg8_decode(rgb), imagecodecs.jpeg8_decode(ycc)
    variants = {
        "default": {},
        "device0": {"device_id": 0},
        "hw": {"backends": [nv.Backend(nv.BackendKind.HW_GPU_ONLY)]},
        "gpu": {"backends": [nv.Backend(nv.BackendKind.GPU_ONLY)]},
        "hybrid": {"backends": [nv.Backend(nv.BackendKind.HYBRID_CPU_GPU)]},
        "hw+gpu": {"backends": [nv.Backend(nv.BackendKind.HW_GPU_ONLY), nv.Backend(nv.BackendKind.GPU_ONLY)]},
        "cpu": {"backends": [nv.Backend(nv.BackendKind.CPU_ONLY)]},
    }
    for name, kw in variants.items():
        try:
            dec = nv.Decoder(**kw)
        except Exception as exc:
            print(f"{name}: Decoder failed: {exc}")
            continue
        for cs in ("SYCC", "SRGB"):
            try:
                params = nv.DecodeParams(color_spec=getattr(nv.ColorSpec, cs))
                data = [np.frombuffer(rgb, np.uint8)] * 256
                stream = torch.cuda.current_stream()
                out = dec.decode(data, params=params, cuda_stream=stream.cuda_stream)
                t = torch.as_tensor(out[0], device="cuda").cpu().numpy()
                t0 = time.perf_counter()
                for _ in range(4):
                    dec.decode(data, params=params, cuda_stream=stream.cuda_stream)
                torch.cuda.synchronize()
                rate = 1024 / (time.perf_counter() - t0)
                y = dec.decode([np.frombuffer(ycc, np.uint8)], params=params, cuda_stream=stream.cuda_stream)[0]
                ty = torch.as_tensor(y, device="cuda").cpu().numpy()
                print(
                    f"{name} {cs}: rgb err {np.abs(t.astype(int) - ref_rgb).mean():.3f}, ycc err "
                    f"{np.abs(ty.astype(int) - ref_ycc).mean():.3f}, shape {t.shape}, {rate:.0f} 240px/s"
                )
            except Exception as exc:
                print(f"{name} {cs}: decode failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
