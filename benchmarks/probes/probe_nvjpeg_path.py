"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 15:4x–16:1x UTC: JPEG helper processes beside nvJPEG".

Which nvJPEG path decodes a slide's stored tiles, and whether CPU decoding processes add to it.

Usage: ``python benchmarks/probes/probe_nvjpeg_path.py SLIDE [--processes 0,4,8,12] [--seconds 2]``
(a CUDA machine). Prints one JSON object:

``hardware``
    what libnvjpeg (the one torchvision's extension loaded) says of its hardware backend:
    the status of creating a handle with it, the engines it reports, and whether the slide's
    first stored tile can go to the batched hardware decoder (``nvjpegDecodeBatchedSupported``,
    0 = supported).
``one_call``
    one ``decode_jpegs_cuda`` call of 256 stored tiles under ``torch.profiler``: the wall and the
    process CPU seconds (CPU seconds near the wall mean host-side Huffman decoding), and the
    CUDA kernels it ran (name, count, total ms).
``with_processes``
    nvJPEG decoding calls of 256 stored tiles for ``--seconds`` while N processes decode stored
    tiles with libjpeg-turbo (imagecodecs) into shared memory without pause: nvJPEG's rate
    and the processes' together, for each N.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/


def _worker(slide: str, shm_name: str, slot0: int, count, stop) -> None:
    import imagecodecs
    import numpy as np
    from bench_product_gpu import stored_tiles

    raw = [r for r in stored_tiles(slide) if r]
    shm = shared_memory.SharedMemory(shm_name)
    out = np.ndarray((8, 256, 256, 3), np.uint8, shm.buf, offset=slot0 * 8 * 256 * 256 * 3)
    i = 0
    while not stop.is_set():
        imagecodecs.jpeg8_decode(raw[i % len(raw)], out=out[i % 8])
        i += 1
        if i % 64 == 0:
            with count.get_lock():
                count.value += 64
    del out
    shm.close()


def _nvjpeg_lib():
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libnvjpeg" in line})
    return (ctypes.CDLL(paths[0]), paths[0]) if paths else (None, None)


def hardware(first_tile: bytes) -> dict:
    lib, path = _nvjpeg_lib()
    if lib is None:
        return {"libnvjpeg": None}
    out: dict = {"libnvjpeg": path}
    handle = ctypes.c_void_p()
    status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(handle))  # NVJPEG_BACKEND_HARDWARE
    out["create_hardware_status"] = status  # 0 success, 7 arch mismatch
    if status != 0:
        handle = ctypes.c_void_p()
        out["create_default_status"] = lib.nvjpegCreateEx(0, None, None, 0, ctypes.byref(handle))
    if hasattr(lib, "nvjpegGetHardwareDecoderInfo"):
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        out["hardware_info_status"] = lib.nvjpegGetHardwareDecoderInfo(
            handle, ctypes.byref(engines), ctypes.byref(cores)
        )
        out["engines"], out["cores_per_engine"] = engines.value, cores.value
    stream = ctypes.c_void_p()
    lib.nvjpegJpegStreamCreate(handle, ctypes.byref(stream))
    buf = ctypes.create_string_buffer(first_tile, len(first_tile))
    out["parse_status"] = lib.nvjpegJpegStreamParseHeader(handle, buf, ctypes.c_size_t(len(first_tile)), stream)
    supported = ctypes.c_int(-1)
    out["batched_supported_status"] = lib.nvjpegDecodeBatchedSupported(handle, stream, ctypes.byref(supported))
    out["batched_supported"] = supported.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--processes", default="0,4,8,12")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")  # started before CUDA is
    counts = [int(p) for p in args.processes.split(",")]
    stop_events = {n: ctx.Event() for n in counts}
    shm = shared_memory.SharedMemory(create=True, size=max(1, max(counts)) * 8 * 256 * 256 * 3)

    import torch
    import torchvision.io
    from bench_product_gpu import stored_tiles

    raw = [r for r in stored_tiles(args.slide) if r]
    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    torchvision.io.decode_jpeg(data[:256], device="cuda")
    torch.cuda.synchronize()
    result: dict = {"stored_tiles": len(data), "hardware": hardware(raw[0])}

    from torch.profiler import ProfilerActivity, profile

    c0, t0 = time.process_time(), time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torchvision.io.decode_jpeg(data[256:512], device="cuda")
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:80], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total / 1000 if hasattr(e, "device_time_total") else e.cuda_time_total / 1000
    result["one_call"] = {
        "wall_ms_profiled": round(wall * 1000, 1),
        "process_cpu_ms": round(cpu * 1000, 1),
        "kernels": sorted(([n, c, round(ms, 2)] for n, (c, ms) in kernels.items()), key=lambda r: -r[2])[:12],
    }
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, 2048, 256):
        torchvision.io.decode_jpeg(data[i : i + 256], device="cuda")
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    result["eight_calls_unprofiled"] = {"wall_ms": round(wall * 1000, 1), "process_cpu_ms": round(cpu * 1000, 1)}

    rows = []
    for n in counts:
        count = ctx.Value("q", 0)
        stop = stop_events[n]
        procs = [
            ctx.Process(target=_worker, args=(args.slide, shm.name, k, count, stop), daemon=True) for k in range(n)
        ]
        for p in procs:
            p.start()
        time.sleep(3.0 if n else 0)  # let them read the slide and start decoding
        c_start = count.value
        t0 = time.perf_counter()
        decoded = 0
        i = 0
        while time.perf_counter() - t0 < args.seconds:
            chunk = data[i % len(data) : i % len(data) + 256] or data[:256]
            torchvision.io.decode_jpeg(chunk, device="cuda")
            decoded += len(chunk)
            i += 256
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        cpu_rate = (count.value - c_start) / dt
        stop.set()
        for p in procs:
            p.join(10)
        rows.append(
            {
                "processes": n,
                "nvjpeg_stored_tiles_per_s": round(decoded / dt),
                "processes_stored_tiles_per_s": round(cpu_rate),
                "together": round(decoded / dt + cpu_rate),
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    result["with_processes"] = rows
    shm.close()
    shm.unlink()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
