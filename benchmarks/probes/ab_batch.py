"""Probe (2026-12-04), fed benchmarks/HISTORY.md "2026-12-04 01:1x–01:5x UTC: a slide's files queued longest first,
nvJPEG set up while the model loads".

A batch command timed for two source trees, interleaved: the command's total and its pace.

Usage::

    python benchmarks/probes/ab_batch.py --trees OLD_DIR NEW_DIR --rounds 3 -- FOLDER --backend torch

Each tree is a folder holding a ``wsi_pipeline`` package (``git archive REV wsi_pipeline | tar x
-C DIR``; ``.`` is this checkout). Each round runs ``python -m wsi_pipeline run FOLDER --out TMP
ARGS --progress none`` once per tree, in turn (alternating which goes first), from a neutral
folder with that tree first on ``PYTHONPATH`` and this checkout's ``engines/`` as the models. Prints
per run the command's seconds and the batch's pace after its first slide
(as `batch_pace.py` computes it), then each tree's medians. The outputs are removed after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pace(out: Path) -> tuple[float | None, int]:
    """Seconds a slide from the first slide done to the last, and the number of slides done."""
    done = sorted(p.stat().st_mtime for p in out.glob("slides/*/summary.json"))
    if len(done) < 2:
        return None, len(done)
    return (done[-1] - done[0]) / (len(done) - 1), len(done)


def run_once(tree: Path, args: list[str]) -> tuple[float, float | None, int, int]:
    out = Path(tempfile.mkdtemp(prefix="ab-batch-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.setdefault("WSI_PIPELINE_ENGINES", str(REPO / "engines"))
    folder, rest = args[0], args[1:]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", folder, "--out", str(out / "o"), *rest, "--progress", "none"],
        cwd=tempfile.gettempdir(),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - t0
    p, n = pace(out / "o")
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode not in (0, 1):
        print(proc.stderr[-2000:], file=sys.stderr)
    return seconds, p, n, proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- FOLDER and more `wsi-pipeline run` arguments")
    args = ap.parse_args()
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not rest:
        ap.error("give the batch's FOLDER after --")
    trees = [Path(t).resolve() for t in args.trees]
    for t in trees:
        if not (t / "wsi_pipeline" / "__init__.py").is_file():
            ap.error(f"{t}: expected a folder holding the wsi_pipeline package")
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for r in range(args.rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            seconds, p, n, code = run_once(t, rest)
            runs[str(t)].append({"seconds": seconds, "pace": p, "slides": n, "exit": code})
            shown = f"{p:.3f} s a slide" if p is not None else "-"
            print(
                f"round {r + 1} {t.name or t}: {seconds:.2f} s, {n} slides, pace after the first {shown}, exit {code}"
            )
    for t, rs in runs.items():
        paces = [x["pace"] for x in rs if x["pace"] is not None]
        med_pace = f"{statistics.median(paces):.3f} s" if paces else "-"
        print(f"{t}: median {statistics.median(x['seconds'] for x in rs):.2f} s, median pace {med_pace}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
