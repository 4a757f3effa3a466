"""GPU throughput of 512 x 512 tiles: model ceiling, executor streams, end to end from a slide.

Run by hand on a CUDA machine::

    python benchmarks/bench_gpu.py [--model engines/NAME.onnx] [--slide-px 16384] [--json out.json]
    python benchmarks/bench_gpu.py --smoke      # seconds: a tiny slide, one round of each part

(a) the model alone on device-resident data (CUDA graph replays: the ceiling);
(b) the executor with 1, 2 and 4 streams fed from host memory (pinned copies,
    H2D, model, device-side decoding, D2H, TileDetections);
(c) end to end from a JPEG-tiled synthetic slide on disk: CPU decoding
    (TiffSlide + TileLoader threads) and GPU decoding (nvJPEG, GpuTileLoader),
    each also timed alone (the reader's own ceiling) to show where time goes.

Without ``--model`` an untrained detector of the shipped architecture
(:class:`~wsi_pipeline.models.net.CenterNetSmall`, default widths, top-k 512)
is exported to a temporary folder: the same compute as the shipped model. Without a CUDA GPU
(or torch) it ends with one line saying so, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from harness import (
    SMOKE_ROUNDS,
    SMOKE_SLIDE_PX,
    add_common_args,
    machine,
    require,
    require_cuda,
    synthetic_slide,
    work_folder,
    write_json,
)

require("bench_gpu.py", "torch", extra="gpu")  # one line naming the extra, not a traceback, without torch

import torch  # noqa: E402

from wsi_pipeline.inference.backend import create_backend  # noqa: E402
from wsi_pipeline.inference.card import load_card  # noqa: E402
from wsi_pipeline.inference.executor import Executor  # noqa: E402

# Timed rounds of each part (the best or the median is kept); a smoke run does SMOKE_ROUNDS.
ROUNDS = 2


class HostBatch:
    """A loader-like batch over host memory (release is a no-op: the data is reused)."""

    def __init__(self, images, tiles, sequence):
        self.images, self.tiles, self.sequence, self.ready = images, tiles, sequence, None

    def release(self):
        pass


def demo_card(out_dir: Path):
    from wsi_pipeline.models.export import export_with_card
    from wsi_pipeline.models.net import CenterNetSmall

    torch.manual_seed(0)
    net = CenterNetSmall(1, 2).eval()
    return export_with_card(
        net,
        out_dir / "bench_detector.onnx",
        name="bench",
        version="0",
        class_names=["nucleus"],
        class_colors=["#7b2cbf"],
        region_classes=["tissue", "tumour"],
        top_k=512,
        mpp=0.25,
        score_threshold=0.3,
    )


def fake_tiles(grid_n: int):
    from wsi_pipeline.tiling.grid import Tile

    return [Tile(i, i // 64, i % 64, 0, 0, 512, 1.0, 0, 512) for i in range(grid_n)]


def realistic_pixels(n: int, seed: int = 0) -> np.ndarray:
    import cv2

    rng = np.random.default_rng(seed)
    out = np.empty((n, 512, 512, 3), np.uint8)
    for i in range(n):
        small = (rng.random((32, 32, 3)) * 255).astype(np.uint8)
        out[i] = cv2.resize(small, (512, 512), interpolation=cv2.INTER_CUBIC)
    return out


def bench_model_alone(backend, batch: int, iters: int = 50, reps: int = 5) -> float:
    stream = torch.cuda.Stream()
    runner = backend.create_runner(stream)
    runner.input[:batch].copy_(torch.randint(0, 256, runner.input[:batch].shape, dtype=torch.uint8, device="cuda"))
    with torch.cuda.stream(stream):
        for _ in range(5):
            runner.run(batch)
        stream.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(iters):
                runner.run(batch)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000 / iters)
    return batch / statistics.median(times)


def bench_executor_host(backend, streams: int, host_batches, register_host: bool = True, rounds: int = ROUNDS) -> float:
    n = sum(len(b.tiles) for b in host_batches)
    with Executor(backend, streams=streams, register_host=register_host) as ex:
        list(ex.run(host_batches[:4]))  # warm-up: graphs, pinned buffers
        best = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            count = sum(len(r.batch) for r in ex.run(host_batches))
            dt = time.perf_counter() - t0
            assert count == n
            best = max(best, n / dt)
    return best


def stage_times_ms(backend, host: np.ndarray, reps: int = 20) -> dict:
    """Per-batch times of each stage on one stream, alone: where a batch's time goes."""
    from wsi_pipeline.inference.device_decode import DeviceDecoder

    n = host.shape[0]
    stream = torch.cuda.Stream()
    runner = backend.create_runner(stream)
    pinned = torch.empty(host.shape, dtype=torch.uint8, pin_memory=True)
    src = torch.from_numpy(host)
    dec = DeviceDecoder(backend.card)
    out = {}

    def cpu_timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3

    def gpu_timed(fn) -> float:
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            stream.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3

    out["host_memcpy_to_pinned"] = cpu_timed(lambda: pinned.copy_(src))
    out["h2d_from_pinned"] = gpu_timed(lambda: runner.input[:n].copy_(pinned, non_blocking=True))
    out["model_graph"] = gpu_timed(lambda: runner.run(n))
    outs = runner.run(n)
    torch.cuda.synchronize()
    out["device_decode"] = gpu_timed(lambda: dec.reduce(outs, n))
    red = dec.reduce(outs, n)
    host_out = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in red.items()}
    out["d2h_small_outputs"] = gpu_timed(lambda: [host_out[k].copy_(v, non_blocking=True) for k, v in red.items()])
    out["host_finish"] = cpu_timed(lambda: dec.finish({k: v.numpy() for k, v in host_out.items()}, n))
    return out


