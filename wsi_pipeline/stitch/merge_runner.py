"""Where a slide's merge policy runs: on a thread of the stitching process, or in a process of its own.

The stitcher hands each tile row's mapped boxes to the slide's merge policy
(:mod:`.policies`) and asks for the merged boxes at the end. The policy's
work is many numpy operations on a few thousand boxes each; on a thread
(:class:`ThreadedMerge`) it holds the interpreter lock between them, which
the threads that read tiles, feed the model and stitch then wait for. In a
process of its own (:class:`MergeProcess`, one per pipeline, started with
``spawn`` on first use and shared by its slides) it takes none of that
time: only a row's boxes cross over, pickled, and the merged boxes come
back once per slide. Both run the same policy object, so they give the same
boxes (tests check it).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

import numpy as np

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.stitch.background import BackgroundCalls
from wsi_pipeline.stitch.policies import Boxes, MergePolicy


class PolicyRun(Protocol):
    """One slide's merge policy, running somewhere: the calls the stitcher makes, in order."""

    def row_started(self, y0_level0: float) -> None:
        """:meth:`MergePolicy.row_started`, run in order after the calls before it."""

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        """:meth:`MergePolicy.add`, run in order after the calls before it."""

    def finish(self) -> Boxes:
        """Wait for every call; :meth:`MergePolicy.finish`'s boxes. Raises the first call's failure."""

    def abandon(self) -> None:
        """End without a result (the run failed already); raises nothing."""


class ThreadedMerge:
    """``policy``'s calls on a thread of this process; at most ``max_pending`` wait before a call blocks."""

    where = "thread"

    def __init__(self, policy: MergePolicy, max_pending: int):
        self.policy = policy
        self._calls = BackgroundCalls(max_pending=max_pending, name="box-merge")

    def row_started(self, y0_level0: float) -> None:
        self._calls.call(self.policy.row_started, y0_level0)

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        self._calls.call(self.policy.add, boxes_level0, scores, labels)

    def finish(self) -> Boxes:
        self._calls.close()
        return self.policy.finish()

    def abandon(self) -> None:
        self._calls.abandon()


# -- in the merging process: the policies of the slides being merged, by session number --------
_POLICIES: dict[int, MergePolicy] = {}


def _started(parent: int) -> None:
    from wsi_pipeline.parent_watch import watch_parent

    watch_parent(parent)


def _open(session: int, policy: MergePolicy) -> None:
    _POLICIES[session] = policy


def _call(session: int, method: str, *args: Any) -> None:
    policy = _POLICIES.get(session)
    if policy is None:  # an earlier call failed: the stitcher raises that one; later calls are dropped
        return
    try:
        getattr(policy, method)(*args)
    except BaseException:
        del _POLICIES[session]
        raise


def _finish(session: int) -> Boxes:
    policy = _POLICIES.pop(session, None)
    if policy is None:
        raise WSIPipelineError("merging boxes: an earlier call failed")
    return policy.finish()


def _drop(session: int) -> None:
    _POLICIES.pop(session, None)


# -- in the stitching process ---------------------------------------------------------------------
class MergeProcess:
    """The process that merges a pipeline's slides' boxes, started on first use; thread-safe.

    :meth:`merge` gives a slide's :class:`ProcessMerge`. A process that
    died (killed, out of memory) fails the slides it held; the next slide
    starts a new one.
    """

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._sessions = itertools.count()

    @staticmethod
    def available() -> bool:
        """Whether a process can be started here (not from a daemonic process, as some cluster runners use)."""
        return not multiprocessing.current_process().daemon

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")  # a process that has initialised CUDA can start it
                self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_started, initargs=(os.getpid(),))
            return self._pool

    def start(self) -> None:
        """Start the process now (it imports its modules: a fraction of a second), e.g. ahead of a slide."""
        self._executor().submit(_drop, -1)

    def merge(self, policy: MergePolicy, max_pending: int) -> ProcessMerge:
        """A slide's merge by ``policy`` (pickled to the process as it is now) there."""
        pool = self._executor()
        try:
            return ProcessMerge(self, pool, next(self._sessions), policy, max_pending)
        except BrokenProcessPool:  # it died during an earlier slide: a new one takes this one
            self._forget(pool)
            return ProcessMerge(self, self._executor(), next(self._sessions), policy, max_pending)

    def _forget(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class ProcessMerge:
    """One slide's merge policy in the :class:`MergeProcess`; its calls run there in order.

    At most ``max_pending`` calls are unfinished before a call waits for the
    oldest. A call that failed there is raised by the next call or by
    :meth:`finish`.
    """

    where = "process"

    def __init__(
        self, owner: MergeProcess, pool: ProcessPoolExecutor, session: int, policy: MergePolicy, max_pending: int
    ):
        self._owner, self._pool, self._session = owner, pool, session
        self._max_pending = max(1, max_pending)
        self._pending: deque[Future] = deque()
        self._ended = False
        self._pending.append(pool.submit(_open, session, policy))

    def _check(self, fut: Future) -> None:
        try:
            fut.result()
        except BrokenProcessPool as exc:
            self._owner._forget(self._pool)
            raise WSIPipelineError(f"merging boxes: the box-merging process ended ({exc})") from None

    def _submit(self, fn: Any, *args: Any) -> Future:
        if self._ended:
            raise WSIPipelineError("merging boxes: a call after the slide's merge ended")
        while self._pending and (self._pending[0].done() or len(self._pending) >= self._max_pending):
            self._check(self._pending.popleft())
        try:
            fut = self._pool.submit(fn, self._session, *args)
        except BrokenProcessPool as exc:  # the process died; submit raises without a future
            self._owner._forget(self._pool)
            raise WSIPipelineError(f"merging boxes: the box-merging process ended ({exc})") from None
        self._pending.append(fut)
        return fut

    def row_started(self, y0_level0: float) -> None:
        self._submit(_call, "row_started", float(y0_level0))

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        self._submit(_call, "add", boxes_level0, scores, labels)

    def finish(self) -> Boxes:
        try:
            result = self._submit(_finish)
            while self._pending:
                self._check(self._pending.popleft())
            return result.result()
        except BaseException:
            self.abandon()
            raise
        finally:
            self._ended = True

    def abandon(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._pending.clear()
        try:
            self._pool.submit(_drop, self._session)
        except Exception:  # the process is gone, and the slide's state with it
            pass


__all__ = ["MergeProcess", "PolicyRun", "ProcessMerge", "ThreadedMerge"]
