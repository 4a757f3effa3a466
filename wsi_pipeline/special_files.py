"""Paths that are neither a regular file nor a folder: FIFOs, sockets, devices.

Opening a FIFO for reading waits for a writer, for ever (for writing, for a
reader); a device may never end. Such a path is refused from its ``stat``
alone, before anything opens it; :func:`open_regular` then opens a file
without waiting (``O_NONBLOCK``) and checks what it opened, so that a FIFO
put in its place between the two never blocks either. The program's own
files in an output folder (lock, log, manifest, temporary files) are opened
without following links (``follow_links=False``): a link planted there
would have a write land on whatever file it names.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any

from .errors import SpecialFileError

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),  # seen only where links are not followed
)


def kind_of_mode(st_mode: int) -> str | None:
    """What a ``stat`` mode is when it is neither a regular file nor a folder (None: one of those)."""
    if stat.S_ISREG(st_mode) or stat.S_ISDIR(st_mode):
        return None
    return next((name for test, name in _KINDS if test(st_mode)), "not a regular file")


def special_kind(path: str | os.PathLike[str], follow_links: bool = True) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (with
    ``follow_links`` False, a symbolic link is "a symbolic link", whatever it names)."""
    try:
        return kind_of_mode((os.stat if follow_links else os.lstat)(path).st_mode)
    except (OSError, ValueError):
        return None


def link_loops(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a symbolic link that never reaches a file (it loops)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    except ValueError:
        return False
    return False


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


def open_regular_fd(
    path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o666, follow_links: bool = True
) -> int:
    """``os.open(path, flags)`` of a regular file only; :class:`SpecialFileError` naming ``path``
    where it is a FIFO, socket or device (then not opened, or closed at once, never waited on), and
    with ``follow_links`` False where it is a symbolic link (opened with ``O_NOFOLLOW``)."""
    if kind := special_kind(path, follow_links):
        raise SpecialFileError(path, kind)
    no_follow = 0 if follow_links else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | no_follow, mode)
    except OSError as exc:
        if no_follow and exc.errno == errno.ELOOP:  # a link put there since the check
            raise SpecialFileError(path, "a symbolic link") from None
        raise
    try:
        if kind := kind_of_mode(os.fstat(fd).st_mode):
            raise SpecialFileError(path, kind)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str], mode: str = "rb", follow_links: bool = True, **open_kw: Any) -> IO:
    """``open(path, mode, **open_kw)`` of a regular file only (:func:`open_regular_fd`)."""
    flags = _MODE_FLAGS[mode.replace("b", "").replace("t", "")]
    fd = open_regular_fd(path, flags, follow_links=follow_links)
    try:
        return open(fd, mode, **open_kw)  # noqa: SIM115  (the caller's file)
    except BaseException:
        os.close(fd)
        raise


__all__ = ["kind_of_mode", "link_loops", "open_regular", "open_regular_fd", "refusal", "special_kind"]
