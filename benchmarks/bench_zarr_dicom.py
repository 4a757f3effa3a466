"""Time and peak memory of the OME-Zarr and DICOM outputs on a whole-slide heatmap and its detections.

Each stage runs in a child process of its own, so its peak resident memory
(``ru_maxrss``) is its alone:

- ``rows``: making the synthetic rows alone (the heatmap writers' times include it);
- ``ome-zarr``: a W x H x C heatmap streamed in bands of 64 rows into
  :class:`OmeZarrHeatmapWriter` (pyramid included);
- ``ome-tiff``: the same rows into :class:`OmeTiffHeatmapWriter` (the input of the next stage);
- ``dicom-pm``: that OME-TIFF written as Parametric Maps (one per class);
- ``dicom-ann``: N detections as Microscopy Bulk Simple Annotations.

The heatmap is smooth (sums of low-frequency waves, like a model's output
blended over tiles) with a little noise, so it compresses as real heatmaps do.

    python benchmarks/bench_zarr_dicom.py [--width 25000 --height 20000 --channels 2 --detections 100000]
    python benchmarks/bench_zarr_dicom.py --smoke [--json out.json]   # seconds: a 1024 px heatmap
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from harness import SMOKE_SLIDE_PX, add_common_args, machine, require, write_json

BAND = 64


def _rows(y0: int, h: int, width: int, channels: int, rng: np.random.Generator) -> np.ndarray:
    y = np.arange(y0, y0 + h, dtype=np.float32)[:, None]
    x = np.arange(width, dtype=np.float32)[None, :]
    out = np.empty((channels, h, width), np.float32)
    for c in range(channels):
        wave = np.sin(x / (700 + 90 * c)) * np.cos(y / (500 + 60 * c)) + 0.5 * np.sin((x + y) / 1300)
        out[c] = np.clip(0.5 + 0.33 * wave + rng.normal(0, 0.01, (h, width)).astype(np.float32), 0, 1)
    return out


def _stream(writer, width: int, height: int, channels: int) -> None:
    rng = np.random.default_rng(0)
    for y in range(0, height, BAND):
        h = min(BAND, height - y)
        writer(y, _rows(y, h, width, channels, rng))
    writer.close()


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class _Sampler(threading.Thread):
    """Peak anonymous (heap) and file-backed resident memory, read from /proc every 50 ms.

    ``ru_maxrss`` counts the pages of memory-mapped spool files a writer has
    touched; they are page cache the kernel takes back under pressure, so the
    two are reported apart.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def sample(self) -> None:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(line.split()[1]))

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.sample()


def stage(name: str, args: argparse.Namespace, work: Path) -> dict:
    names = [f"class_{k}" for k in range(args.channels)]
    import highdicom  # noqa: F401  # the libraries every stage may load, before the baseline
    import zarr  # noqa: F401

    import wsi_pipeline.io.dicom  # noqa: F401
    import wsi_pipeline.io.ome_zarr  # noqa: F401

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sampler = _Sampler()
    sampler.start()
    t = time.perf_counter()
    if name == "rows":  # making the synthetic rows alone: subtract from the heatmap writers' times

        class _Discard:
            def __call__(self, y0: int, rows: np.ndarray) -> None:
                pass

            def close(self) -> None:
                pass

        out = work
        _stream(_Discard(), args.width, args.height, args.channels)
    elif name == "ome-zarr":
        from wsi_pipeline.io.ome_zarr import OmeZarrHeatmapWriter

        out = work / "heatmap.ome.zarr"
        _stream(
            OmeZarrHeatmapWriter(out, args.width, args.height, args.channels, names, (2.0, 2.0)),
            args.width,
            args.height,
            args.channels,
        )
    elif name == "ome-tiff":
        from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter

        out = work / "heatmap.ome.tif"
        _stream(
            OmeTiffHeatmapWriter(out, args.width, args.height, args.channels, names, (2.0, 2.0)),
            args.width,
            args.height,
            args.channels,
        )
    elif name == "dicom-pm":
        from wsi_pipeline.io.dicom import write_dicom_parametric_map
        from wsi_pipeline.io.ome_tiff import HeatmapFile

        out = work / "heatmap_dicom"
        write_dicom_parametric_map(
            out,
            HeatmapFile(work / "heatmap.ome.tif"),
            scale_level0=8,
            dimensions=(args.width * 8, args.height * 8),
            mpp=(0.25, 0.25),
            dimension_organization=args.organization,
        )
    elif name == "dicom-ann":
        from wsi_pipeline.io.detections import make_detections
        from wsi_pipeline.io.dicom import write_dicom_annotations

        rng = np.random.default_rng(0)
        n = args.detections
        xy = rng.uniform(0, args.width * 8 - 40, (n, 2))
        dets = make_detections(np.c_[xy, xy + rng.uniform(4, 40, (n, 2))], rng.random(n), rng.integers(0, 2, n))
        t = time.perf_counter()  # the writer only
        out = work / "detections.dcm"
        write_dicom_annotations(
            out,
            dets,
            [{"name": "nucleus"}, {"name": "mitosis"}],
            dimensions=(args.width * 8, args.height * 8),
            mpp=(0.25, 0.25),
        )
    else:
        raise ValueError(f"unknown stage {name!r}")
    seconds = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    sampler.sample()
    return {
        "stage": name,
        "seconds": round(seconds, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "baseline_rss_mb": round(baseline / 1024),
        "peak_anon_mb": round(sampler.peak["RssAnon"] / 1024),
        "peak_file_backed_mb": round(sampler.peak["RssFile"] / 1024),
        "output_mb": round(_size(out) / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=25000)
    ap.add_argument("--height", type=int, default=20000)
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--detections", type=int, default=100000)
    ap.add_argument("--organization", default="TILED_SPARSE", choices=["TILED_SPARSE", "TILED_FULL"])
    ap.add_argument("--stages", default="rows,ome-zarr,ome-tiff,dicom-pm,dicom-ann")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    add_common_args(ap)
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(stage(args.stage, args, Path(args.work))))
        return
    require("bench_zarr_dicom.py", "zarr", "numcodecs", "ome_zarr", "highdicom")  # every stage loads them
    if args.smoke:
        args.width = args.height = SMOKE_SLIDE_PX
        args.detections = 2000
    results: dict = {}
    work = Path(tempfile.mkdtemp(prefix="bench_zarr_dicom_", dir=os.environ.get("BENCH_DIR")))
    raw_mb = args.width * args.height * args.channels / 1e6
    print(
        f"heatmap {args.width} x {args.height} x {args.channels} (uint8 {raw_mb:.0f} MB, "
        f"float32 {4 * raw_mb:.0f} MB); {args.detections} detections",
        flush=True,
    )
    try:
        for name in args.stages.split(","):
            argv = [sys.executable, __file__, "--stage", name, "--work", str(work)] + [
                f"--{k}={v}" for k, v in vars(args).items() if k not in ("stage", "work", "stages", "smoke", "json")
            ]
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", flush=True)
                results[name] = {"error": proc.stderr.strip()[-500:]}
                continue
            print(proc.stdout.strip().splitlines()[-1], flush=True)
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {**machine(), "smoke": args.smoke, "results": results})


if __name__ == "__main__":
    main()
