"""A writer process of :class:`~.writer_pool.WriterPool`: runs the jobs it is sent, one at a time.

Started as ``python -m wsi_pipeline.io.writer_process`` (:func:`~..child_process.start_child`), so
it imports this package's writers and nothing of the caller's main script. Messages from the
pool: ``("path", sys.path)`` first, then ``("job", pickled (fn, args))`` and ``("close",)``;
each job is answered ``("ok", result, peak)`` or ``("error", exception payload, peak)``, ``peak`` the
process's peak resident memory during the job in MB (None where the system cannot say).
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection

from wsi_pipeline.child_process import child_connections, exception_payload


def _serve(recv: Connection, send: Connection) -> None:
    from wsi_pipeline.io import detections, ome_tiff, overlay  # noqa: F401  (the jobs' modules, imported ahead)
    from wsi_pipeline.io.writer_pool import call_with_files

    while True:
        try:
            msg = recv.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            return
        if msg[0] == "path":
            sys.path[:] = msg[1]
            continue
        measured = _reset_peak_memory()
        try:
            fn, args = pickle.loads(msg[1])
            reply = ("ok", pickle.dumps(call_with_files(fn, *args)))
        except BaseException as exc:  # the job's failure goes to the caller, which raises it
            reply = ("error", exception_payload(exc))
        send.send((*reply, _peak_memory_mb() if measured else None))


def _reset_peak_memory() -> bool:
    """Start this process's peak resident memory (VmHWM) afresh (Linux 4.0 and later); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_memory_mb() -> float | None:
    """This process's peak resident memory since :func:`_reset_peak_memory` (MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


if __name__ == "__main__":
    _serve(*child_connections(sys.argv[1:]))
