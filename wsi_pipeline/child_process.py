"""Helper processes: started as ``python -m MODULE`` with a pipe each way, ended with their parent.

A batch's slide process (:mod:`.batch.slide_worker`), a pipeline's box-merging
process (:mod:`.stitch.merge_runner`), writer processes (:mod:`.io.writer_process`)
and JPEG helper processes (:mod:`.tiling.jpeg_processes`) start this way. The child imports its
own module and what that needs, nothing more: a process started by
multiprocessing's ``spawn`` imports the caller's main script first, which
may import torch and other large packages (hundreds of MB per process) or,
without a main guard, start a run of its own.

A process killed with SIGKILL (a batch stopping a slide past its limit, the
kernel's out-of-memory killer) runs no clean-up, so each helper watches its
parent and exits once it is gone (:func:`watch_parent`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from .errors import WSIPipelineError
from .plugins import apply_child_state, child_state


def start_child(module: str) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start ``python -m module`` in a session of its own (Ctrl-C at the terminal reaches only the
    caller); returns (process, connection to it, connection from it). The child calls
    :func:`child_connections` with its arguments, which first imports this process's plugins
    (:mod:`.plugins`; :class:`~.errors.PluginError`, before the child starts, where an
    extension registered here cannot reach it)."""
    plugins = child_state()
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    cmd = [sys.executable, "-m", module, str(to_child_r), str(from_child_w), str(os.getpid())]
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, pass_fds=(to_child_r, from_child_w), start_new_session=True
        )
    except BaseException:
        os.close(to_child_w)
        os.close(from_child_r)
        raise
    finally:
        os.close(to_child_r)
        os.close(from_child_w)
    to_child = Connection(to_child_w, readable=False)
    with contextlib.suppress(OSError):  # a child that died at once: its caller finds it out
        to_child.send(plugins)
    return proc, to_child, Connection(from_child_r, writable=False)


def child_connections(argv: Sequence[str]) -> tuple[Connection, Connection]:
    """In a child :func:`start_child` started, given its arguments: (connection from the parent,
    connection to it); the child exits once the parent has ended. The parent's plugin modules and
    registered extensions are imported first."""
    recv_fd, send_fd, parent = (int(a) for a in argv[:3])
    watch_parent(parent)
    recv = Connection(recv_fd, writable=False)
    try:
        apply_child_state(recv.recv())
    except Exception as exc:  # the caller imported the same modules: seldom, and then one line, not a traceback
        print(f"error: {sys.argv[0]}: the run's plugins: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    return recv, Connection(send_fd, readable=False)


def exception_payload(exc: BaseException) -> bytes | str:
    """``exc`` as it can cross to the parent: pickled, or its text where it cannot be unpickled."""
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
        return payload
    except Exception:
        return str(exc) or type(exc).__name__


def exception_from(payload: bytes | str) -> BaseException:
    """The exception :func:`exception_payload` sent (a :class:`WSIPipelineError` of its text, failing that)."""
    if isinstance(payload, bytes):
        with contextlib.suppress(Exception):
            exc = pickle.loads(payload)
            if isinstance(exc, BaseException):
                return exc
    return WSIPipelineError(str(payload))


def _exit_with_parent(parent: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent:
            os._exit(1)


def watch_parent(parent: int | None = None, poll_s: float = 1.0) -> None:
    """In a child process: exit (within ``poll_s`` seconds) once its parent has ended.

    ``parent``: the parent's process id as the parent gave it (None: the
    current parent). Given, a parent that ended while this process started
    is noticed too.
    """
    if parent is None:
        parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent, poll_s), name="watch-parent", daemon=True).start()


__all__ = ["child_connections", "exception_from", "exception_payload", "start_child", "watch_parent"]
