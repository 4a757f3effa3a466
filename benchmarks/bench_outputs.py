"""Detection output formats at scale: wall time, extra peak memory and file size of writing
N synthetic detections as each format, and of reading the files back.

Each measurement runs in a fresh child process that builds the detections (in chunks, so the
build leaves no larger peak behind), notes its peak RSS (``resource.getrusage`` maxrss), does
the one write or read, and reports the wall time and how far the peak RSS rose above that
baseline: the memory the writer or reader needs beyond the detection array (24 bytes a row).

    python benchmarks/bench_outputs.py [--sizes 1000000,5000000] [--json out.json]
    python benchmarks/bench_outputs.py --smoke      # seconds: 2,000 detections
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from harness import add_common_args, machine, require, write_json

from wsi_pipeline.io.detections import DETECTION_DTYPE

CLASSES = [{"name": "nucleus", "color": "#7b2cbf"}, {"name": "mitosis", "color": [255, 0, 0]}]
WRITES = ("geojson", "geojson.gz", "geojson.zip", "csv", "parquet", "geoparquet")
READS = ("geojson:json", "geojson.gz:json", "csv:pandas", "parquet:pandas", "geoparquet:geopandas")
BUILD_CHUNK = 1 << 16  # small: the build's temporaries must not set the baseline peak


def synthetic_detections(n: int, seed: int = 0) -> np.ndarray:
    """``n`` boxes 4-20 px wide over a 200,000 px square slide (level-0 pixels), two classes."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, DETECTION_DTYPE)
    for start in range(0, n, BUILD_CHUNK):
        m = min(BUILD_CHUNK, n - start)
        xy = rng.uniform(0, 200_000, (m, 2)).astype(np.float32)
        wh = rng.uniform(4, 20, (m, 2)).astype(np.float32)
        part = out[start : start + m]
        part["x0"], part["y0"] = xy[:, 0], xy[:, 1]
        part["x1"], part["y1"] = xy[:, 0] + wh[:, 0], xy[:, 1] + wh[:, 1]
        part["score"] = rng.random(m, np.float32)
        part["label"] = rng.integers(0, 2, m)
    return out


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(task: str, n: int, folder: str) -> dict:
    """One write (``task`` a format name) or read (``format:reader``) in this process."""
    from wsi_pipeline.io.formats import FORMATS

    if ":" not in task:
        fmt = FORMATS[task]
        write = fmt.write_function()
        for module in (*fmt.requires, "pyarrow.parquet") if fmt.requires else ():
            importlib.import_module(module)  # imported before the baseline: a run's writer has them
        dets = synthetic_detections(n)
        path = os.path.join(folder, f"{task}-{fmt.filename}")  # parquet and geoparquet share a name
        base = _maxrss_mb()
        t = time.perf_counter()
        write(path, dets, CLASSES)
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "extra_peak_mb": _maxrss_mb() - base, "file_mb": os.path.getsize(path) / 2**20}
    name, reader = task.split(":")
    path = os.path.join(folder, f"{name}-{FORMATS[name].filename}")
    if reader == "json":
        import gzip

        def read():
            with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path) as f:
                return len(json.load(f)["features"])
    elif reader == "pandas":
        import pandas as pd

        def read():
            return len(pd.read_csv(path) if path.endswith(".csv") else pd.read_parquet(path))
    else:
        import geopandas as gpd

        def read():
            return len(gpd.read_parquet(path))

    base = _maxrss_mb()
    t = time.perf_counter()
    rows = read()
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "extra_peak_mb": _maxrss_mb() - base, "rows": rows}


def run(task: str, n: int, folder: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", task, "--n", str(n), "--folder", folder]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,5000000", help="detection counts, comma-separated")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one measurement may take")
    ap.add_argument(
        "--json-read-max",
        type=int,
        default=1_000_000,
        help="read GeoJSON back (json.load: ~2.7 GiB a million features) only up to this many "
        "detections (default %(default)s)",
    )
    add_common_args(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args.folder)))
        return
    # the writers of parquet and geoparquet, the readers of READS
    require("bench_outputs.py", "pyarrow", "shapely", "pandas", "geopandas")
    if args.smoke:
        args.sizes, args.timeout = "2000", 120
    results: dict = {}
    for n in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench_outputs_") as folder:
            print(f"\n{n:,} detections (the array: {n * DETECTION_DTYPE.itemsize / 2**20:.0f} MiB)")
            for task in (*WRITES, *READS):
                if task.endswith(":json") and n > args.json_read_max:
                    r = {"error": f"skipped (over --json-read-max {args.json_read_max:,})"}
                else:
                    r = run(task, n, folder, args.timeout)
                results[f"{n}:{task}"] = r
                what = f"write {task}" if ":" not in task else f"read {task.replace(':', ' with ')}"
                if "error" in r:
                    print(f"  {what:32s} {r['error']}")
                    continue
                size = f", {r['file_mb']:7.1f} MiB file" if "file_mb" in r else ""
                print(f"  {what:32s} {r['seconds']:7.2f} s, +{r['extra_peak_mb']:7.1f} MiB peak RSS{size}", flush=True)
    write_json(args.json, {**machine(), "smoke": args.smoke, "results": results})


if __name__ == "__main__":
    main()
