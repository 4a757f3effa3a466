"""Output files written in worker processes, in parallel with each other and with the caller.

Formatting a slide's 10^5-10^6 detections as GeoJSON and CSV, and drawing
its overlay, is CPU work that holds the interpreter lock: run in threads it
would stall the next slide's tile loading and stitching. Each job here runs
in a process of a small pool (started on first use as ``python -m
wsi_pipeline.io.writer_process``, so it imports the writers and nothing of
the caller's main script: a process started with multiprocessing's ``spawn``
imports that script first, torch included where the script imports it), writes
its file atomically (:mod:`.atomic`) and returns the path. A job that fails
raises its error from :meth:`WriteJobs.wait`; a worker that dies (killed,
out of memory) fails the job it held with a
:class:`~wsi_pipeline.errors.WSIPipelineError`, and a new worker takes the
next jobs.

Large array arguments (the detections, the overlay's thumbnail and heatmap)
reach a worker through a file (:class:`ArrayFile`), not the job's pickle:
pickling copies them with the interpreter lock held, about 24 ms for a 16 MB
array, while the file is written with the lock released.

Where no child process should be started (a daemonic worker process, as some
cluster runners use; a system that is not POSIX) or ``processes=0``, jobs run
in the calling thread.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no orphaned folders are looked for
    fcntl = None  # type: ignore[assignment]

from ..child_process import exception_from, start_child
from ..errors import ConfigError, SpecialFileError, WSIPipelineError
from ..special_files import open_regular


def default_processes(cpus: int | None = None) -> int:
    """Writer processes for a machine of ``cpus`` CPUs (default: this one's): 3, or a quarter of
    the CPUs where that is more, at most 6: a batch on a large machine writes several slides'
    files at once while it runs the next ones, and most CPUs stay with tile loading."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(3, min(6, cpus // 4))


DEFAULT_PROCESSES = default_processes()
# A detection file of at least twice this many rows is written in parts by several writer processes
# at once (one part per process, each of at least this many rows); the GeoJSON of a slide's
# 286,528 detections took about 1.5 s to format in one process.
PART_ROWS = 50_000


_MAIN_GUARD = (
    "a process started with multiprocessing's spawn imports the main script first: a script that "
    'starts such processes must run the pipeline under `if __name__ == "__main__":`'
)


def check_not_importing_main() -> None:
    """Raise :class:`ConfigError` in a process started with ``spawn`` that is importing the user's
    main script (the caller's own multiprocessing: this package's processes do not import it).

    A process started with ``spawn`` imports ``__main__`` first; a script that
    builds a pipeline at its top level (no main guard) would otherwise run a
    whole slide there.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ConfigError(f"a pipeline was started while a new process imported the main script; {_MAIN_GUARD}")


# Array arguments of at least this many bytes go to the worker through a file (see the module docstring).
FILE_ARG_BYTES = 1 << 20
_ARGS_PREFIX = "wsi-pipeline-args-"


class ArrayFile:
    """An array argument of a job, written to a file by the submitting process; the worker reads it
    back (:meth:`load`) and removes the file. Pickles as its path, dtype and shape."""

    def __init__(self, path: Path, array: np.ndarray):
        self.path, self.dtype, self.shape = path, array.dtype, array.shape
        data = np.ascontiguousarray(array)
        with open_regular(path, "wb") as f:
            f.write(memoryview(data.reshape(-1).view(np.uint8)))  # written without the interpreter lock

    def load(self) -> np.ndarray:
        try:
            data = np.fromfile(self.path, np.uint8)
        finally:
            self.path.unlink(missing_ok=True)
        expected = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if data.size != expected:
            raise WSIPipelineError(f"{self.path}: expected {expected} bytes of a job's array, found {data.size}")
        return data.view(self.dtype).reshape(self.shape)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def call_with_files(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on the arguments, the :class:`ArrayFile` ones read back first (in the worker)."""
    return fn(*(a.load() if isinstance(a, ArrayFile) else a for a in args))


def _goes_to_file(arg: Any) -> bool:
    return isinstance(arg, np.ndarray) and arg.nbytes >= FILE_ARG_BYTES and not arg.dtype.hasobject


def _own_folder(folder: Path) -> Any:
    """Lock ``folder`` for this process (the lock ends with the process); the open lock file, or
    None where it cannot be locked (no lock file is left then, so no other pool removes it)."""
    if fcntl is None:
        return None
    path = folder / "lock"
    try:
        f = open_regular(path, "wb")  # held open for the pool's life
    except (OSError, SpecialFileError):
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        path.unlink(missing_ok=True)
        return None
    return f


def _remove_orphaned_arg_dirs(parent: Path) -> None:
    """Remove the argument folders of pools whose process is gone (killed before it could remove
    them): those whose lock file nobody holds, left alone for a minute after they are made (the
    lock is taken just after)."""
    if fcntl is None:
        return
    for folder in parent.glob(f"{_ARGS_PREFIX}*"):
        try:
            if time.time() - folder.stat().st_mtime < 60:
                continue
            with open_regular(folder / "lock") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (OSError, SpecialFileError):  # held by a running pool (BlockingIOError), or not ours to remove
            continue
        shutil.rmtree(folder, ignore_errors=True)


class WriteJobs:
    """The jobs of one output folder; :meth:`wait` returns when every file is written."""

    def __init__(self) -> None:
        self._futures: list[tuple[str, Future]] = []

    def add(self, name: str, future: Future) -> None:
        self._futures.append((name, future))

    def wait(self) -> None:
        """Block until all jobs end; raise the first failure (after every job has ended)."""
        first: BaseException | None = None
        for name, fut in self._futures:
            try:
                fut.result()
            except WriterDied as exc:
                first = first or WSIPipelineError(f"writing {name}: {exc}")
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def done(self) -> bool:
        return all(f.done() for _, f in self._futures)

    def results(self) -> list[Any]:
        """What each job returned (a file's path, say), in the order submitted, once every job has
        ended; raises as :meth:`wait`."""
        self.wait()
        return [fut.result() for _, fut in self._futures]

    def writer_peaks(self) -> dict[int, float]:
        """Each writer process's (pid) largest peak resident memory (MB) over these jobs, where measured."""
        peaks: dict[int, float] = {}
        for _, fut in self._futures:
            pid, peak = getattr(fut, "writer_peak", (None, None))
            if pid is not None and peak is not None:
                peaks[pid] = max(peak, peaks.get(pid, 0.0))
        return peaks


def writer_peak_memory_mb(jobs: Sequence[WriteJobs]) -> float | None:
    """The writer processes' peak resident memory over ``jobs``, added up (MB): each process's largest
    peak during one of the jobs; their sum bounds what they held at once. None: none measured."""
    peaks: dict[int, float] = {}
    for j in jobs:
        for pid, peak in j.writer_peaks().items():
            peaks[pid] = max(peak, peaks.get(pid, 0.0))
    return round(sum(peaks.values()), 1) if peaks else None


class WriterPool:
    """A pool of ``processes`` writer processes, started on first use; thread-safe."""

    def __init__(self, processes: int = DEFAULT_PROCESSES):
        self.processes = max(0, int(processes))
        self._pool: _WriterProcesses | None = None
        self._lock = threading.Lock()
        self._arg_dir: Path | None = None
        self._arg_cleanup: weakref.finalize | None = None
        self._arg_ids = itertools.count()

    def _file_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with each large array written to a file of this pool's folder (:class:`ArrayFile`);
        where the temporary folder cannot take it (full, read-only), the array stays in the pickle."""
        if not any(_goes_to_file(a) for a in args):
            return args
        folder = self._folder()
        if folder is None:
            return args
        out: list[Any] = []
        try:
            for a in args:
                if _goes_to_file(a):
                    path = folder / f"{next(self._arg_ids)}.bin"
                    try:
                        a = ArrayFile(path, a)
                    except OSError:
                        path.unlink(missing_ok=True)
                out.append(a)
        except BaseException:
            _discard_files(out)
            raise
        return tuple(out)

    def _folder(self) -> Path | None:
        """This pool's folder for array files (made on first use), or None where none can be made."""
        with self._lock:
            if self._arg_dir is None:
                try:
                    parent = Path(tempfile.gettempdir())
                    _remove_orphaned_arg_dirs(parent)
                    folder = Path(tempfile.mkdtemp(prefix=_ARGS_PREFIX, dir=parent))
                except OSError:
                    return None
                lock = _own_folder(folder)
                self._arg_dir = folder
                # Removed by close(), or when the pool is collected or the interpreter exits unclosed.
                self._arg_cleanup = weakref.finalize(self, _remove_arg_dir, folder, lock)
            return self._arg_dir

    def _in_caller(self) -> bool:
        """Whether jobs run in the calling thread: no processes asked for, a daemonic process (which
        some cluster runners use), or a system whose processes cannot be handed pipes (not POSIX)."""
        return self.processes == 0 or multiprocessing.current_process().daemon or not _POSIX

    def _executor(self) -> _WriterProcesses | None:
        """The processes (None: jobs run in the caller), started on first use."""
        if self._in_caller():
            return None
        with self._lock:
            if self._pool is None:
                self._pool = _WriterProcesses(self.processes)
                # A pool collected unclosed ends its processes (once their jobs are done).
                weakref.finalize(self, self._pool.shut)
            return self._pool

    def start(self) -> None:
        """Start the processes now (each imports its modules: a second or more), e.g. while a slide runs."""
        self._executor()

    def parts(self, rows: int) -> int:
        """In how many parts a detection file of ``rows`` rows is written (1: whole, by one job)."""
        if self.processes < 2 or self._in_caller():
            return 1
        return max(1, min(self.processes, rows // PART_ROWS))

    def submit(self, jobs: WriteJobs, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` (a module-level function: it is pickled) for ``jobs``."""
        pool = self._executor()
        if pool is None:
            fut: Future = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)
            jobs.add(name, fut)
            return
        args = self._file_args(args)
        try:
            fut = pool.submit(fn, args)
        except BaseException:
            _discard_files(args)
            raise
        if any(isinstance(a, ArrayFile) for a in args):
            # The worker removes the files it reads; these are those of a job that never ran.
            fut.add_done_callback(lambda _f: _discard_files(args))
        jobs.add(name, fut)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        with self._lock:
            cleanup, self._arg_cleanup, self._arg_dir = self._arg_cleanup, None, None
        if cleanup is not None:
            cleanup()


class WriterDied(WSIPipelineError):
    """A writer process ended while it held a job."""


# Writer processes are handed their pipes by descriptor (child_process.start_child): POSIX only.
_POSIX = os.name == "posix"
# Seconds a writer process is given to end after it is asked to, before it is killed.
CLOSE_WAIT_S = 30.0


class _Worker:
    """One writer process and its connections."""

    def __init__(self) -> None:
        self.proc, self.send, self.recv = start_child("wsi_pipeline.io.writer_process")
        self.last_peak_mb: float | None = None  # the process's peak resident memory during its last job

    def run(self, payload: bytes) -> Any:
        """Send a job, wait for its reply; the job's result, or raise its failure (:class:`WriterDied`
        when the process ends first)."""
        try:
            self.send.send(("job", payload))
            kind, value, self.last_peak_mb = self.recv.recv()
        except (EOFError, OSError):
            raise WriterDied(f"the writer process died (exit code {self.stop(kill=True)})") from None
        if kind == "ok":
            return pickle.loads(value)
        raise exception_from(value)

    def stop(self, kill: bool = False) -> int | None:
        """End the process (asked to, or killed) and return its exit code."""
        if not kill:
            with contextlib.suppress(OSError):
                self.send.send(("close",))
        for conn in (self.send, self.recv):
            conn.close()
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(None if kill else CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class _WriterProcesses:
    """``count`` writer processes, each fed by a thread of this process from one queue of jobs, in
    the order they are submitted. A process that dies fails its job and is replaced."""

    def __init__(self, count: int):
        self._jobs: deque[tuple[Future, bytes]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None  # no process could be started
        self._path = list(sys.path)
        self._threads = [
            threading.Thread(target=self._feed, name="writer-feed", daemon=True) for _ in range(int(count))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future:
        """Queue ``call_with_files(fn, *args)``; ``fn`` and ``args`` are pickled now (an error here)."""
        payload = pickle.dumps((fn, args))
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the writer processes are closed")
            if self._failure is not None:
                raise WSIPipelineError(f"no writer process could be started: {self._failure}")
            self._jobs.append((fut, payload))
            self._cond.notify()
        return fut

    def _next(self) -> tuple[Future, bytes] | None:
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            return self._jobs.popleft() if self._jobs else None

    def _start(self) -> _Worker | None:
        """A new process, told this process's ``sys.path`` (so that jobs' functions unpickle there);
        None where none can be started (every queued job then fails)."""
        try:
            worker = _Worker()
            worker.send.send(("path", self._path))
            return worker
        except OSError as exc:
            with self._cond:
                self._failure = exc
                failed, self._jobs = list(self._jobs), deque()
            for fut, _ in failed:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(WSIPipelineError(f"no writer process could be started: {exc}"))
            return None

    def _feed(self) -> None:
        worker = self._start()
        try:
            while worker is not None:
                job = self._next()
                if job is None:
                    return
                fut, payload = job
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = worker.run(payload)
                    fut.writer_peak = (worker.proc.pid, worker.last_peak_mb)  # type: ignore[attr-defined]
                    fut.set_result(result)
                except WriterDied as exc:
                    fut.set_exception(exc)
                    worker = self._start()
                except BaseException as exc:
                    fut.set_exception(exc)
        finally:
            if worker is not None:
                worker.stop()

    def shut(self) -> None:
        """Cancel the jobs not begun; the processes end once the jobs begun are done (not waited for)."""
        with self._cond:
            self._closed = True
            cancelled, self._jobs = list(self._jobs), deque()
            self._cond.notify_all()
        for fut, _ in cancelled:
            fut.cancel()

    def close(self) -> None:
        """:meth:`shut`, then wait for the processes to end."""
        self.shut()
        for t in self._threads:
            t.join()


def _remove_arg_dir(folder: Path, lock: Any) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if lock is not None:
        lock.close()


def _discard_files(args: Any) -> None:
    for a in args:
        if isinstance(a, ArrayFile):
            with contextlib.suppress(OSError):
                a.discard()
