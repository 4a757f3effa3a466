"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 13:1x–13:5x UTC: the slide process's start, the run's first
and last 0.1 s".

When a batch's first slide starts and ends, from the command's start: a timeline of its log and imports.

Run (on the GPU machine for a GPU batch)::

    python benchmarks/probes/trace_batch_start.py [--min-import-ms 150] -- run FOLDER --out DIR --backend torch

Runs ``python -m wsi_pipeline ARGS --progress log`` with ``PYTHONPROFILEIMPORTTIME=1`` (the slide
process inherits it), and stamps every line the command writes to stderr with the seconds since it
was started. Prints the log lines, and the imports of at least ``--min-import-ms`` (cumulative)
at the moment each finished (the parent's and the slide process's lines are mixed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

IMPORT = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-import-ms", type=float, default=150.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "wsi_pipeline", *command, "--progress", "log"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(proc.stdout), daemon=True)
    reader.start()
    for line in proc.stderr:
        at = time.perf_counter() - t0
        m = IMPORT.match(line)
        if m is None:
            print(f"{at:8.3f} s  {line.rstrip()}")
        elif int(m.group(2)) >= args.min_import_ms * 1000:
            depth = len(m.group(3)) // 2
            print(f"{at:8.3f} s  {'  ' * depth}import {m.group(4)}: {int(m.group(2)) / 1e6:.2f} s")
    code = proc.wait()
    reader.join()
    print(f"{time.perf_counter() - t0:8.3f} s  exit code {code}")
    print("".join(stdout[-20:]))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
