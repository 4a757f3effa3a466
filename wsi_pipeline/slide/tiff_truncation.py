"""Whether a TIFF that failed to open is truncated: its page chain leads past the end of the file.

tifffile stops its walk of the page chain at a pointer past the end of the
file, as a reader of a damaged file should, and the error it raises later
(no image, a corrupted IFD) does not say why; this walk names the page and
the byte where the file ends too early.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from ..errors import SpecialFileError
from ..special_files import open_regular


def tiff_truncation(path: str, max_pages: int) -> str | None:
    """The reason "truncated TIFF: ..." naming the page whose IFD lies or runs past the end of
    the TIFF at ``path``; None where the chain ends inside the file within ``max_pages`` pages
    (or ``path`` is no TIFF)."""
    try:
        size = os.path.getsize(path)
        with open_regular(path) as f:
            return _walk(f, size, max_pages)
    except (OSError, struct.error, SpecialFileError):
        return None


def _walk(f: BinaryIO, size: int, max_pages: int) -> str | None:
    head = f.read(16)
    if len(head) < 8 or head[:2] not in (b"II", b"MM"):
        return None
    e = "<" if head[:2] == b"II" else ">"
    magic = struct.unpack(e + "H", head[2:4])[0]
    if magic == 42:
        offset, count_fmt, entry_size, next_fmt = struct.unpack(e + "I", head[4:8])[0], e + "H", 12, e + "I"
    elif magic == 43 and len(head) == 16:
        offset, count_fmt, entry_size, next_fmt = struct.unpack(e + "Q", head[8:16])[0], e + "Q", 20, e + "Q"
    else:
        return None
    count_size, next_size = struct.calcsize(count_fmt), struct.calcsize(next_fmt)
    seen: set[int] = set()
    while offset and offset not in seen and len(seen) < max_pages:
        page = len(seen)
        if offset + count_size > size:
            return f"truncated TIFF: page {page}'s IFD at byte {offset} lies past the end of the file ({size} bytes)"
        seen.add(offset)
        f.seek(offset)
        n = struct.unpack(count_fmt, f.read(count_size))[0]
        next_at = offset + count_size + n * entry_size
        if next_at + next_size > size:
            return (
                f"truncated TIFF: page {page}'s IFD at byte {offset} ({n} entries) runs past the end of "
                f"the file ({size} bytes)"
            )
        f.seek(next_at)
        offset = struct.unpack(next_fmt, f.read(next_size))[0]
    return None
