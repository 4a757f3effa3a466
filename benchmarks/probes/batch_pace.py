"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 20:5x–21:4x UTC: the heatmap file written by a writer
process, job arrays through files".

Each slide's times in a batch's output folder, and the batch's pace after its first slide.

Usage: ``python benchmarks/probes/batch_pace.py OUT_DIR [OUT_DIR ...]`` (the ``--out`` of ``wsi-pipeline run``).

A slide is done when its ``summary.json`` is written (the file's modification time). Prints, in
that order, when each slide was done after the first, its ``read_and_infer`` and ``write`` seconds,
and the pace: seconds from the first slide done to the last, over the slides after the first.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(folders: list[str]) -> int:
    for folder in folders:
        rows = []
        for path in Path(folder).glob("slides/*/summary.json"):
            seconds = json.loads(path.read_text()).get("seconds", {})
            rows.append((path.stat().st_mtime, path.parent.name, seconds.get("read_and_infer"), seconds.get("write")))
        rows.sort()
        if not rows:
            print(f"{folder}: no slide done")
            continue
        t0 = rows[0][0]
        print(f"{folder}: {len(rows)} slides")
        print("  done after the first (s):", " ".join(f"{r[0] - t0:.2f}" for r in rows))
        print("  read_and_infer (s):", " ".join(f"{r[2]:.2f}" for r in rows if r[2] is not None))
        print("  write (s):", " ".join(f"{r[3]:.2f}" for r in rows if r[3] is not None))
        if len(rows) > 1:
            later = [r[2] for r in rows[1:] if r[2] is not None]
            pace = (rows[-1][0] - t0) / (len(rows) - 1)
            print(
                f"  pace after the first slide: {pace:.3f} s a slide; median read_and_infer of the others "
                f"{statistics.median(later):.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
