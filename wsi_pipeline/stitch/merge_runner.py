"""Where a slide's merge policy runs: on a thread of the stitching process, or in a process of its own.

The stitcher hands each tile row's mapped boxes to the slide's merge policy
(:mod:`.policies`) and asks for the merged boxes at the end. The policy's
work is many numpy operations on a few thousand boxes each; on a thread
(:class:`ThreadedMerge`) it holds the interpreter lock between them, which
the threads that read tiles, feed the model and stitch then wait for. In a
process of its own (:class:`MergeProcess`, one per pipeline, started on
first use as ``python -m wsi_pipeline.stitch.merge_runner`` and shared by
its slides) it takes none of that time: only a row's boxes cross over,
pickled, and the merged boxes come back as rows are decided
(:meth:`~.policies.MergePolicy.take_decided`) and the rest at the slide's end. Both run the same
policy object, so they give the same boxes (tests check it).
"""

from __future__ import annotations

import itertools
import pickle
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

from wsi_pipeline.child_process import child_connections, exception_from, exception_payload, start_child
from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.stitch.background import BackgroundCalls
from wsi_pipeline.stitch.policies import Boxes, MergePolicy


class PolicyRun(Protocol):
    """One slide's merge policy, running somewhere: the calls the stitcher makes, in order."""

    def row_started(self, y0_level0: float) -> None:
        """:meth:`MergePolicy.row_started`, run in order after the calls before it."""

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        """:meth:`MergePolicy.add`, run in order after the calls before it."""

    def end(self) -> None:
        """No more calls: :meth:`MergePolicy.finish` may run meanwhile (:meth:`finish` gives its boxes)."""

    def finish(self) -> Boxes:
        """Wait for every call; :meth:`MergePolicy.finish`'s boxes. Raises the first call's failure."""

    def abandon(self) -> None:
        """End without a result (the run failed already); raises nothing."""


class ThreadedMerge:
    """``policy``'s calls on a thread of this process; at most ``max_pending`` wait before a call blocks."""

    def __init__(self, policy: MergePolicy, max_pending: int):
        self.policy = policy
        self._calls = BackgroundCalls(max_pending=max_pending, name="box-merge")
        self._ended = False
        self._boxes: Boxes | None = None

    def row_started(self, y0_level0: float) -> None:
        self._calls.call(self.policy.row_started, y0_level0)

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        self._calls.call(self.policy.add, boxes_level0, scores, labels)

    def _finish_policy(self) -> None:
        self._boxes = self.policy.finish()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._calls.call(self._finish_policy)

    def finish(self) -> Boxes:
        self.end()
        self._calls.close()
        assert self._boxes is not None
        return self._boxes

    def abandon(self) -> None:
        self._calls.abandon()


# Messages the merging process holds, read ahead of the one it works on, before the sender waits.
_READ_AHEAD = 64


class _Worker:
    """The running merging process: sends a slide's calls there, routes its replies to the slide."""

    def __init__(self) -> None:
        self.proc, self._send, self._recv = start_child("wsi_pipeline.stitch.merge_runner")
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        # Each open slide's outcome: its merged boxes, or its first failure there.
        self._results: dict[int, Future] = {}
        # Each open slide's boxes decided so far, sent while it runs (policy.take_decided).
        self._parts: dict[int, list[Boxes]] = {}
        self.ended: str | None = None  # why the process is gone
        self.send(("path", -1, pickle.dumps(list(sys.path))))  # where the policies' classes are found
        threading.Thread(target=self._replies, name="box-merge-replies", daemon=True).start()

    def _gone(self) -> WSIPipelineError:
        return WSIPipelineError(f"merging boxes: the box-merging process ended ({self.ended})")

    def send(self, msg: tuple[str, int, bytes]) -> None:
        try:
            with self._send_lock:
                self._send.send(msg)
        except (OSError, ValueError):  # the process is gone
            self._ended(self._exit_code())
            raise self._gone() from None

    def open(self, session: int) -> Future:
        """The Future of a new slide's outcome (failed already where the process is gone)."""
        with self._lock:
            fut = self._results[session] = Future()
            self._parts[session] = []
            if self.ended is not None:
                fut.set_exception(self._gone())
        return fut

    def _replies(self) -> None:
        while True:
            try:
                kind, session, payload = self._recv.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                self._ended(self._exit_code())
                return
            with self._lock:
                fut = self._results.get(session)
                if fut is None or fut.done():  # a slide that ended, or a failure after its first
                    continue
                if kind == "error":
                    fut.set_exception(exception_from(payload))
                elif kind == "part":
                    self._parts[session].append(pickle.loads(payload))
                else:
                    parts = [*self._parts.pop(session, []), pickle.loads(payload)]
                    if len(parts) > 1:
                        parts = [tuple(np.concatenate(p) for p in zip(*parts, strict=True))]
                    fut.set_result(parts[0])

    def _exit_code(self) -> str:
        try:
            return f"exit code {self.proc.wait(timeout=5)}"
        except subprocess.TimeoutExpired:
            return "its pipe closed"

    def _ended(self, why: str) -> None:
        with self._lock:
            if self.ended is None:
                self.ended = why
            for fut in self._results.values():
                if not fut.done():
                    fut.set_exception(self._gone())

    def forget(self, session: int) -> None:
        with self._lock:
            self._results.pop(session, None)
            self._parts.pop(session, None)

    def stop(self) -> None:
        try:
            with self._send_lock:
                self._send.send(("stop", -1, b""))
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for conn in (self._send, self._recv):
            conn.close()


