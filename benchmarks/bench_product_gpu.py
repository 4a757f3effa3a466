"""The product path on one GPU, its ceilings and a peer, measured in one run.

Run on a CUDA machine::

    python benchmarks/bench_product_gpu.py [--slide-px 32768] [--batch-slides 6] [--json out.json]
    python benchmarks/bench_product_gpu.py --slide S.tiff --batch-only [--batch-slides 6] [--batch-args="..."]
    python benchmarks/bench_product_gpu.py --smoke      # a tiny slide, one round of each part

On a synthetic JPEG-tiled slide (``wsi-pipeline synth``, seed 7) and the
shipped pathology model with the torch backend, it prints:

- ceilings: the model alone on device data; decoding the slide's stored
  tiles with nvJPEG (batches of 1,024) and with libjpeg-turbo threads;
- the product: ``Pipeline.run(slide)`` without outputs, with the tiles
  decoded on the GPU (the default with a CUDA backend) and on the CPU (for
  2, 4, 8 and 12 reader threads), then with every output written;
- where the time goes: the GPU loader alone, loader + executor without the
  stitcher, the whole run, and a ``torch.profiler`` summary of one run;
- peak host memory per stage of one run with outputs
  (``benchmarks/probes/profile_memory_stages.py``, its own process);
- a batch: ``wsi-pipeline run`` over ``--batch-slides`` copies of the slide
  (hard links under distinct names), every output written, in its own
  process: tiles/s over the batch (process start included), when the
  first slide's folder was complete and the pace of the rest (from the
  times their ``summary.json`` files were written), peak host and GPU memory;
- MONAI's ``sliding_window_inference`` on the same slide and model (the
  level read whole by tifffile, moved to the GPU, Gaussian blend, heatmap
  output, every window of the level, no tissue skipping), where MONAI is
  installed;
- the ratios the goals are stated in.

Without a CUDA GPU (or torch) it ends with one line saying so, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import (
    ROOT,
    SMOKE_ROUNDS,
    SMOKE_SLIDE_PX,
    add_common_args,
    log,
    machine,
    require,
    require_cuda,
    synthetic_slide,
    write_json,
)

require("bench_product_gpu.py", "torch", "torchvision", extra="gpu")  # one line, not a traceback, without them

import torch  # noqa: E402
from bench_gpu import bench_model_alone  # noqa: E402

from wsi_pipeline import Pipeline  # noqa: E402
from wsi_pipeline.inference.backend import create_backend  # noqa: E402
from wsi_pipeline.slide.tiff_backend import TiffSlide  # noqa: E402

CARD = ROOT / "engines" / "nuclei_pathology.card.json"
# Timed runs of Pipeline.run and MONAI's (a smoke run does SMOKE_ROUNDS of each).
PRODUCT_RUNS, MONAI_RUNS = 3, 2


def stored_tiles(slide_path: str) -> list[bytes]:
    with TiffSlide(slide_path) as s:
        tw, th, across, down = s.tile_grid_shape(0)
        return [s.raw_tile_jpeg(0, x, y) for y in range(down) for x in range(across)]


def nvjpeg_ceiling(raw: list[bytes], batch: int = 1024) -> float:
    import torchvision.io

    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw if r]
    torchvision.io.decode_jpeg(data[:batch], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(data), batch):
        torchvision.io.decode_jpeg(data[i : i + batch], device="cuda")
    torch.cuda.synchronize()
    return len(data) / (time.perf_counter() - t0)


def cpu_decode_ceiling(raw: list[bytes], threads: int) -> float:
    import imagecodecs

    data = [r for r in raw if r]
    chunks = [data[i::threads] for i in range(threads)]

    def run(chunk):
        for r in chunk:
            imagecodecs.jpeg8_decode(r)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(run, chunks))
        return len(data) / (time.perf_counter() - t0)


def timed_run(pipe: Pipeline, slide_path: str, out_dir: str | None = None) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = pipe.run(slide_path, out_dir=out_dir)
    wall = time.perf_counter() - t0
    tiles = r.summary["tiles"]["read"]
    return {
        "seconds": round(wall, 3),
        "tiles": tiles,
        "tiles_per_s": round(tiles / wall, 1),
        "detections": int(len(r.detections)),
        "stage_seconds": r.summary["seconds"],
        "tile_decode": r.summary.get("tile_decode"),
        "box_merge": r.summary.get("box_merge"),
        "peak_gpu_memory_mb": r.summary["peak_gpu_memory_mb"],
    }


def merging_process_peak_mb(pipe: Pipeline) -> float | None:
    """Peak resident memory (MB) of the pipeline's box-merging process (not in the run's own figure)."""
    pid = pipe.merging.pid
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def split_stages(pipe: Pipeline, slide_path: str) -> dict:
    """tiles/s of the GPU loader alone, and of loader + executor without the stitcher."""
    from wsi_pipeline.slide import open_slide
    from wsi_pipeline.tiling import TileGrid, tissue_mask
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader
    from wsi_pipeline.tiling.slide_loader import GPU_DECODE_BATCHES

    out = {}
    with open_slide(slide_path) as slide:
        grid = TileGrid(slide, geometry=pipe._geometry(slide))
        tiles = grid.select(tissue_mask(slide, "otsu").tile_fractions(grid), pipe.config.min_tissue)

        def loader():
            return GpuTileLoader(
                slide,
                tiles,
                batch_size=pipe.batch_size * GPU_DECODE_BATCHES,
                prefetch=pipe.executor.streams + 1,
                decode_threads=2,
            )

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with loader() as ld:
            for b in ld:
                b.ready.synchronize()
        out["gpu_loader_alone_tiles_per_s"] = round(len(tiles) / (time.perf_counter() - t0), 1)
        t0 = time.perf_counter()
        with loader() as ld:
            n = sum(len(r.tiles) for r in pipe.executor.run(ld, ordered=True))
        out["loader_and_executor_tiles_per_s"] = round(n / (time.perf_counter() - t0), 1)
    return out


def profile_run(pipe: Pipeline, slide_path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        pipe.run(slide_path)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return {
        "wall_s": round(wall, 3),
        "gpu_kernel_s": round(device_us / 1e6, 3),
        "gpu_busy_share": round(device_us / 1e6 / wall, 3),
        "top_gpu": [(e.key, round(e.self_device_time_total / 1e3, 1)) for e in top],
    }


class StackSampler:
    """Samples every thread's Python stack every ``interval_s``: where each thread spends its wall time.

    For each thread name (numbers stripped), counts the innermost frame that
    lies in wsi_pipeline (or the innermost frame at all), so a thread waiting
    on a queue shows the project line that waits.
    """

    def __init__(self, interval_s: float = 0.002):
        import collections
        import threading

        self.interval_s = interval_s
        self.counts: dict = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        import re
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: re.sub(r"[_-]?\d+(_\d+)?$", "", t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner, f = None, frame
                while f is not None:
                    code = f.f_code
                    if "wsi_pipeline" in code.co_filename:
                        inner = f"{Path(code.co_filename).name}:{f.f_lineno} {code.co_name}"
                        break
                    f = f.f_back
                if inner is None:
                    inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                self.counts[names.get(ident, "?")][inner] += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = 8) -> dict:
        out = {}
        for name, c in self.counts.items():
            total = sum(c.values())
            out[name] = {"samples": total, "top": [(k, round(v / total, 3)) for k, v in c.most_common(top)]}
        return out


def sampled_run(pipe: Pipeline, slide_path: str) -> dict:
    with StackSampler() as sampler:
        pipe.run(slide_path)
    out = sampler.summary()
    for name, v in out.items():
        log(f"  thread {name} ({v['samples']} samples): " + "; ".join(f"{k} {p:.0%}" for k, p in v["top"]))
    return out


def batch_cli(slide_path: str, n: int, work: Path, extra_args: Sequence[str] = ()) -> dict:
    folder = work / "batch_slides"
    folder.mkdir(exist_ok=True)
    for i in range(n):
        if not (folder / f"slide_{i}.tiff").exists():
            os.link(slide_path, folder / f"slide_{i}.tiff")
    out = Path(tempfile.mkdtemp(prefix="batch_out_", dir=work))
    t0, t0_epoch = time.perf_counter(), time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsi_pipeline",
            "run",
            str(folder),
            "--out",
            str(out),
            "--backend",
            "torch",
            "--model",
            str(CARD),
            *extra_args,
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(proc.stdout[-3000:] + proc.stderr[-3000:])
        return {"returncode": proc.returncode}
    paths = sorted(out.rglob("summary.json"))
    summaries = [json.loads(p.read_text()) for p in paths]
    tiles = sum(s["tiles"]["read"] for s in summaries)
    # When each slide's folder was complete (summary.json is written last): the first one after the
    # process start, then the steady pace of the rest.
    done = sorted(p.stat().st_mtime - t0_epoch for p in paths)
    steady = (done[-1] - done[0]) / (len(done) - 1) if len(done) > 1 else None
    return {
        "slides": len(summaries),
        "seconds": round(wall, 2),
        "tiles": tiles,
        "tiles_per_s": round(tiles / wall, 1),
        "first_slide_done_s": round(done[0], 2),
        "seconds_per_slide_after_the_first": round(steady, 3) if steady else None,
        "tiles_per_s_after_the_first": round(tiles / len(done) / steady, 1) if steady else None,
        "per_slide_write_s": [s["seconds"].get("write") for s in summaries],
        "per_slide_total_s": [s["seconds"]["total"] for s in summaries],
        "first_slide_seconds": summaries[0]["seconds"] if summaries else None,
        "peak_host_memory_mb": max(s["peak_host_memory_mb"] for s in summaries),
        "peak_gpu_memory_mb": max((s["peak_gpu_memory_mb"] or 0) for s in summaries),
    }


def monai_sliding_window(slide_path: str, pipe_backend, rounds: int = MONAI_RUNS) -> dict:
    import tifffile
    from monai.inferers import sliding_window_inference

    def predictor(x: torch.Tensor) -> torch.Tensor:
        return pipe_backend._forward(x.permute(0, 2, 3, 1).to(torch.uint8).contiguous())["heatmap"].half()

    best = None
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        level = tifffile.imread(slide_path, maxworkers=os.cpu_count())
        # MONAI blends into a buffer of the input's dtype: fp16 holds 0..255 exactly and halves the traffic.
        x = torch.from_numpy(level).cuda().permute(2, 0, 1)[None].half()
        out = sliding_window_inference(
            x, roi_size=(512, 512), sw_batch_size=64, predictor=predictor, overlap=64 / 512, mode="gaussian"
        )
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
        del x, out
    h, w = level.shape[:2]
    windows = (len(range(0, max(h - 512, 0) + 448, 448))) * (len(range(0, max(w - 512, 0) + 448, 448)))
    return {"seconds": round(best, 3), "windows": windows, "tiles_per_s": round(windows / best, 1)}


def ceilings(pipe: Pipeline, slide_path: str, res: dict, save, smoke: bool) -> None:
    """The model alone on device data; the slide's stored tiles decoded by nvJPEG and by libjpeg-turbo."""
    wide = create_backend(pipe.card, "torch", device="cuda", max_batch=128)
    iters, reps = (5, SMOKE_ROUNDS) if smoke else (50, 5)
    res["model_alone_tiles_per_s"] = {b: round(bench_model_alone(wide, b, iters, reps), 1) for b in (64, 128)}
    del wide
    log(f"model alone: {res['model_alone_tiles_per_s']}")
    save()
    raw = stored_tiles(slide_path)
    res["nvjpeg_stored_tiles_per_s"] = round(nvjpeg_ceiling(raw), 1)
    res["libjpeg_stored_tiles_per_s"] = {t: round(cpu_decode_ceiling(raw, t), 1) for t in (1, 8, 16)}
    del raw
    log(
        f"decode ceilings: nvJPEG {res['nvjpeg_stored_tiles_per_s']}, libjpeg-turbo "
        f"{res['libjpeg_stored_tiles_per_s']} stored tiles/s"
    )
    save()


