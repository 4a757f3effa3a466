"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 05:5x–06:3x UTC: batch arrays, the stitching threads, each
stored tile decoded once".

Where a GPU run's host memory goes before its first slide, and what cuDNN autotuning costs.

Run on a CUDA machine::

    python benchmarks/probes/probe_setup_memory.py SLIDE

For each setting, in a fresh process, prints the resident set (``/proc/self/statm``)
after importing torch, after creating the CUDA context, after
``Pipeline.from_card(backend="torch")`` (the model loaded, its CUDA graphs captured),
and the process's peak after two ``Pipeline.run(SLIDE)`` (no outputs), with the
second run's tiles/s. Settings: ``default`` (cuDNN picks its kernels by heuristics);
``cudnn-benchmark`` (``torch.backends.cudnn.benchmark``: cuDNN times its candidate kernels
for every batch bucket, loading more kernel images).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("default", "cudnn-benchmark")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * 4096 / 2**20, 1)


def child(slide: str, setting: str) -> dict:
    out: dict = {"setting": setting}
    import torch

    out["after_import_torch_mb"] = _rss_mb()
    torch.zeros(1, device="cuda")
    out["after_cuda_context_mb"] = _rss_mb()
    sys.path.insert(0, str(ROOT))
    from wsi_pipeline import Pipeline
    from wsi_pipeline.inference import torch_backend

    if setting == "cudnn-benchmark":
        init = torch_backend.TorchBackend.__init__

        def patched(self, *args, **kwargs):
            init(self, *args, **kwargs)
            torch.backends.cudnn.benchmark = True

        torch_backend.TorchBackend.__init__ = patched
    pipe = Pipeline.from_card(ROOT / "engines" / "nuclei_pathology.card.json", backend="torch")
    out["after_pipeline_mb"] = _rss_mb()
    pipe.run(slide)
    t0 = time.perf_counter()
    r = pipe.run(slide)
    out["second_run_tiles_per_s"] = round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1)
    out["after_runs_mb"] = _rss_mb()
    out["peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    pipe.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--child", choices=SETTINGS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.slide, args.child)))
        return 0
    for setting in SETTINGS:
        proc = subprocess.run(
            [sys.executable, __file__, args.slide, "--child", setting], capture_output=True, text=True, check=False
        )
        lines = proc.stdout.strip().splitlines()
        print(lines[-1] if proc.returncode == 0 and lines else f"{setting}: failed\n{proc.stderr[-2000:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
