"""Many slides into one output folder: inputs, manifest, resume, a child process per batch, Dask.

:func:`run_batch` (in :mod:`.runner`) is the entry point; :mod:`.folder` holds the output
folder's layout and lock, :mod:`.jobs` the per-slide job, :mod:`.slide_worker` the child process
and time limit, :mod:`.distributed` the Dask runner and :mod:`.resume` what a rerun compares.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # Loaded on first use: the slide worker's child process starts as ``python -m
    # wsi_pipeline.batch.slide_worker``, and the package must not have imported it already.
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'wsi_pipeline.batch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.runner"), name)
