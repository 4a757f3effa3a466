"""Many slides into one output folder: inputs, manifest, resume, a child process per batch, Dask.

:func:`run_batch` (in :mod:`.runner`) is the entry point; :mod:`.folder` holds the output
folder's layout and lock, :mod:`.jobs` the per-slide job, :mod:`.slide_worker` the child process
and time limit, :mod:`.distributed` the Dask runner and :mod:`.resume` what a rerun compares.
The package hands on the names of ``__all__`` (its public API), each from the module that defines
it; the others are imported from the module that defines them.
"""

from __future__ import annotations

import importlib
from typing import Any

# The batch layer's public names, each from the module that defines it.
_OWNERS = {
    "LOG_FILE": "folder",
    "MANIFEST": "folder",
    "output_names": "folder",
    "PipelineFactory": "jobs",
    "SlideOutcome": "jobs",
    "process_slide": "jobs",
    "BatchReport": "runner",
    "Manifest": "runner",
    "expand_inputs": "runner",
    "run_batch": "runner",
    "run_key": "runner",
}
__all__ = [
    "LOG_FILE",
    "MANIFEST",
    "BatchReport",
    "Manifest",
    "PipelineFactory",
    "SlideOutcome",
    "expand_inputs",
    "output_names",
    "process_slide",
    "run_batch",
    "run_key",
]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the slide worker's child process starts as ``python -m
    # wsi_pipeline.batch.slide_worker``, and the package must not have imported it already.
    if name not in _OWNERS:
        raise AttributeError(f"module 'wsi_pipeline.batch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_OWNERS[name]}"), name)
