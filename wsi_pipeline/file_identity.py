"""The identity of a slide file or folder: what a resumed batch compares, and what DICOM UIDs derive from.

A file's identity is its size, modification time and inode, and a fingerprint
of its first and last 64 KiB and 16 blocks of 4 KiB spread between them, or of
its whole content with ``slide_hash = "full"``; a slide that is a folder is
known by its files' names and sizes and their latest modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .special_files import kind_of_mode, special_kind

HEAD_BYTES = TAIL_BYTES = 64 << 10
SAMPLES = 16
SAMPLE_BYTES = 4 << 10


def input_identity(path: str | os.PathLike[str], slide_hash: str = "sampled") -> dict[str, Any] | None:
    """``{"size", "fingerprint", "mtime_ns", "inode"}`` of a slide file (``slide_hash`` "full": the
    fingerprint of its whole content, and ``"hash": "full"``), of a folder slide its files' names and
    sizes and their latest mtime; None when it cannot be read (the run then fails it). A remote
    address's: its size and ETag (:func:`~.remote.identity.remote_identity`)."""
    if isinstance(path, str) and "://" in path:
        from .remote.address import is_remote

        if is_remote(path):
            from .remote.identity import remote_identity

            return remote_identity(path)
    if os.path.isdir(path):
        return _folder_identity(path)
    if special_kind(path):  # never opened: a FIFO waits for a writer, a device may not end
        return None
    try:
        # Without waiting: a FIFO opened for reading would wait for a writer (refused when read as a slide).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if kind_of_mode(st.st_mode):
                return None
            size = st.st_size
            stamp = {"mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
            h = hashlib.sha256()
            if slide_hash == "full":
                stamp["hash"] = "full"
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                return {"size": size, "fingerprint": h.hexdigest()[:32], **stamp}
            h.update(f.read(HEAD_BYTES))
            if size > HEAD_BYTES + TAIL_BYTES:
                step = (size - HEAD_BYTES - TAIL_BYTES) // (SAMPLES + 1)
                for i in range(1, SAMPLES + 1):
                    f.seek(HEAD_BYTES + i * step)
                    h.update(f.read(SAMPLE_BYTES))
            if size > HEAD_BYTES:
                f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
                h.update(f.read(TAIL_BYTES))
    except (OSError, ValueError):
        return None
    return {"size": size, "fingerprint": h.hexdigest()[:32], **stamp}


def _folder_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    entries = []
    mtime_ns = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            entries.append((os.path.relpath(full, path), st.st_size))
            mtime_ns = max(mtime_ns, st.st_mtime_ns)
    entries.sort()
    listing = json.dumps(entries).encode("utf-8", "surrogateescape")
    return {
        "size": sum(n for _, n in entries),
        "fingerprint": hashlib.sha256(listing).hexdigest()[:32],
        "mtime_ns": mtime_ns,
    }
