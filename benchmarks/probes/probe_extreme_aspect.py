"""Probe (2026-12-04, fed benchmarks/HISTORY.md "Hostile sizes").

Memory of `wsi-pipeline run` on slides one pixel high or wide (10,000,000 px the other way).

Each slide is a tiled TIFF (zlib, 256 px tiles) of white background with tissue-coloured noise
over 2 % of its length (at least 20,000 px) in its middle, run with the shipped pathology model on
the CPU into a fresh folder. The peak is that of every process of the run (``RUSAGE_CHILDREN``:
the command, its slide process and the writer processes); ``summary.json`` gives the slide
process's and the writers' own.

    PYTHONPATH=. python benchmarks/probes/probe_extreme_aspect.py [--length 10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tifffile


def _slide(path: Path, length: int, wide: bool) -> None:
    line = np.full((length, 3), 255, np.uint8)
    mid = length // 2
    rng = np.random.default_rng(0)
    half = max(10_000, length // 100)
    line[mid - half : mid + half] = rng.integers((150, 60, 120), (220, 120, 190), (2 * half, 3), dtype=np.uint8)
    image = line[None] if wide else line[:, None]
    tifffile.imwrite(path, image, tile=(256, 256), compression="zlib", photometric="rgb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=10_000_000, help="the slide's long side in pixels")
    ap.add_argument("--one", choices=("wide", "tall"), help=argparse.SUPPRESS)  # one case, in a process of its own
    args = ap.parse_args()
    if args.one is None:
        for one in ("wide", "tall"):  # each in a process of its own: RUSAGE_CHILDREN is that case's
            subprocess.run([sys.executable, __file__, "--length", str(args.length), "--one", one], check=False)
        return
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    for wide in (args.one == "wide",):
        with tempfile.TemporaryDirectory(prefix="bench_aspect_") as tmp:
            folder = Path(tmp)
            w, h = (args.length, 1) if wide else (1, args.length)
            slide = folder / f"slide_{w}x{h}.tiff"
            _slide(slide, args.length, wide)
            t = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-m", "wsi_pipeline", "run", str(slide), "--out", str(folder / "out")]
                + ["--backend", "ort", "--progress", "none", "--min-tissue", "0.001"],
                capture_output=True,
                text=True,
                cwd=folder,
                env=env,
            )
            seconds = time.perf_counter() - t
            peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            summaries = list((folder / "out" / "slides").glob("*/summary.json"))
            s = json.loads(summaries[0].read_text()) if summaries else {}
            manifest = folder / "out" / "manifest.json"
            error = ""
            if manifest.exists():
                slides = json.loads(manifest.read_text())["slides"]
                error = next(iter(slides.values())).get("error") or ""
            print(
                f"{w} x {h}: exit {r.returncode}, {seconds:.0f} s, largest process peak {peak_mb:.0f} MB"
                + (
                    f", slide process {s.get('peak_host_memory_mb')} MB, writers {s.get('peak_writer_memory_mb')} MB, "
                    f"tiles {s.get('tiles', {}).get('read')}"
                    if s
                    else ""
                )
                + (f"; {error}" if error else "")
            )


if __name__ == "__main__":
    main()
