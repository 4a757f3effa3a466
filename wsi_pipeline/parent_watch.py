"""Helper processes end when the process that started them is gone.

A process killed with SIGKILL (a batch stopping a slide that ran past its
limit, the kernel's out-of-memory killer) runs no clean-up, and the
processes it started (the slide process, writer and box-merging processes)
would otherwise live on, idle, holding memory.
"""

from __future__ import annotations

import os
import threading
import time


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


__all__ = ["watch_parent"]
