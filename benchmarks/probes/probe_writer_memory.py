"""Probe (2026-12-04, fed benchmarks/HISTORY.md "Hostile sizes").

Peak memory of each detection format's writer, and of the overlay, on millions of detections.

Each format runs in a fresh process, as one writer-pool job writing the whole file: the process
builds the detections (random boxes of 4 to 20 px on a 200k x 200k slide), notes its resident
memory, resets its peak (Linux: ``/proc/self/clear_refs``), runs the job and reads its peak
(``VmHWM``). The job's own memory is the peak less what the process held before it.

    PYTHONPATH=. python benchmarks/probes/probe_writer_memory.py [--n 4190000] [--formats csv,dicom,overlay]

The processes run in a temporary folder with ``PYTHONPATH`` made absolute: the package measured
is the one ``PYTHONPATH`` names (another tree's, to compare), not the current folder's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
import numpy as np
from wsi_pipeline.io.detections import detection_boxes, make_detections
from wsi_pipeline.io.formats import FORMATS

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

name, n, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
side = 200_000
xy = rng.uniform(0, side, (n, 2))
dets = make_detections(np.c_[xy, xy + rng.uniform(4, 20, (n, 2))], rng.random(n), rng.integers(0, 2, n))
classes = [{"name": "nucleus", "color": "#7b2cbf"}, {"name": "other", "color": "#00ff00"}]
fmt = FORMATS[name]
job = fmt.job({"dimensions": (side, side), "slide_path": None, "mpp": (0.25, 0.25)})
path = os.path.join(folder, fmt.filename)
if name == "overlay":
    thumb = np.zeros((2048, 2048, 3), np.uint8)
    args = (path, thumb, side / 2048, None, 1.0, detection_boxes(dets), dets["label"], [(123, 44, 191), (0, 255, 0)])
else:
    args = (path, dets, classes)
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t = time.perf_counter()
job(*args)
seconds = time.perf_counter() - t
peak = status("VmHWM:")
print(json.dumps({"format": name, "before_mb": round(before), "peak_mb": round(peak),
                  "job_mb": round(peak - before), "seconds": round(seconds, 1)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4_190_000, help="detections")
    ap.add_argument(
        "--formats", default="geojson,geojson.gz,geojson.zip,csv,parquet,geoparquet,dicom,overlay", help="formats"
    )
    args = ap.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    print(f"{args.n} detections: format, process before the job, its peak, the job's own (MB), seconds")
    for name in args.formats.split(","):
        with tempfile.TemporaryDirectory(prefix="bench_writer_memory_") as folder:
            r = subprocess.run(
                [sys.executable, "-c", _CHILD, name, str(args.n), folder],
                capture_output=True,
                text=True,
                cwd=folder,
                env=env,
            )
        if r.returncode != 0:
            print(f"{name}: failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{row['format']:12s} {row['before_mb']:6d} {row['peak_mb']:6d} {row['job_mb']:6d} {row['seconds']:7.1f}")


if __name__ == "__main__":
    main()
