"""Probe (2026-12-04), fed benchmarks/HISTORY.md "2026-12-04 01:1x–01:5x UTC: a slide's files queued longest first,
nvJPEG set up while the model loads".

When each of a slide's output files is written: the writer processes' jobs on a timeline.

Run::

    python benchmarks/probes/trace_writes.py SLIDE OUT_DIR [--backend ort]

Runs ``Pipeline.run(SLIDE, out_dir=OUT_DIR)`` once, with every writer job wrapped so that the
writer process records its start and end, and times the calling process's steps of writing
(``SlideOutputs.write``, the waits for the jobs, the joins of files written in parts). Prints
them from the start of ``SlideOutputs.write``, in seconds, with the run's stage seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from wsi_pipeline import Pipeline, outputs
from wsi_pipeline.io import writer_pool

# Where the writer processes append their jobs' times (they inherit it through the environment).
_LOG_ENV = "TRACE_WRITES_LOG"


def timed_job(fn, *args):
    """Run a writer job, appending its process, name, start and end (epoch seconds) to the log."""
    t0 = time.time()
    try:
        return fn(*args)
    finally:
        with open(os.environ[_LOG_ENV], "a") as f:
            f.write(f"{os.getpid()} {getattr(fn, '__qualname__', fn)} {t0:.4f} {time.time():.4f}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("out_dir")
    ap.add_argument("--backend", default="ort")
    args = ap.parse_args()
    log_path = Path(tempfile.mkstemp(prefix="trace-writes-")[1])
    os.environ[_LOG_ENV] = str(log_path)

    submit = writer_pool.WriterPool.submit
    # Pickled by module name, so that a writer process (which does not import this script as its
    # main module) finds it: this script's folder is on the path the pool gives its processes.
    import trace_writes

    def traced_submit(self, jobs, name, fn, *fn_args):
        return submit(self, jobs, name, trace_writes.timed_job, fn, *fn_args)

    writer_pool.WriterPool.submit = traced_submit
    marks: list[tuple[str, float, float]] = []
    for owner, attr in (
        (outputs.SlideOutputs, "write"),
        (outputs.SlideOutputs, "close_heatmap"),
        (outputs.SlideOutputs, "overlay_inputs"),
        (writer_pool.WriteJobs, "wait"),
        (outputs, "write_joined"),
    ):
        real = getattr(owner, attr)

        def wrapped(*a, _real=real, _name=attr, **k):
            t = time.time()
            try:
                return _real(*a, **k)
            finally:
                marks.append((_name, t, time.time()))

        setattr(owner, attr, wrapped)
    with Pipeline.from_card(backend=args.backend) as pipe:
        t = time.perf_counter()
        pipe.run(args.slide, out_dir=args.out_dir)
        print(f"run {time.perf_counter() - t:.2f} s")
    seconds = json.loads((Path(args.out_dir) / "summary.json").read_text())["seconds"]
    print("stages:", {k: v for k, v in seconds.items() if isinstance(v, (int, float))})
    t0 = min(a for name, a, _ in marks if name == "write")
    print("from the start of SlideOutputs.write, s:")
    for name, a, b in sorted(marks, key=lambda m: m[1]):
        print(f"  this process  {name:<26} {a - t0:7.3f} {b - t0:7.3f}")
    for line in log_path.read_text().splitlines():
        pid, name, a, b = line.split()
        print(f"  writer {pid:<6} {name:<26} {float(a) - t0:7.3f} {float(b) - t0:7.3f}")
    log_path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
