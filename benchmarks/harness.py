"""What the maintained benchmarks share: the checkout on the path, a synthetic slide, timed rounds, JSON out.

Each tool that uses it takes ``--smoke`` (a tiny slide, one round: seconds, to check that the tool
still runs; ``tests/test_benchmarks_smoke.py`` runs them) and ``--json PATH`` (its figures, with
the machine and the date, for the record)::

    from harness import add_common_args, machine, synthetic_slide, timed_rounds, write_json

Figures of a smoke run mean nothing: the slide is too small and there is one round. A tool that
cannot run here (an optional package missing: :func:`require`; no CUDA GPU: :func:`require_cuda`)
ends with one line saying what it needs and exit code :data:`EXIT_CANNOT_RUN`, which the smoke
test reads as a skip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's package, whether or not it is installed
    sys.path.insert(0, str(ROOT))
# ... and in the processes a tool starts (``python -m wsi_pipeline run``, children of its own).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

# A smoke run's slide: a few 512 px tiles of tissue at the shipped models' resolution.
SMOKE_SLIDE_PX = 1024
SMOKE_ROUNDS = 1

# The exit code of a tool that cannot run here (as the command line's for a missing extra); its
# last line says what it needs ("... needs the EXTRA extra: pip install ..." or "... needs a CUDA GPU").
EXIT_CANNOT_RUN = 2
# Packages the tools use that no extra but dev brings (the package's own are in wsi_pipeline.extras).
DEV_ONLY_MODULES = {"geopandas": "dev", "psutil": "dev", "monai": "dev"}


def log(msg: str) -> None:
    print(msg, flush=True)


def cannot_run(line: str) -> NoReturn:
    """End the tool with ``line`` on stderr and :data:`EXIT_CANNOT_RUN`."""
    print(line, file=sys.stderr, flush=True)
    sys.exit(EXIT_CANNOT_RUN)


def require(tool: str, *modules: str, extra: str | None = None) -> None:
    """End ``tool`` with one line naming the extra to install where any of ``modules`` is missing.

    The extra is ``extra`` where given (torch: ``gpu`` for the GPU tools), else the one
    ``wsi_pipeline.extras`` names for the module (or ``dev``, :data:`DEV_ONLY_MODULES`).
    """
    import importlib.util

    from wsi_pipeline.extras import MODULE_EXTRAS, PACKAGE_NAMES

    for module in modules:
        if importlib.util.find_spec(module) is None:
            name = extra or {**MODULE_EXTRAS, **DEV_ONLY_MODULES}[module]
            cannot_run(
                f"{tool} needs the {name} extra: pip install 'wsi-pipeline[{name}]' "
                f"({PACKAGE_NAMES.get(module, module)} is not installed)"
            )


def require_cuda(tool: str) -> None:
    """End ``tool`` with one line where torch (the ``gpu`` extra) or a CUDA GPU is missing."""
    require(tool, "torch", extra="gpu")
    import torch

    if not torch.cuda.is_available():
        cannot_run(f"{tool} needs a CUDA GPU")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """``--smoke`` and ``--json PATH``, the options every maintained tool takes."""
    ap.add_argument("--smoke", action="store_true", help="a tiny slide and one round (checks that the tool runs)")
    ap.add_argument("--json", help="write the figures to this file")


def work_folder(prefix: str, folder: str | os.PathLike[str] | None = None) -> Path:
    """``folder`` (made if missing), or a new temporary folder named ``prefix...``."""
    path = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def synthetic_slide(path: str | os.PathLike[str], size_px: int, seed: int = 7, kind: str = "pathology") -> Path:
    """Write a ``size_px`` square synthetic slide (``wsi-pipeline synth``) to ``path``; logs how long it took."""
    from wsi_pipeline.synthetic import write_synthetic_slide

    t0 = time.perf_counter()
    write_synthetic_slide(path, size_px, size_px, seed=seed, kind=kind)
    log(f"synthetic {kind} slide {size_px} px square written in {time.perf_counter() - t0:.1f} s ({path})")
    return Path(path)


def timed_rounds(fn: Callable[[], Any], rounds: int, warm_up: int = 0) -> list[float]:
    """Seconds of each of ``rounds`` calls of ``fn``, after ``warm_up`` untimed ones."""
    for _ in range(warm_up):
        fn()
    seconds = []
    for _ in range(max(1, rounds)):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return seconds


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine(gpu: bool = False) -> dict[str, Any]:
    """The date (UTC), the CPU count and, with ``gpu`` and where CUDA is there, the GPU's name."""
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    if gpu:
        try:
            import torch

            if torch.cuda.is_available():
                out["gpu"] = torch.cuda.get_device_name(0)
        except ImportError:
            pass
    return out


def write_json(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path`` (nothing where ``path`` is None); values JSON lacks as text."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2, default=str))