def make_loader(kind: str, slide, tiles, batch: int, streams: int, reader_workers: int):
    from wsi_pipeline.tiling.loader import TileLoader

    if kind == "cpu_decode":
        return TileLoader(
            slide, tiles, batch_size=batch, workers=reader_workers, prefetch=4, auto_release=False, max_held=streams + 3
        )
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader

    jpeg = "nvjpeg" if kind == "gpu_decode_nvjpeg" else "threads"
    return GpuTileLoader(slide, tiles, batch_size=batch, prefetch=4, decode_threads=2, jpeg_decoder=jpeg)


def bench_end_to_end(
    backend, slide_path: str, streams: int, batch: int, kind: str, reader_workers: int, rounds: int = ROUNDS
) -> dict:
    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.tiling.grid import TileGrid

    out = {}
    # The reader alone (its ceiling): a warm-up pass, then a timed pass on a
    # fresh slide so that no decoded stored tile is cached.
    for timed in (False, True):
        with TiffSlide(slide_path) as slide:
            tiles = list(TileGrid(slide))
            t0 = time.perf_counter()
            for b in make_loader(kind, slide, tiles, batch, streams, reader_workers):
                if getattr(b, "ready", None) is not None:
                    b.ready.synchronize()
                b.release()
            if timed:
                out["reader_tiles_per_s"] = len(tiles) / (time.perf_counter() - t0)
    with Executor(backend, streams=streams) as ex:
        best = None
        for _ in range(rounds):
            with TiffSlide(slide_path) as slide:
                tiles = list(TileGrid(slide))
                t0 = time.perf_counter()
                n = sum(len(r.batch) for r in ex.run(make_loader(kind, slide, tiles, batch, streams, reader_workers)))
                dt = time.perf_counter() - t0
            if best is None or dt < best:
                best = dt
    out.update(tiles=n, seconds=best, tiles_per_s=n / best)
    return out


def nvjpeg_vs_libjpeg(slide_path: str) -> str:
    """Pixel differences of nvJPEG against libjpeg-turbo on one batch of patches."""
    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.tiling.gpu_decode import GpuTileDecoder
    from wsi_pipeline.tiling.grid import TileGrid

    with TiffSlide(slide_path) as slide:
        tiles = list(TileGrid(slide))[:64]
        a = GpuTileDecoder(slide, jpeg_decoder="nvjpeg").decode(tiles).cpu().numpy().astype(np.int16)
        b = GpuTileDecoder(slide, jpeg_decoder="threads").decode(tiles).cpu().numpy().astype(np.int16)
    d = np.abs(a - b)
    big = np.argwhere(d.max(axis=3) > 32)
    where = "" if not len(big) else f", first >32 at tile {big[0][0]} y {big[0][1]} x {big[0][2]}"
    return (
        f"mean {d.mean():.3f}, p99 {np.percentile(d, 99):.0f}, p99.99 {np.percentile(d, 99.99):.0f}, "
        f"max {d.max()}, share >32 {(d > 32).mean():.2e}{where}"
    )


