"""Slides of a batch run in a child process, each under a wall-clock limit.

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
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..child_process import child_connections, exception_from, exception_payload, start_child
from ..config import RunConfig
from ..errors import WSIPipelineError
from ..plugins import set_import_limit
from ..slide_warnings import format_warning
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


# -- the child ----------------------------------------------------------------------


class _PipeHandler(logging.Handler):
    """Sends each record, formatted, to the parent (from any thread)."""

    def __init__(self, conn: Connection):
        super().__init__()
        self.conn = conn
        self.send_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg = record.getMessage()
            record.args = None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            with self.send_lock:
                self.conn.send(("log", record))
        except Exception:
            self.handleError(record)


def _serve(recv_conn: Connection, send_conn: Connection) -> None:
    from .jobs import start_slide

    # Ctrl-C and SIGTERM reach the whole process group: the parent handles them, and ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _, path_list, levels, factory_bytes, progress = recv_conn.recv()
    sys.path[:] = path_list
    handler = _send_logs_to_parent(send_conn, levels)
    try:
        pipeline = pickle.loads(factory_bytes)()
    except BaseException as exc:
        send_conn.send(("fatal", exception_payload(exc)))
        return
    send_conn.send(("ready",))
    # While slide k's files are written (a thread waits for them, moves its folder into place and
    # sends its outcome), the next slides the parent named are already run here, in order; when the
    # parent asks for one, its result is taken (slides run ahead that it no longer names are thrown away).
    # The slides named after those are planned (opened, tissue found) on a thread meanwhile.
    ahead: dict[tuple[str, str], Any] = {}
    finishing: list[threading.Thread] = []
    planner = ThreadPoolExecutor(1, thread_name_prefix="plan-slide")
    make_plan = getattr(pipeline, "plan", None)  # a pipeline that cannot plan runs slides from their paths
    plans: dict[tuple[str, str], Future] = {}

    def finish(started: Any) -> None:
        outcome = started.finish()
        with handler.send_lock:
            send_conn.send(("outcome", outcome))

    def run(path: Any, name: str, out_dir: Any, key: Any) -> Any:
        fut = plans.pop((str(path), name), None)
        plan = None
        if fut is not None and fut.exception() is None:
            plan = fut.result()
        # Without a plan (its making failed), the run opens the slide itself and reports what fails.
        return start_slide(pipeline, path, name, out_dir, key, progress, wait_written=False, plan=plan)

    try:
        while True:
            try:
                msg = recv_conn.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                return
            _, path, name, out_dir, key, next_slides = msg
            named = [(str(p), n) for p, n in next_slides]
            for k in [k for k in plans if k not in named and k != (str(path), name)]:
                _close_plan(plans.pop(k))
            for p, k in zip([path, *(p for p, _ in next_slides)], [(str(path), name), *named], strict=True):
                if make_plan is not None and k not in ahead and k not in plans:
                    plans[k] = planner.submit(make_plan, p)
            started = ahead.pop((str(path), name), None)
            if started is None:
                started = run(path, name, out_dir, key)
            with handler.send_lock:
                send_conn.send(("inferred", name))
            finishing = [t for t in finishing if t.is_alive()]
            t = threading.Thread(target=finish, args=(started,), name="finish-slide", daemon=True)
            t.start()
            finishing.append(t)
            run_next = named[:RUN_AHEAD]
            for k in [k for k in ahead if k not in run_next]:
                ahead.pop(k).discard()
            for (next_path, next_name), k in zip(next_slides[:RUN_AHEAD], run_next, strict=True):
                if k not in ahead:
                    ahead[k] = run(next_path, next_name, out_dir, key)
    finally:
        for started in ahead.values():
            started.discard()
        for fut in plans.values():
            _close_plan(fut)
        planner.shutdown(wait=True)
        for t in finishing:
            t.join()
        pipeline.close()


def _send_logs_to_parent(send_conn: Connection, levels: dict[str, int]) -> _PipeHandler:
    """Send this process's log records and warnings to the parent, its loggers at the parent's ``levels``."""
    handler = _PipeHandler(send_conn)
    root = logging.getLogger()
    root.addHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    warnings.formatwarning = format_warning  # one line each, as the parent's own warnings
    return handler


def _close_plan(fut: Future) -> None:
    """Close the slide of a plan that will not run, once it is made."""

    def close(done: Future) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    if not fut.cancel():
        fut.add_done_callback(close)


# glibc's mallopt parameter for the size from which each block is mapped on its own.
_M_MMAP_THRESHOLD = -3
# Blocks of this many bytes or more are mapped on their own in the slide process.
MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_blocks_alone(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have glibc's malloc map every block of ``threshold`` bytes or more on its own, so that it goes
    back to the system when freed; False where that cannot be set (not glibc).

    By default glibc raises that threshold to the largest mapped block freed so far (up to 32 MiB)
    and carves smaller blocks from its heaps, which seldom shrink. A slide process cycles each
    slide's arrays of 1-30 MB through several threads, and grew that way: over four 8k slides its
    peak went from 651 to 738 MB, against 593-598 MB with this setting (benchmarks/HISTORY.md).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> None:
    from ..slide.isolated import isolate_in_this_process

    map_large_blocks_alone()
    isolate_in_this_process(False)  # a crash here fails its slide alone: OpenSlide is asked directly
    _serve(*child_connections(argv))
    # Every slide is written and the pipeline closed; the parent waits for this process to end.
    # The interpreter's own teardown (torch's and its CUDA context's) adds nothing but that wait.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
