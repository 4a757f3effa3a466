"""Probe (2026-12-02), fed benchmarks/HISTORY.md "Peak memory against slide size".

Peak resident memory per stage of one slide run (where the memory of a run goes).

Samples this process's resident set every 20 ms (``/proc/self/statm``, Linux)
while ``Pipeline.run`` works on SLIDE with outputs, and prints the peak seen
during each stage (open, tissue_mask, read_and_infer, stitch, write) and
during the parts of ``write`` done in this process (the GeoJSON, CSV and
overlay drawing run in writer processes).

    python benchmarks/probes/profile_memory_stages.py SLIDE [--backend ort]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import threading
import time

import wsi_pipeline.io.ome_tiff as ome_tiff
import wsi_pipeline.outputs as outputs
import wsi_pipeline.pipeline as pipeline
import wsi_pipeline.stages as stages

_stage = ["set-up (imports, model load)"]
_peaks: dict[str, float] = {}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _sample() -> None:
    while True:
        _peaks[_stage[0]] = max(_peaks.get(_stage[0], 0.0), _rss_mb())
        time.sleep(0.02)


def _label(owner, name: str, label: str) -> None:
    """Count the time inside ``owner.name`` as stage ``label``."""
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):
        prev, _stage[0] = _stage[0], label
        try:
            return fn(*args, **kwargs)
        finally:
            _stage[0] = prev

    setattr(owner, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--backend", default="ort")
    args = ap.parse_args()

    timed = stages.StageTimer.__call__

    @contextlib.contextmanager
    def stage(self, name):
        prev, _stage[0] = _stage[0], name
        try:
            with timed(self, name):
                yield
        finally:
            _stage[0] = prev

    stages.StageTimer.__call__ = stage
    # GeoJSON, CSV and the overlay's drawing run in writer processes (not this process's memory);
    # here: reading the overlay's thumbnail and finishing the heatmap file.
    for owner, name, label in [
        (outputs.SlideOutputs, "overlay_inputs", "write: overlay thumbnail"),
        (ome_tiff.OmeTiffHeatmapWriter, "close", "write: heatmap file"),
    ]:
        _label(owner, name, label)
    threading.Thread(target=_sample, daemon=True).start()
    out = tempfile.mkdtemp(prefix="profile_memory_")
    try:
        with pipeline.Pipeline.from_card(backend=args.backend) as pipe:
            pipe.run(args.slide, out_dir=out, keep_heatmap=False)
    finally:
        _stage[0] = "after the run"
        shutil.rmtree(out, ignore_errors=True)
    time.sleep(0.05)
    for name, mb in _peaks.items():
        print(f"{name:<32}{mb:8.1f} MB")


if __name__ == "__main__":
    main()
