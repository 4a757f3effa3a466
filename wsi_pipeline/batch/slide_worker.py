"""The slide process of a batch: started as ``python -m wsi_pipeline.batch.slide_worker`` by
:class:`~.slide_runners.ChildProcessRunner`, it builds the pipeline once and runs the slides it is
sent, its log records and warnings sent to the parent. Nothing imports this module: run as the
process's main module, it must not have been imported already by its package.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ..child_process import child_connections, exception_payload
from ..slide_warnings import format_warning
from .slide_runners import RUN_AHEAD


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