def product_runs(pipe: Pipeline, slide_path: str, work: Path, res: dict, save, runs: int) -> float:
    """``Pipeline.run`` with GPU decoding: timed runs, where the time goes, then with outputs; the best tiles/s."""
    pipe.run(slide_path)  # warm-up: cuDNN choices, graphs, allocator
    res["product_gpu_decode"] = [timed_run(pipe, slide_path) for _ in range(runs)]
    best = max(r["tiles_per_s"] for r in res["product_gpu_decode"])
    res["merging_process_peak_mb"] = merging_process_peak_mb(pipe)
    log(
        f"Pipeline.run (GPU decode): {[r['tiles_per_s'] for r in res['product_gpu_decode']]} tiles/s; "
        f"stages {res['product_gpu_decode'][-1]['stage_seconds']}; "
        f"box merge on a {res['product_gpu_decode'][-1]['box_merge']}, that process's peak "
        f"{res['merging_process_peak_mb']} MB"
    )
    save()
    log("where each thread's wall time goes (stack samples):")
    res["thread_samples"] = sampled_run(pipe, slide_path)
    save()
    res["split"] = split_stages(pipe, slide_path)
    log(f"split: {res['split']}")
    save()
    try:
        res["profile"] = profile_run(pipe, slide_path)
    except Exception as exc:  # the profiler's API moves between torch versions; keep the other figures
        res["profile"] = f"failed: {type(exc).__name__}: {exc}"
    log(f"profile: {res['profile']}")
    save()
    res["product_with_outputs"] = timed_run(pipe, slide_path, str(work / "one_out"))
    log(f"Pipeline.run with outputs: {res['product_with_outputs']}")
    save()
    return best


