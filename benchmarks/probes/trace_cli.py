"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 07:0x–07:4x UTC: the batch runs two slides ahead, more
writer processes, a faster heatmap pyramid".

Where a ``wsi-pipeline`` command's wall time goes, by thread, in time windows: stack samples.

Run (on the GPU machine for a GPU run)::

    python benchmarks/probes/trace_cli.py [--window 2] -- run SLIDE --out DIR --slide-timeout 0

Runs the command line in this process (``--slide-timeout 0`` keeps the slides in it too),
sampling every thread's stack every 5 ms; prints, for each ``--window`` seconds from the start,
the most sampled project lines (or innermost frames) per thread.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    counts: dict = collections.defaultdict(collections.Counter)
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.wait(0.005):
            window = int((time.perf_counter() - t0) / args.window)
            names = {t.ident: re.sub(r"[_-]?\d+(_\d+)?$", "", t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                f, where = frame, None
                while f is not None and where is None:
                    if "wsi_pipeline" in f.f_code.co_filename:
                        where = f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
                    f = f.f_back
                inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                counts[(window, names.get(ident, "?"))][f"{where} <- {inner}" if where else inner] += 1

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    sampler.start()
    from wsi_pipeline.cli import main as cli_main

    try:
        code = cli_main(command)
    finally:
        stop.set()
        sampler.join()
    print(f"exit code {code}, {time.perf_counter() - t0:.2f} s")
    for (window, thread), c in sorted(counts.items()):
        total = sum(c.values())
        if total < 20:
            continue
        top = "; ".join(f"{k} {v / total:.0%}" for k, v in c.most_common(4))
        print(f"{window * args.window:5.0f} s {thread:<14} ({total:4d}): {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
