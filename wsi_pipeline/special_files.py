"""Paths that are neither a regular file nor a folder: FIFOs, sockets, devices.

Opening a FIFO for reading waits for a writer, for ever; a device may never
end. Such a path is refused from its ``stat`` alone, before anything opens it.
"""

from __future__ import annotations

import os
import stat

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def kind_of_mode(st_mode: int) -> str | None:
    """What a ``stat`` mode is when it is neither a regular file nor a folder (None: one of those)."""
    if stat.S_ISREG(st_mode) or stat.S_ISDIR(st_mode):
        return None
    return next((name for test, name in _KINDS if test(st_mode)), "not a regular file")


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` (links followed) is when it exists and is neither a regular file nor a folder."""
    try:
        return kind_of_mode(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def refusal(kind: str) -> str:
    """The reason a slide of that kind is refused."""
    return f"{kind}, not a regular file: a slide must be a file or a folder"


__all__ = ["kind_of_mode", "refusal", "special_kind"]