def memory_stages(slide_path: str) -> list[str] | str:
    """Peak host memory by stage of one ``Pipeline.run`` with outputs, in a process of its own."""
    mem = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "profile_memory_stages.py"), slide_path]
        + ["--backend", "torch"],
        capture_output=True,
        text=True,
    )
    stages = mem.stdout.strip().splitlines() if mem.returncode == 0 else mem.stderr[-2000:]
    log(
        "peak host memory by stage (one Pipeline.run with outputs):\n  "
        + "\n  ".join(stages if isinstance(stages, list) else [stages])
    )
    return stages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slide-px", type=int, default=32768)
    ap.add_argument("--slide", help="use this JPEG-tiled TIFF instead of writing one")
    ap.add_argument("--batch-slides", type=int, default=6)
    ap.add_argument("--cpu-workers", default="2,4,8,12", help="reader threads to try with decode = cpu")
    ap.add_argument("--skip-monai", action="store_true")
    ap.add_argument("--batch-only", action="store_true", help="only the batch (--slide needed)")
    ap.add_argument("--batch-args", default="", help="more `wsi-pipeline run` arguments for the batch")
    add_common_args(ap)
    args = ap.parse_args()
    require_cuda("bench_product_gpu.py")
    runs, monai_runs = PRODUCT_RUNS, MONAI_RUNS
    if args.smoke:
        args.slide_px, args.batch_slides, args.cpu_workers = SMOKE_SLIDE_PX, 2, "2"
        runs = monai_runs = SMOKE_ROUNDS
    work = Path(tempfile.mkdtemp(prefix="bench_product_"))
    res: dict = {**machine(gpu=True), "smoke": args.smoke, "torch": torch.__version__}

    def save() -> None:
        write_json(args.json, res)

    slide_path = args.slide or str(synthetic_slide(work / "s.tiff", args.slide_px))
    res["slide"] = {"px": args.slide_px, "bytes": os.path.getsize(slide_path)}
    if args.batch_only:
        res["batch_cli"] = batch_cli(slide_path, args.batch_slides, work, args.batch_args.split())
        log(f"batch (wsi-pipeline run {args.batch_args}, {args.batch_slides} slides, all outputs): {res['batch_cli']}")
        save()
        return 0

    pipe = Pipeline.from_card(CARD, backend="torch")
    res["pipeline"] = {
        "batch_size": pipe.batch_size,
        "streams": pipe.executor.streams,
        "reader_workers": pipe.reader_workers,
    }
    backend = pipe.executor.backend
    ceilings(pipe, slide_path, res, save, args.smoke)
    best = product_runs(pipe, slide_path, work, res, save, runs)
    pipe.close()

    res["product_cpu_decode"] = {}
    for w in [int(v) for v in args.cpu_workers.split(",") if v]:
        with Pipeline.from_card(CARD, backend="torch", decode="cpu", workers=w) as p:
            res["product_cpu_decode"][w] = timed_run(p, slide_path)
        log(f"Pipeline.run (CPU decode, {w} threads): {res['product_cpu_decode'][w]['tiles_per_s']} tiles/s")

    res["batch_cli"] = batch_cli(slide_path, args.batch_slides, work, args.batch_args.split())
    log(f"batch (wsi-pipeline run, {args.batch_slides} slides, all outputs): {res['batch_cli']}")
    save()
    res["memory_stages_mb"] = memory_stages(slide_path)
    save()

    if not args.skip_monai:
        try:
            res["monai"] = monai_sliding_window(slide_path, backend, monai_runs)
            log(f"MONAI sliding_window_inference: {res['monai']}")
        except ImportError as exc:
            res["monai"] = f"not run: {exc}"
    ratios = {"product_over_model_alone": round(best / res["model_alone_tiles_per_s"][64], 3)}
    if isinstance(res.get("monai"), dict):
        ratios["product_over_monai"] = round(best / res["monai"]["tiles_per_s"], 2)
    res["ratios"] = ratios
    log(f"ratios: {ratios}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
