"""A user's script that imports torch at its top and writes one slide's outputs, twice.

Run::

    python benchmarks/bench_first_write.py SLIDE OUT_PREFIX [--backend ort] [--json out.json]
    python benchmarks/bench_first_write.py --smoke      # seconds: a tiny synthetic slide

Prints each run's seconds and its ``write`` stage (``summary.json``), and the resident memory of
the script's child processes (the writer processes, and the box-merging process where a slide
uses it) after the first run. Writer processes that import the calling script pay its imports
(torch here) before their first job, in time and in memory, in each process.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from harness import SMOKE_SLIDE_PX, add_common_args, machine, require, synthetic_slide, work_folder, write_json

require("bench_first_write.py", "torch")  # one line naming the extra, not a traceback, without torch

import torch  # noqa: E402, F401  (as many scripts do, at their top)

from wsi_pipeline import Pipeline  # noqa: E402


def children_rss_mb() -> list[int]:
    """Resident memory (MB) of this process's children (Linux ``/proc``)."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{pid}/status") as f:
                out += [int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS")]
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide", nargs="?", help="the slide (with --smoke: a tiny synthetic one when left out)")
    ap.add_argument("out_prefix", nargs="?", help="the runs' output folders: OUT_PREFIX_1, OUT_PREFIX_2")
    ap.add_argument("--backend", default="ort")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke and args.slide is None:
        work = work_folder("bench_first_write_")
        args.slide, args.out_prefix = str(synthetic_slide(work / "s.tiff", SMOKE_SLIDE_PX)), str(work / "out")
    if args.slide is None or args.out_prefix is None:
        ap.error("SLIDE and OUT_PREFIX are needed (or --smoke)")
    runs = []
    with Pipeline.from_card(backend=args.backend) as pipe:
        for i in (1, 2):
            out = f"{args.out_prefix}_{i}"
            t = time.perf_counter()
            pipe.run(args.slide, out_dir=out)
            wall = time.perf_counter() - t
            with open(os.path.join(out, "summary.json")) as f:
                write = json.load(f)["seconds"]["write"]
            extra = f"; child processes' memory {children_rss_mb()} MB" if i == 1 else ""
            print(f"run {i}: {wall:.2f} s, write {write:.2f} s{extra}")
            runs.append({"seconds": wall, "write_s": write})
    write_json(args.json, {**machine(), "smoke": args.smoke, "runs": runs})


if __name__ == "__main__":
    main()
