"""Paths that are neither a regular file nor a folder: FIFOs, sockets, devices.

Opening a FIFO for reading waits for a writer, for ever (for writing, for a
reader); a device may never end. Such a path is refused from its ``stat``
alone, before anything opens it; :func:`open_regular` then opens a file
without waiting (``O_NONBLOCK``) and checks what it opened, so that a FIFO
put in its place between the two never blocks either.
"""

from __future__ import annotations

import os
import stat
from typing import IO, Any

from .errors import SpecialFileError

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


# open()'s modes -> os.open flags (binary and text alike).
_MODE_FLAGS = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


def open_regular_fd(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """``os.open(path, flags)`` of a regular file only; :class:`SpecialFileError` naming ``path``
    where it is a FIFO, socket or device (then not opened, or closed at once, never waited on)."""
    if kind := special_kind(path):
        raise SpecialFileError(path, kind)
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        if kind := kind_of_mode(os.fstat(fd).st_mode):
            raise SpecialFileError(path, kind)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str], mode: str = "rb", **open_kw: Any) -> IO:
    """``open(path, mode, **open_kw)`` of a regular file only (:func:`open_regular_fd`)."""
    flags = _MODE_FLAGS[mode.replace("b", "").replace("t", "")]
    fd = open_regular_fd(path, flags)
    try:
        return open(fd, mode, **open_kw)  # noqa: SIM115  (the caller's file)
    except BaseException:
        os.close(fd)
        raise


__all__ = ["kind_of_mode", "open_regular", "open_regular_fd", "refusal", "special_kind"]
