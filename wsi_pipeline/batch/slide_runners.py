"""Slides of a batch run in a child process, each under a wall-clock limit: the parent's side
(the process's own is :mod:`.slide_worker`).

A slide can hang where no check of a deadline runs: a decoder looping in C,
a reader following a file's pointers in circles, a network file system that
stops answering. A Python thread cannot be stopped from outside, so a
deadline checked between batches would wait forever on such a read. The
batch therefore runs its slides in one child process (``python -m
wsi_pipeline.batch.slide_worker``) that builds the pipeline once and runs the
slides it is sent one at a time. The parent waits for each slide's outcome
at most the slide's time limit; past it, or when the child dies (a crash, the
kernel's out-of-memory killer), the parent kills the child, removes its
half-written folder, records the slide as failed and starts a new child for
the next slide. The cost of the isolation is the child's start and model
load, paid once per batch and again after each slide that is stopped.

The child runs in its own session, so Ctrl-C reaches only the parent, which
stops the child and records the slide as interrupted; the child exits when
its parent is gone (killed). Its log records and warnings
are sent to the parent, which logs them as its own.

With ``slide_timeout = 0`` slides run in the calling process, without a limit
(:class:`InProcessRunner`), except those whose reader may crash the process on a
damaged file (OpenSlide, :attr:`~wsi_pipeline.slide.SlideReader.may_crash`): a
segmentation fault in its C code would end the whole run and leave its manifest
saying "running", so those run in a child process as above, without a limit.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..child_process import exception_from, start_child
from ..config import RunConfig
from ..errors import WSIPipelineError
from ..plugins import set_import_limit
from .folder import remove_or_warn, slides_dir

log = logging.getLogger("wsi_pipeline")

# Default limit: this much, plus as much again per GiB of slide file.
BASE_LIMIT_S = 3600.0
LIMIT_S_PER_GIB = 3600.0
# Slides the child runs ahead of the one asked for, while earlier slides' files are written: with
# two, the GPU keeps working while one slide's files take longer to write than the next slide runs.
RUN_AHEAD = 2
# Slides after those, whose first steps (open, tissue mask: Pipeline.plan) the child makes on a thread
# while it runs the others, so that they are not between one slide's inference and the next.
PLAN_AHEAD = 1
# Loggers whose levels the child copies from the parent.
_LOGGERS = ("", "wsi_pipeline", "py.warnings", "tifffile", "pydicom")


def slide_time_limit(config: RunConfig, path: str | os.PathLike[str]) -> float | None:
    """Seconds slide ``path`` may take: ``config.slide_timeout``, or by default 1 h plus 1 h per GiB
    of the slide file; None for no limit (``slide_timeout = 0``)."""
    if config.slide_timeout is not None:
        return config.slide_timeout or None
    try:
        size = os.path.getsize(path)
    except (OSError, ValueError):
        size = 0
    return BASE_LIMIT_S + LIMIT_S_PER_GIB * size / (1 << 30)


class InProcessRunner:
    """Runs slides in this process, without a time limit; the pipeline is built on first use.

    A slide whose reader may crash the process (:func:`~wsi_pipeline.slide.reader_may_crash`)
    runs in a child process instead (a :class:`ChildProcessRunner`, started on first need, no
    limit), where the factory can be pickled; else here, with a warning."""

    def __init__(self, factory: Callable[[], Any], progress: bool):
        self.factory, self.progress = factory, progress
        self.pipeline: Any = None
        self.child: ChildProcessRunner | None = None
        self._picklable: bool | None = None

    def _isolates(self, path: Path) -> bool:
        """Whether slide ``path`` runs in the child process (its reader may crash this one)."""
        from ..slide import reader_may_crash

        if not reader_may_crash(path):
            return False
        if self._picklable is None:
            try:
                pickle.dumps(self.factory)
                self._picklable = True
            except Exception:
                self._picklable = False
        if not self._picklable:
            log.warning(
                "%s: read with a reader that may crash on a damaged file, in this process: the pipeline "
                "factory cannot be pickled for a child process (a crash would end the run)",
                path,
            )
        return self._picklable

    def prepare(self) -> None:
        """Build the pipeline (raises what the factory raises)."""
        if self.pipeline is None:
            self.pipeline = self.factory()

    def run(
        self,
        path: Path,
        name: str,
        out_dir: Path,
        key: Any,
        limit_s: float | None = None,
        next_slides: Sequence[tuple[Path, str]] = (),
    ):
        from .jobs import process_slide

        if self._isolates(path):
            if self.child is None:
                self.child = ChildProcessRunner(self.factory, self.progress)
            return self.child.run(path, name, out_dir, key)
        self.prepare()
        return process_slide(self.pipeline, path, name, out_dir, key, progress=self.progress)

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None


class ChildProcessRunner:
    """Runs slides in a child process that holds the pipeline; see the module docstring."""

    def __init__(self, factory: Callable[[], Any], progress: bool):
        self.factory, self.progress = factory, progress
        self.proc: subprocess.Popen | None = None
        self.send_conn: Connection | None = None
        self.recv_conn: Connection | None = None

    # -- the child's life ----------------------------------------------------------
    def _start(self) -> None:
        self.proc, self.send_conn, self.recv_conn = start_child("wsi_pipeline.batch.slide_worker")
        levels = {n: logging.getLogger(n).level for n in _LOGGERS}
        try:
            self.send_conn.send(("init", list(sys.path), levels, pickle.dumps(self.factory), self.progress))
            reply = self._receive(None)
        except BaseException:  # Ctrl-C while the model loads
            self._stop()
            raise
        if reply is None:
            raise WSIPipelineError(
                f"the process that runs slides ended while loading the model (exit code {self._stop()})"
            )
        if reply[0] == "fatal":
            self._stop()
            raise exception_from(reply[1])

    def _stop(self) -> int | None:
        """Kill the child (if running) and return its exit code."""
        for conn in (self.send_conn, self.recv_conn):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        self.send_conn = self.recv_conn = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def _receive(self, deadline: float | None) -> tuple | None:
        """The child's next message that is not a log record; None when the child ended;
        raises TimeoutError at ``deadline`` (time.monotonic)."""
        assert self.recv_conn is not None
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.recv_conn.poll(wait if wait is None else min(wait, 1.0)):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError
                continue
            try:
                msg = self.recv_conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                return None
            if msg[0] == "log":
                record = msg[1]
                logging.getLogger(record.name).handle(record)
                continue
            return msg

    # -- slides ------------------------------------------------------------------
    def prepare(self) -> None:
        """Start the child and let it build the pipeline, if not done (raises what the factory raises)."""
        if self.proc is None:
            self._start()

    def run(
        self,
        path: Path,
        name: str,
        out_dir: Path,
        key: Any,
        limit_s: float | None = None,
        next_slides: Sequence[tuple[Path, str]] = (),
    ):
        """The slide's outcome. ``next_slides`` ((path, name)): the slides that will be asked for next,
        in order; the child runs the first :data:`RUN_AHEAD` while this one's files are written, and
        plans the :data:`PLAN_AHEAD` after them."""
        from .jobs import SlideOutcome

        self.prepare()
        assert self.send_conn is not None and self.proc is not None
        pid = self.proc.pid
        t0 = time.perf_counter()
        deadline = None if limit_s is None else time.monotonic() + limit_s
        inferred = False
        next_slides = list(next_slides[: RUN_AHEAD + PLAN_AHEAD])
        # The folders a stopped or dead child may have begun: this slide's and those it ran ahead.
        begun = [name, *(n for _, n in next_slides[:RUN_AHEAD])]
        try:
            try:
                self.send_conn.send(("run", path, name, out_dir, key, next_slides))
            except (BrokenPipeError, ConnectionResetError):
                reply = None  # the child died running this slide ahead, while the last one was written
            else:
                reply = self._receive(deadline)
            while reply is not None and reply[0] == "inferred":
                inferred = True
                reply = self._receive(deadline)
        except TimeoutError:
            self._stop()
            self._remove_partials(out_dir, begun, pid)
            return SlideOutcome(
                name,
                str(path),
                "failed",
                time.perf_counter() - t0,
                error=f"{path}: did not finish within {limit_s:.0f} s (slide_timeout); stopped",
            )
        except BaseException:  # Ctrl-C: the caller records the slide as interrupted
            self._stop()
            self._remove_partials(out_dir, begun, pid)
            raise
        if reply is None or reply[0] != "outcome":
            code = self._stop()
            self._remove_partials(out_dir, begun, pid)
            if next_slides:
                # The child may have died in a slide it had started or was planning ahead (opening
                # it on another thread: a reader's crash there ends this slide too): run this one
                # again, alone, so that only the slide that crashes fails.
                what = "writing this slide" if inferred else "running this slide and opening the next"
                log.warning(
                    "%s: the process running slides died (exit code %s) while %s; running it again alone",
                    path,
                    code,
                    what,
                )
                return self.run(path, name, out_dir, key, limit_s)
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return SlideOutcome(
                name,
                str(path),
                "failed",
                time.perf_counter() - t0,
                error=f"{path}: the process running the slide died ({how})",
            )
        return reply[1]

    @staticmethod
    def _remove_partials(out_dir: Path, names: Sequence[str], pid: int) -> None:
        for name in names:
            for p in slides_dir(out_dir).glob(f".{glob.escape(name)}.partial-{pid}-*"):
                remove_or_warn(p, "the outputs of a stopped slide")

    def close(self) -> None:
        if self.proc is not None and self.send_conn is not None:
            with contextlib.suppress(OSError):
                self.send_conn.send(("stop",))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self._stop()


def make_runner(factory: Callable[[], Any], config: RunConfig, progress: bool) -> InProcessRunner | ChildProcessRunner:
    """A child-process runner, or an in-process one for ``slide_timeout = 0``. The plugin imports of
    every process the run starts are bounded by the slides' limit (a slide of no size's by default)."""
    set_import_limit(slide_time_limit(config, ""))
    if config.slide_timeout == 0:
        return InProcessRunner(factory, progress)
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            "the pipeline factory must be picklable to run slides in a child process "
            f"({exc}); set slide_timeout = 0 to run them in this process"
        ) from exc
    return ChildProcessRunner(factory, progress)
