"""OpenSlide's calls that may crash the process, made in a helper process.

OpenSlide's C code crashes on some damaged files (a segmentation fault, which no Python handler
sees). What a process that must outlive such a file asks of OpenSlide, which vendor a file is
(:func:`openslide_vendor`, for :class:`~.readers.FormatProbe`) and what ``wsi-pipeline info``
reads of a slide OpenSlide opens (:func:`call_isolated`), is asked in one helper process
(``python -m wsi_pipeline.slide.isolated``, :func:`~wsi_pipeline.child_process.start_child`),
kept for the next call. A crash there fails that file with a :class:`SlideOpenError` naming the
signal, and the next call starts a new helper.

A process that is itself the place where a crash fails one slide alone (a batch's slide process,
this helper) asks OpenSlide directly (:func:`isolate_in_this_process`): a helper of its own would
only cost its start.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..child_process import child_connections, exception_from, exception_payload, start_child
from ..errors import SlideOpenError

# Seconds OpenSlide may take to tell a file's vendor (it reads a few headers) before its helper is
# stopped and the file refused.
DETECT_LIMIT_S = 300.0
# Vendors remembered per file (path and identity), so that a file is asked about once per process.
_MAX_REMEMBERED = 4096

_isolating = True
_remembered: dict[tuple, str | None | SlideOpenError] = {}


def isolate_in_this_process(on: bool) -> None:
    """Whether this process asks OpenSlide through a helper process (the default) or directly."""
    global _isolating
    _isolating = on


def _died(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {-returncode}, {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"exit code {returncode}"


class _Helper:
    """The helper process, started on first use (again after a crash, and in a forked child)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: Any = None
        self.pid = 0
        self.send: Connection | None = None
        self.recv: Connection | None = None

    def _start(self) -> None:
        self.proc, self.send, self.recv = start_child("wsi_pipeline.slide.isolated")
        self.pid = os.getpid()

    def stop(self) -> int | None:
        if self.pid != os.getpid():  # inherited through a fork: the parent's, not ours to stop
            self.proc = self.send = self.recv = None
            return None
        for conn in (self.send, self.recv):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        proc, self.proc, self.send, self.recv = self.proc, None, None, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def call(self, path: str, what: str, fn: Callable[..., Any], args: tuple, limit_s: float | None) -> Any:
        with self.lock:
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                self.stop()
                self._start()
            assert self.send is not None and self.recv is not None
            try:
                self.send.send((fn, args))
                answered = self.recv.poll(limit_s)
                reply = self.recv.recv() if answered else None
            except (EOFError, OSError):
                raise SlideOpenError(path, f"OpenSlide crashed {what} ({_died(self.stop())})") from None
            except BaseException:  # Ctrl-C while it works: its answer would be taken for the next call's
                self.stop()
                raise
            if reply is None:
                self.stop()
                raise SlideOpenError(path, f"OpenSlide did not finish {what} within {limit_s:g} s")
        status, value = reply
        if status == "ok":
            return value
        raise exception_from(value)


_helper = _Helper()
atexit.register(_helper.stop)


def call_isolated(path: str, what: str, fn: Callable[..., Any], *args: Any, limit_s: float | None = None) -> Any:
    """``fn(*args)`` (a module-level function, and a result that can be pickled) in the helper
    process, or here where this process does not isolate OpenSlide; a crash there is a
    :class:`SlideOpenError` naming ``path``, ``what`` was being done ("reading it") and the signal."""
    if not _isolating:
        return fn(*args)
    return _helper.call(path, what, fn, args, limit_s)


def _detect_format(path: str) -> str | None:
    import openslide

    try:
        return openslide.OpenSlide.detect_format(path)
    except Exception:  # OpenSlide does not read it
        return None


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def openslide_vendor(path: str) -> str | None:
    """OpenSlide's ``detect_format`` of ``path`` (None: OpenSlide does not read it, or is not
    installed), asked in the helper process; :class:`SlideOpenError` where OpenSlide crashes on
    the file. Remembered per file, a crash included."""
    if importlib.util.find_spec("openslide") is None:
        return None
    key = _identity(path)
    known = _remembered.get(key, False) if key is not None else False
    if known is False:
        try:
            known = call_isolated(path, "detecting its format", _detect_format, path, limit_s=DETECT_LIMIT_S)
        except SlideOpenError as exc:
            known = exc
        if key is not None:
            if len(_remembered) >= _MAX_REMEMBERED:
                _remembered.clear()
            _remembered[key] = known
    if isinstance(known, SlideOpenError):
        raise known
    return known


def _serve(recv: Connection, send: Connection) -> None:
    isolate_in_this_process(False)
    while True:
        try:
            message = recv.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args = pickle.loads(message)
            send.send(("ok", fn(*args)))
        except Exception as exc:  # sent back and raised in the caller (a function it cannot import too)
            send.send(("error", exception_payload(exc)))


if __name__ == "__main__":  # the functions sent are those of the imported module: serve from it
    from wsi_pipeline.slide import isolated

    isolated._serve(*child_connections(sys.argv[1:]))


__all__ = ["DETECT_LIMIT_S", "call_isolated", "isolate_in_this_process", "openslide_vendor"]
