"""Many slides into one output folder: inputs, manifest, resume, a child process per batch, Dask.

:func:`run_batch` (in :mod:`.runner`) is the entry point; :mod:`.folder` holds the output
folder's layout and lock, :mod:`.jobs` the per-slide job, :mod:`.slide_runners` the child process
and time limit (:mod:`.slide_worker` the process itself), :mod:`.distributed` the Dask runner and
:mod:`.resume` what a rerun compares, :mod:`.manifest` the record of
the slides and :mod:`.stops` what a stop records. The package hands on the names of ``__all__`` (its public
API), each from the module that defines it; the others are imported from the module that defines them.
"""

from __future__ import annotations

from .folder import LOG_FILE, MANIFEST, output_names
from .jobs import PipelineFactory, SlideOutcome, process_slide
from .manifest import Manifest
from .runner import BatchReport, expand_inputs, run_batch, run_key

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