def profile_readers(slide_path: str, batch: int, reader_workers: int) -> dict:
    """Where a reader's time goes, per batch of patches (ms; one batch at a time)."""
    import threading as _threading

    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.tiling import gpu_decode, stored_tile_decoding
    from wsi_pipeline.tiling.grid import TileGrid

    out: dict = {}
    lock = _threading.Lock()

    def timed(obj, name, key, acc):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, wrapper)
        return fn

    for jpeg in ("threads", "nvjpeg"):
        acc: dict = {}
        with TiffSlide(slide_path) as slide:
            tiles = list(TileGrid(slide))
            dec = gpu_decode.GpuTileDecoder(slide, jpeg_decoder=jpeg)
            dec.decode(tiles[:batch])
            torch.cuda.synchronize()
            orig_fn = timed(stored_tile_decoding, "nvjpeg_decode", "nvjpeg_call", acc)
            orig_threads = timed(dec.kinds, "decode_threads", "stored_tiles_cpu_decode_and_h2d", acc)
            orig_raw = timed(slide, "raw_tile_jpeg", "raw_tile_jpeg_thread_time", acc)
            n_batches = 0
            t0 = time.perf_counter()
            for start in range(0, len(tiles), batch):
                dec.decode(tiles[start : start + batch])
                n_batches += 1
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            stored_tile_decoding.nvjpeg_decode = orig_fn
            dec.kinds.decode_threads = orig_threads
            slide.raw_tile_jpeg = orig_raw
            dec.close()
        out[f"gpu_{jpeg}"] = {
            "wall_per_batch": 1e3 * wall / n_batches,
            "tiles_per_s": len(tiles) / wall,
            **{k: 1e3 * v / n_batches for k, v in acc.items()},
        }
    acc = {}
    from wsi_pipeline.tiling.loader import TileLoader

    with TiffSlide(slide_path) as slide:
        tiles = list(TileGrid(slide))
        timed(slide, "_decode_tile", "stored_tile_decode_thread_time", acc)
        timed(slide, "read_region", "read_region_thread_time", acc)
        t0 = time.perf_counter()
        n_batches = 0
        for _batch in TileLoader(slide, tiles, batch_size=batch, workers=reader_workers, prefetch=4):
            n_batches += 1
        wall = time.perf_counter() - t0
    out["cpu_loader"] = {
        "wall_per_batch": 1e3 * wall / n_batches,
        "tiles_per_s": len(tiles) / wall,
        "workers": reader_workers,
        **{k: 1e3 * v / n_batches for k, v in acc.items()},
    }
    return out


def synthetic_slide_for(args: argparse.Namespace, work: Path) -> str:
    """``--slide``, or a synthetic pathology slide of ``--slide-px`` squared (seed 7) written under ``work``."""
    if args.slide:
        return args.slide
    path = synthetic_slide(work / "synthetic.tif", args.slide_px)
    print(f"({os.path.getsize(path) / 1e6:.0f} MB)", flush=True)
    return str(path)


def profile_main(args: argparse.Namespace, card, work: Path, record: dict) -> dict:
    """``--profile-readers``: the readers' stages (ms per batch) and batch-128 executor runs."""
    slide_path = synthetic_slide_for(args, work)
    prof = {**record, "readers_ms_per_batch": profile_readers(slide_path, args.batch, args.reader_workers)}
    for k, v in prof["readers_ms_per_batch"].items():
        print(f"{k}: " + ", ".join(f"{a} {b:,.1f}" for a, b in v.items()), flush=True)
    be = create_backend(card, "torch", device="cuda", precision=args.precision, max_batch=128)
    pixels = realistic_pixels(128 * 4)
    hb = [HostBatch(pixels[(i % 4) * 128 : (i % 4 + 1) * 128], fake_tiles(128), i) for i in range(32)]
    for s in (2, 4, 6):
        v = bench_executor_host(be, s, hb, rounds=args.rounds)
        prof[f"b_executor_host_batch128_{s}_streams"] = v
        print(f"(b) executor, host memory, batch 128, {s} streams: {v:,.0f} tiles/s", flush=True)
    for kind in ("gpu_decode_nvjpeg", "gpu_decode_threads"):
        for s in (2, 4):
            r = bench_end_to_end(be, slide_path, s, 128, kind, args.reader_workers, rounds=args.rounds)
            prof[f"c_{kind}_batch128_{s}_streams"] = r
            print(
                f"(c) {kind}, batch 128, {s} streams: {r['tiles_per_s']:,.0f} tiles/s "
                f"(reader alone {r['reader_tiles_per_s']:,.0f})",
                flush=True,
            )
    return prof


