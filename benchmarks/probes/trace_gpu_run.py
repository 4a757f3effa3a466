"""Probe (2026-12-04), fed benchmarks/HISTORY.md "2026-12-04 01:1x–01:5x UTC: a slide's files queued longest first,
nvJPEG set up while the model loads".

Where one GPU ``Pipeline.run`` spends its time: seconds inside its main calls, per thread.

Run on a CUDA machine::

    python benchmarks/probes/trace_gpu_run.py SLIDE [--runs 2] [--mpp 0.5]
    python benchmarks/probes/trace_gpu_run.py SLIDE --batch 6 --out DIR


Wraps the calls that carry a run (nvJPEG decoding, a loader batch's assembly,
the hand-off wait, reading stored tiles, a worker's batch, waiting on CUDA
events, the host decoder, the stitcher) with timers that add up wall seconds
per call site and thread (names without their numbers), then runs the
pipeline (torch backend, no outputs) once to warm up and ``--runs`` times
measured (``--cold``: without the warm-up, each run's calls printed, the
first run being the process's first). Prints, for the last run, each thread's seconds per call site next
to the run's wall time. Nested calls are counted in both (a batch's
assembly includes its nvJPEG call).

``--batch N --out DIR`` traces a batch instead: N runs of the slide with
every output, each started while the previous one's files are still being
written, the way the batch's slide process runs them (``start_slide`` with
``wait_written=False``, the folder finished on a thread of its own). The
output call sites are timed too, and every thread's stack is sampled; it
prints each slide's start, end of stitching and end of writing. The pipeline
is not warmed up first, as in a batch.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch

from wsi_pipeline import Pipeline, outputs, pipeline, slide_plan, slide_run
from wsi_pipeline.batch import run_key
from wsi_pipeline.batch.jobs import StartedSlide, start_slide
from wsi_pipeline.inference import cuda_worker, device_decode, torch_backend
from wsi_pipeline.io import ome_tiff, writer_pool
from wsi_pipeline.slide import base, stored_jpeg, tiff_backend
from wsi_pipeline.stitch import blend, merge_runner, stitcher
from wsi_pipeline.tiling import gpu_decode, gpu_loader, jpeg_processes, stored_tile_decoding

_totals: dict = collections.defaultdict(lambda: [0.0, 0])
_lock = threading.Lock()
# Every timed call of the run being recorded, (thread, label, start s, end s), with --events.
_events: list | None = None
# The interpreter's garbage collections: [seconds, count] per generation, while a run is timed.
_gc: dict[int, list] = collections.defaultdict(lambda: [0.0, 0])
_gc_start: list[float] = []


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start:
        entry = _gc[info["generation"]]
        entry[0] += time.perf_counter() - _gc_start[0]
        entry[1] += 1


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def _cpu_snapshot(pipe: Pipeline) -> dict[str, float]:
    snap = {"this process": _cpu_seconds(os.getpid())}
    helpers = pipe.jpeg_helpers.processes if pipe.jpeg_helpers is not None else []
    snap["JPEG helpers"] = sum(_cpu_seconds(p.pid) for p in helpers)
    if pipe.merging.pid is not None:
        snap["box merging"] = _cpu_seconds(pipe.merging.pid)
    snap["machine busy"], snap["machine"] = _machine_busy()
    snap["staging buffers made"] = _staging_made()
    return snap


def _staging_made() -> int:
    """How many JPEG helper staging buffers the process has made (their ids count up from 1)."""
    return int(re.search(r"\d+", repr(jpeg_processes.SharedStaging._ids)).group()) - 1


def _cpu_line(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    cores = d.pop("machine") / wall
    made = int(d.pop("staging buffers made"))
    return (
        "  CPU seconds: "
        + ", ".join(f"{k} {v:.2f}" for k, v in d.items())
        + f" (the machine's {cores:.0f} cores {d['machine busy'] / (cores * wall):.0%} busy); "
        + f"JPEG helper staging buffers made {made}"
    )


def _thread() -> str:
    return re.sub(r"[_-]?\d+(_\d+)?$", "", threading.current_thread().name)


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            with _lock:
                entry = _totals[(_thread(), label)]
                entry[0] += t1 - t0
                entry[1] += 1
                if _events is not None:
                    _events.append((_thread(), label, t0, t1))

    setattr(owner, name, wrapped)


# (owner, attribute, label) of the calls timed in a run, and of those added for a batch's outputs.
RUN_SITES = [
    (stored_tile_decoding, "nvjpeg_decode", "nvJPEG decode_jpeg"),
    (gpu_decode.GpuTileDecoder, "decode_after", "loader batch (all of it)"),
    (gpu_loader.HandOff, "take", "loader hand-off wait"),
    (stored_jpeg.StoredJpegTiles, "raw_tiles_jpeg", "read a batch's stored tile bytes"),
    (stored_jpeg.StoredJpegTiles, "raw_tile_jpeg", "read stored tile bytes"),
    (stored_jpeg.os, "pread", "os.pread (any caller)"),
    (stored_jpeg.os, "preadv", "os.preadv (any caller: a batch's spans)"),
    (stored_jpeg, "same_headers", "stored bytes: headers compared"),
    (stored_jpeg, "ends_with_eoi", "stored bytes: EOI checked"),
    (cuda_worker.CudaWorker, "process", "worker batch (all of it)"),
    (device_decode.DeviceDecoder, "reduce", "device output reduction"),
    (device_decode.DeviceDecoder, "finish", "host decoder"),
    (torch.cuda.Event, "synchronize", "CUDA event wait"),
    (torch_backend.TorchRunner, "run", "model launch (graph replay)"),
    (torch_backend.TorchRunner, "_capture", "model: capture a batch size's graph"),
    (stitcher.Stitcher, "add_batch", "stitcher add_batch"),
    (stitcher.Stitcher, "finish", "stitcher finish"),
    # before the first batch and after the last
    (slide_plan, "tissue_mask", "tissue mask"),
    (pipeline.Pipeline, "plan", "plan the slide"),
    (slide_run, "SlideOutputs", "outputs: set up"),
    (slide_run, "Stitcher", "stitcher: set up"),
    (merge_runner.MergeProcess, "merge", "box merge: open the slide's session"),
    (slide_run, "choose_tile_decode", "choose the decoder"),
    (slide_run, "make_slide_loader", "make the loader"),
    (gpu_decode, "stored_tiles_touched", "loader: stored tiles touched"),
    (gpu_decode.GpuTileDecoder, "_decode_into", "loader: decode into the mosaic"),
    (jpeg_processes.JpegHelpers, "start", "JPEG helpers: send a batch's share"),
    (jpeg_processes.PendingShare, "wait", "JPEG helpers: wait for the share"),
    (jpeg_processes.JpegHelpers, "acquire_staging", "JPEG helpers: staging buffer"),
    (gpu_loader.GpuTileLoader, "close", "loader: close"),
    (tiff_backend.TiffSlide, "clear_cache", "slide: clear the cache"),
    (blend.HeatmapBlender, "close", "stitcher finish: close the heatmap"),
    (merge_runner.ProcessMerge, "finish", "stitcher finish: merged boxes"),
    (stitcher, "reading_order", "stitcher finish: reading order"),
]
OUTPUT_SITES = [
    (slide_run, "build_summary", "summary"),
    (outputs.SlideOutputs, "write", "outputs: start the files"),
    (outputs.SlideOutputs, "overlay_inputs", "outputs: overlay inputs"),
    (outputs.SlideOutputs, "heatmap_scores", "outputs: heatmap statistics"),
    (outputs.SlideOutputs, "close_heatmap", "outputs: close the heatmap"),
    (base.Slide, "get_thumbnail", "thumbnail"),
    (ome_tiff.OmeTiffHeatmapWriter, "write_rows", "heatmap file: rows"),
    (ome_tiff.OmeTiffHeatmapWriter, "close", "heatmap file: pyramid, write"),
    (writer_pool.WriterPool, "submit", "writer pool: submit"),
    (writer_pool.WriteJobs, "wait", "writer pool: wait"),
    (StartedSlide, "finish", "slide folder: finish"),
]


def install(sites: list) -> None:
    for owner, name, label in sites:
        _timed(owner, name, label)


def _print_totals(wall: float) -> None:
    print(
        "  garbage collections: "
        + ", ".join(f"generation {g}: {n} in {sec * 1000:.1f} ms" for g, (sec, n) in sorted(_gc.items()))
    )
    for (thread, label), (sec, calls) in sorted(_totals.items(), key=lambda kv: (kv[0][0], -kv[1][0])):
        print(f"  {thread:<16} {label:<30} {sec:7.3f} s {sec / wall:6.1%} of the run  {calls:6d} calls")


def trace_batch(pipe: Pipeline, slide: str, n: int, out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    from bench_product_gpu import StackSampler

    key = run_key(pipe.config, pipe.card)
    marks: dict[str, list[float]] = {}
    finishing: list[threading.Thread] = []
    _totals.clear()
    _gc.clear()
    t0 = time.perf_counter()

    def finish(started: StartedSlide) -> None:
        outcome = started.finish()
        marks[started.name].append(time.perf_counter() - t0)
        if outcome.status != "done":
            print(f"{started.name}: {outcome.status} {outcome.error}")

    with StackSampler(0.005) as sampler:
        for i in range(n):
            name = f"slide_{i}"
            marks[name] = [time.perf_counter() - t0]
            started = start_slide(pipe, slide, name, out, key, wait_written=False)
            marks[name].append(time.perf_counter() - t0)
            t = threading.Thread(target=finish, args=(started,), name="finish-slide", daemon=True)
            t.start()
            finishing.append(t)
        for t in finishing:
            t.join()
    wall = time.perf_counter() - t0
    tiles = 0
    for name, (begin, stitched, written) in marks.items():
        summary = json.loads((out / "slides" / name / "summary.json").read_text())
        tiles += summary["tiles"]["read"]
        secs = {k: round(v, 2) for k, v in summary["seconds"].items() if isinstance(v, (int, float)) and v >= 0.05}
        print(f"{name}: start {begin:6.2f} s, stitched {stitched:6.2f} s, written {written:6.2f} s; {secs}")
    print(f"batch: {n} slides, {wall:.2f} s, {tiles / wall:,.0f} tiles/s")
    _print_totals(wall)
    for name, v in sampler.summary(top=10).items():
        print(f"  thread {name} ({v['samples']} samples): " + "; ".join(f"{k} {p:.0%}" for k, p in v["top"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="trace a batch of this many runs with outputs")
    ap.add_argument("--out", type=Path, help="the batch's output folder")
    ap.add_argument("--backend", default="torch", help="the backend (ort tries the script without a GPU)")
    ap.add_argument("--mpp", type=float, default=0.0, help="run at this resolution (0: the card's)")
    ap.add_argument("--events", type=Path, help="write the last run's timed calls here (JSON), with a summary")
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once the pipeline is built: what it holds then is never scanned by a collection",
    )
    ap.add_argument(
        "--cold", action="store_true", help="no warm-up run; print every run's calls (the first is the process's first)"
    )
    args = ap.parse_args()
    install(RUN_SITES)
    gc.callbacks.append(_gc_callback)
    t_build = time.perf_counter()
    with Pipeline.from_card(backend=args.backend, **({"mpp": args.mpp} if args.mpp else {})) as pipe:
        print(f"pipeline built in {time.perf_counter() - t_build:.2f} s; {len(gc.get_objects()):,} objects tracked")
        if args.gc_freeze:
            gc.freeze()
        _print_totals(time.perf_counter() - t_build)
        if args.batch:  # no warm-up: a batch's first slide is its process's first
            install(OUTPUT_SITES)
            trace_batch(pipe, args.slide, args.batch, args.out)
            return 0
        if not args.cold:
            pipe.run(args.slide)
        global _events
        for _ in range(args.runs):
            _totals.clear()
            _gc.clear()
            _events = [] if args.events else None
            cuda = torch.cuda.is_available()
            segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) if cuda else 0
            cpu0 = _cpu_snapshot(pipe)
            _gc.clear()  # the run's collections only
            t0 = time.perf_counter()
            r = pipe.run(args.slide)
            wall = time.perf_counter() - t0
            run_gc = {g: list(v) for g, v in _gc.items()}
            cpu1 = _cpu_snapshot(pipe)
            tiles = r.summary["tiles"]["read"]
            stats = torch.cuda.memory_stats() if cuda else {}
            print(
                f"run: {wall:.3f} s, {tiles / wall:,.0f} tiles/s; tile_decode {r.summary.get('tile_decode')}; "
                f"device memory segments allocated {stats.get('segment.all.allocated', 0) - segments}, "
                f"reserved {stats.get('reserved_bytes.all.current', 0) / 2**20:,.0f} MiB; "
                "garbage collections in the run "
                + ", ".join(f"{g}: {n} in {sec * 1000:.0f} ms" for g, (sec, n) in sorted(run_gc.items()))
            )
            print(_cpu_line(cpu0, cpu1, wall))
            if args.cold:
                _print_totals(wall)
        if not args.cold:
            _print_totals(wall)
        if args.events:
            _write_events(args.events, _events or [], t0, wall)
    return 0


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _write_events(path: Path, events: list, t0: float, wall: float) -> None:
    """The run's timed calls, from its start, to ``path``; prints when nvJPEG was busy and idle."""
    rel = [(th, label, round(a - t0, 5), round(b - t0, 5)) for th, label, a, b in events]
    path.write_text(json.dumps({"wall_s": wall, "events": rel}))
    busy = _union([(a, b) for _, label, a, b in rel if label.startswith("nvJPEG")])
    if not busy:
        return
    gaps = sorted(((b0 - a1, a1) for (_, a1), (b0, _) in zip(busy, busy[1:], strict=False)), reverse=True)
    print(
        f"nvJPEG: first call {busy[0][0]:.3f} s, last ends {busy[-1][1]:.3f} s of {wall:.3f} s; "
        f"busy {sum(b - a for a, b in busy):.3f} s; largest gaps "
        + ", ".join(f"{g * 1000:.0f} ms at {at:.3f} s" for g, at in gaps[:6])
    )


if __name__ == "__main__":
    raise SystemExit(main())
