"""The objects alive when a pipeline is built, kept out of the garbage collector's full passes.

A full collection walks every object the collector tracks: with torch and a model loaded, about
180,000, 80-120 ms on the GPU machine during which no thread of a run goes on (one such pass in
each GPU run of a 20k slide, ``benchmarks/probes/trace_gpu_run.py``). Nearly all of them (modules,
the model, the pipeline's parts) live as long as the pipeline. :func:`hold` moves every tracked
object to the collector's permanent generation (:func:`gc.freeze`) while any pipeline is open;
:func:`release`, at the last one's close, hands them back (:func:`gc.unfreeze`), so that cycles among
objects that died meanwhile are collected then. Reference counting frees everything else as usual.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """Freeze the objects tracked now (a pipeline was built); pair with :func:`release`."""
    global _holders
    with _lock:
        _holders += 1
        gc.freeze()


def release() -> None:
    """One holder is done; at the last, the frozen objects are handed back to the collector."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if not _holders:
            gc.unfreeze()


def holders() -> int:
    """How many holders (open pipelines) keep objects frozen."""
    return _holders


__all__ = ["hold", "holders", "release"]