def host_parts(args: argparse.Namespace, card, results: dict):
    """(a) the model alone and (b) the executor from host memory; returns the executor's backend."""
    backend = create_backend(card, "torch", device="cuda", precision=args.precision, max_batch=max(args.batch, 128))
    iters, reps = (5, SMOKE_ROUNDS) if args.smoke else (50, 5)
    results["a_model_alone"] = {b: bench_model_alone(backend, b, iters, reps) for b in (args.batch, 128)}
    print(
        "(a) model alone, device data: "
        + ", ".join(f"batch {b}: {v:,.0f} tiles/s" for b, v in results["a_model_alone"].items()),
        flush=True,
    )
    pixels = realistic_pixels(args.batch * 8)
    n_batches = max(1, args.host_tiles // args.batch)
    tiles = fake_tiles(args.batch)
    host_batches = [
        HostBatch(pixels[(i % 8) * args.batch : (i % 8 + 1) * args.batch], tiles, i) for i in range(n_batches)
    ]
    exec_backend = create_backend(card, "torch", device="cuda", precision=args.precision, max_batch=args.batch)
    results["b_executor_host"] = {}
    for s in (1, 2, 4):
        results["b_executor_host"][s] = bench_executor_host(exec_backend, s, host_batches, rounds=args.rounds)
        print(f"(b) executor, host memory, {s} stream(s): {results['b_executor_host'][s]:,.0f} tiles/s", flush=True)
    v = bench_executor_host(exec_backend, 4, host_batches, register_host=False, rounds=args.rounds)
    results["b_executor_host_copy_via_pinned_4_streams"] = v
    print(f"(b) executor, host memory, 4 streams, copying through pinned buffers: {v:,.0f} tiles/s")
    results["stages_ms_per_batch"] = stage_times_ms(exec_backend, pixels[: args.batch], reps=2 if args.smoke else 20)
    print(
        f"    one stream, per batch of {args.batch}, ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in results["stages_ms_per_batch"].items()),
        flush=True,
    )
    return exec_backend


def slide_parts(args: argparse.Namespace, exec_backend, work: Path, results: dict) -> None:
    """(c) end to end from a slide on disk, and nvJPEG's pixels against libjpeg-turbo's."""
    slide_path = synthetic_slide_for(args, work)
    best_s = max(results["b_executor_host"], key=results["b_executor_host"].get)
    results["c_end_to_end"] = {"streams": best_s}
    ceiling = results["a_model_alone"][args.batch]
    for kind in ("cpu_decode", "gpu_decode_threads", "gpu_decode_nvjpeg"):
        r = bench_end_to_end(exec_backend, slide_path, best_s, args.batch, kind, args.reader_workers, args.rounds)
        results["c_end_to_end"][kind] = r
        print(
            f"(c) end to end, {kind}, {best_s} streams: {r['tiles_per_s']:,.0f} tiles/s "
            f"= {100 * r['tiles_per_s'] / ceiling:.0f}% of (a) ({r['tiles']} tiles in "
            f"{r['seconds']:.2f} s; reader alone {r['reader_tiles_per_s']:,.0f} tiles/s)",
            flush=True,
        )
    results["nvjpeg_vs_libjpeg"] = nvjpeg_vs_libjpeg(slide_path)
    print(f"    nvJPEG vs libjpeg-turbo pixels: {results['nvjpeg_vs_libjpeg']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="ONNX model with its card (default: untrained demo architecture)")
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slide-px", type=int, default=16384, help="side of the synthetic slide (0: skip (c))")
    ap.add_argument("--slide", help="use this JPEG-tiled TIFF instead of writing a synthetic one")
    ap.add_argument("--host-tiles", type=int, default=4096, help="tiles per pass in (b)")
    ap.add_argument("--reader-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument(
        "--profile-readers",
        action="store_true",
        help="only time the readers' stages (ms per batch) and batch-128 executor runs",
    )
    add_common_args(ap)
    args = ap.parse_args()
    require_cuda("bench_gpu.py")
    args.rounds = ROUNDS
    if args.smoke:
        args.slide_px, args.host_tiles, args.rounds = SMOKE_SLIDE_PX, 2 * args.batch, SMOKE_ROUNDS
    work = work_folder("bench_gpu_")
    card = load_card(args.model) if args.model else demo_card(work)
    record = {**machine(gpu=True), "smoke": args.smoke, "torch": torch.__version__}
    if args.profile_readers:
        write_json(args.json, profile_main(args, card, work, record))
        return 0
    results = {**record, "precision": args.precision, "batch": args.batch, "model": str(card.model_path)}
    exec_backend = host_parts(args, card, results)
    if args.slide or args.slide_px:
        slide_parts(args, exec_backend, work, results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
