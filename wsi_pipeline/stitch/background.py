"""Calls run in order on a thread of their own: stitching work handed off the thread that stitches.

The stitching thread feeds every stage of a run; work it can hand over in
order (the heatmap sinks' bands, the merging of mapped boxes) runs here
instead. Large numpy operations there mostly run without the interpreter
lock, so the two threads overlap.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from wsi_pipeline.errors import ClosedError


class BackgroundCalls:
    """Run ``fn(*args)`` calls one after another, in the order given, on one thread.

    At most ``max_pending`` calls wait (the caller blocks beyond). The first
    failure is raised by the next :meth:`call` and by :meth:`close`; calls
    after it are dropped.
    """

    def __init__(self, max_pending: int = 8, name: str = "stitch-background"):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                fn, args = item
                try:
                    fn(*args)
                except BaseException as exc:  # raised in the calling thread
                    self._error = exc

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClosedError(f"{self._thread.name}: a call after close")
        self._queue.put((fn, args))

    def close(self) -> None:
        """Wait until every call handed over has run; raise the first failure. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """:meth:`close` for a run that failed already: its own error is the one raised, not this one's."""
        try:
            self.close()
        except Exception:
            pass


__all__ = ["BackgroundCalls"]
