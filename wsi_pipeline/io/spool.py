"""Spool files: arrays on disk, written through a memory map, with their blocks reserved first.

A store into a mapped page the file system cannot back (a full disk, a
quota) is not an error Python sees: the kernel sends SIGBUS and the process
dies. So a spool's whole size is reserved with ``posix_fallocate`` when it
is made: a disk without room fails there, as an ``OSError`` (ENOSPC) naming
the file, and the stores into the mapping never need a new block.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

# posix_fallocate's answers where a file system cannot reserve blocks at all (the mapping is used as is).
_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def spool_array(path: str | os.PathLike[str], dtype: np.dtype | str, shape: tuple[int, ...]) -> np.memmap:
    """A new ``.npy`` file at ``path`` of ``shape`` and ``dtype``, mapped for writing, its blocks reserved.

    OSError (ENOSPC: no room for it) naming ``path``, with the file removed, where they cannot be.
    """
    path = Path(path)
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    reserve = getattr(os, "posix_fallocate", None)
    if reserve is None:
        return array
    try:
        with open(path, "r+b") as f:
            reserve(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as exc:
        if exc.errno in _NOT_SUPPORTED:
            return array
        size = path.stat().st_size
        del array
        path.unlink(missing_ok=True)
        raise OSError(exc.errno, f"{exc.strerror} (a spool file of {size} bytes)", str(path)) from None
    return array


__all__ = ["spool_array"]
