"""Full garbage collections kept short while runs are under way.

A full collection walks every object the interpreter's collector tracks, holding the interpreter
lock, so every thread of a run waits for it. With torch loaded a process tracks about 180,000
objects; on the GPU machine such a collection took 78-102 ms, in the second of eight runs, which
was 8-11 % slower than the median run of its process (BENCHMARKS.md, 2026-12-04 03:2x–04:xx).

While at least one run is under way, the objects that existed when the first of them began are
frozen (:func:`gc.freeze`): collections skip them and walk only what the runs made. When the last
run ends they are unfrozen and collected as before. A process whose objects are already frozen
(by its own :func:`gc.freeze`) or whose collector is disabled is left as it is.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_runs = 0
_froze = False


def run_began() -> None:
    """A run begins: freeze the objects that exist now if it is the only run under way."""
    global _runs, _froze
    with _lock:
        if _runs == 0:
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _runs += 1


def run_ended() -> None:
    """A run ends (once per :func:`run_began`): unfreeze if it was the last under way."""
    global _runs, _froze
    with _lock:
        if _runs == 0:
            raise RuntimeError("run_ended without run_began")
        _runs -= 1
        if _runs == 0 and _froze:
            gc.unfreeze()
            _froze = False


@contextmanager
def during_run() -> Iterator[None]:
    """:func:`run_began` on entry, :func:`run_ended` on exit."""
    run_began()
    try:
        yield
    finally:
        run_ended()


def runs_under_way() -> int:
    """How many runs are under way."""
    return _runs


__all__ = ["during_run", "run_began", "run_ended", "runs_under_way"]