class MergeProcess:
    """The process that merges a pipeline's slides' boxes, started on first use; thread-safe.

    :meth:`merge` gives a slide's :class:`ProcessMerge`. A process that
    died (killed, out of memory) fails the slides it held; the next slide
    starts a new one.
    """

    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self._sessions = itertools.count()

    @property
    def pid(self) -> int | None:
        """The running process's id (None: not started)."""
        return None if self._worker is None else self._worker.proc.pid

    def _running(self) -> _Worker:
        with self._lock:
            if self._worker is not None and self._worker.ended is not None:
                self._worker.stop()
                self._worker = None
            if self._worker is None:
                self._worker = _Worker()
            return self._worker

    def start(self) -> None:
        """Start the process now (it imports its modules: a fraction of a second), e.g. ahead of a slide."""
        self._running()

    def merge(self, policy: MergePolicy) -> ProcessMerge:
        """A slide's merge by ``policy`` (sent to the process as it is now) there."""
        return ProcessMerge(self._running(), next(self._sessions), policy)

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()


class ProcessMerge:
    """One slide's merge policy in the :class:`MergeProcess`; its calls run there in order.

    A call that failed there is raised by a later call or by :meth:`finish`;
    the calls after it are dropped there.
    """

    def __init__(self, worker: _Worker, session: int, policy: MergePolicy):
        self._worker, self._session = worker, session
        self._ended = False
        self._finish_sent = False
        self._result = worker.open(session)
        self._send("open", policy)

    def _send(self, op: str, *args: Any) -> None:
        if self._ended:
            raise WSIPipelineError("merging boxes: a call after the slide's merge ended")
        if self._result.done():  # only a failure can end it before finish: raise it
            self._result.result()
        self._worker.send((op, self._session, pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)))

    def row_started(self, y0_level0: float) -> None:
        self._send("call", "row_started", float(y0_level0))

    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        self._send("call", "add", boxes_level0, scores, labels)

    def end(self) -> None:
        if not self._finish_sent:
            self._finish_sent = True
            self._send("finish")

    def finish(self) -> Boxes:
        try:
            self.end()
            return self._result.result()
        finally:
            self._ended = True
            self._worker.forget(self._session)

    def abandon(self) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            self._worker.send(("drop", self._session, b""))
        except WSIPipelineError:  # the process is gone, and the slide's state with it
            pass
        self._worker.forget(self._session)


# -- the merging process ----------------------------------------------------------------------
def _serve(recv: Connection, send: Connection) -> None:
    # Messages are read on a thread of their own, so the sender's pipe drains while a row is merged.
    inbox: queue.Queue = queue.Queue(maxsize=_READ_AHEAD)

    def read() -> None:
        while True:
            try:
                inbox.put(recv.recv())
            except (EOFError, OSError):
                inbox.put(("stop", -1, b""))
                return

    threading.Thread(target=read, name="read-calls", daemon=True).start()
    policies: dict[int, MergePolicy] = {}
    while True:
        op, session, payload = inbox.get()
        if op == "stop":
            return
        try:
            if op == "path":
                sys.path[:] = pickle.loads(payload)
            elif op == "open":
                (policies[session],) = pickle.loads(payload)
            elif op == "call":
                policy = policies.get(session)
                if policy is not None:  # None: an earlier call failed, and was reported
                    method, *args = pickle.loads(payload)
                    getattr(policy, method)(*args)
                    if method == "row_started":  # where a streaming merge decides boxes
                        part = policy.take_decided()
                        if part is not None and len(part[0]):
                            send.send(("part", session, pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)))
            elif op == "finish":
                policy = policies.pop(session, None)
                if policy is None:
                    raise WSIPipelineError("merging boxes: an earlier call failed")
                send.send(("done", session, pickle.dumps(policy.finish(), protocol=pickle.HIGHEST_PROTOCOL)))
            elif op == "drop":
                policies.pop(session, None)
        except BaseException as exc:
            policies.pop(session, None)
            send.send(("error", session, exception_payload(exc)))


if __name__ == "__main__":
    _serve(*child_connections(sys.argv[1:]))


__all__ = ["MergeProcess", "PolicyRun", "ProcessMerge", "ThreadedMerge"]
