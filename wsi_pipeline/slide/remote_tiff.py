"""Tiled TIFF and Aperio SVS at a remote address, read as :class:`~.tiff_backend.TiffSlide` reads a file.

The reader is the tiled-TIFF reader itself, its file a :class:`~..remote.remote_file.RemoteFile`:
tifffile opens the head block and what the IFDs ask for; stored tiles are read by positional reads
of that file, fetched ahead a region (:meth:`RemoteTiffSlide._assemble`) or a loader's batches
(:meth:`RemoteTiffSlide.fetch_ahead`) at a time, by concurrent merged range requests. So the pixels
are those of the same file read locally, and so are its levels, mpp and stored-tile format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tifffile

from ..errors import SlideError, SlideOpenError
from ..remote.address import shown_address
from ..remote.credentials import redact
from ..remote.remote_file import RemoteFile
from .base import Slide
from .stored_jpeg import ReadBuffer
from .tiff_backend import TiffSlide
from .tiff_file import open_tifffile_stream

# The readers a remote address may be opened with (``open_slide``'s ``backend``).
REMOTE_BACKENDS = ("auto", "tifffile")


class RemoteTiffSlide(TiffSlide):
    """A tiled TIFF or SVS at ``address`` (``https://``, ``http://``, ``s3://``); ``path`` is the
    address without credentials. :meth:`remote_info` says what reading it has cost."""

    def __init__(self, address: str, cache_bytes: int | None = None):
        self._remote = RemoteFile(address)
        try:
            super().__init__(self._remote.name, cache_bytes)
        except BaseException:
            self._remote.close()
            raise
        self._remote.mark_opened()

    def _open_tiff(self) -> tifffile.TiffFile:
        return open_tifffile_stream(self.path, self._remote.stream(), self._remote.size)

    def _file_size(self) -> int:
        return self._remote.size

    def _open_fd(self) -> int:
        return -1  # no file descriptor: every read goes through _pread and _read_level_spans

    def _close_fd(self) -> None:
        self._remote.close()

    def _pread(self, level: int, n: int, offset: int) -> bytes:
        return self._remote.pread(n, offset)

    def _read_level_spans(
        self, level: int, offsets: np.ndarray, counts: np.ndarray, reuse: ReadBuffer
    ) -> tuple[np.ndarray, np.ndarray]:
        return self._remote.read_spans(offsets, counts, reuse)

    def fetch_ahead(self, level: int, boxes: Sequence[tuple[int, int, int, int]]) -> None:
        """Start fetching the stored tiles of ``level`` under ``boxes`` (``x0, y0, x1, y1`` in the
        level's pixels); returns at once."""
        lv = self._levels[level]
        found: set[int] = set()
        for x0, y0, x1, y1 in boxes:
            x0, y0 = max(0, int(x0)), max(0, int(y0))
            x1, y1 = min(lv.width, int(x1)), min(lv.height, int(y1))
            if x0 >= x1 or y0 >= y1:
                continue
            for ty in range(y0 // lv.tile_h, (y1 - 1) // lv.tile_h + 1):
                row = ty * lv.tiles_across
                found.update(range(row + x0 // lv.tile_w, row + (x1 - 1) // lv.tile_w + 1))
        if found:
            idx = np.fromiter(found, np.int64, len(found))
            self._remote.fetch_ahead(lv.offsets[idx].tolist(), lv.bytecounts[idx].tolist())

    def _assemble(self, x0_level0: int, y0_level0: int, level: int, out: np.ndarray, scale: int = 1) -> None:
        # A region's stored tiles fetched together before they are decoded one by one.
        h, w = out.shape[:2]
        ds = self._level_downsamples[level]
        x0, y0 = math.floor(x0_level0 / (ds * scale)) * scale, math.floor(y0_level0 / (ds * scale)) * scale
        self.fetch_ahead(level, [(x0, y0, x0 + w * scale, y0 + h * scale)])
        super()._assemble(x0_level0, y0_level0, level, out, scale)

    def remote_info(self) -> dict[str, Any]:
        """The address (without credentials), its size, ETag and Last-Modified, and the requests
        and bytes it took to open (``open_requests``, ``open_bytes``) and since (``requests``, ``bytes``)."""
        r = self._remote
        return {"address": self.path, "size": r.size, "etag": r.etag, "last_modified": r.last_modified, **r.stats()}


def open_remote_slide(address: str, backend: str = "auto") -> Slide:
    """The slide at a remote ``address`` (a tiled TIFF or SVS), opened with ``backend`` ("auto" or
    "tifffile"); any failure a :class:`SlideError` naming the address without credentials."""
    shown = shown_address(address)
    if backend not in REMOTE_BACKENDS:
        raise SlideOpenError(shown, f"a remote slide is read with the tifffile reader (tiled TIFF, SVS), not {backend}")
    try:
        return RemoteTiffSlide(address)
    except SlideError:
        raise
    except MemoryError as exc:
        raise SlideOpenError(shown, "opening it needs more memory than is available") from exc
    except Exception as exc:  # the one boundary, as open_slide's for a file
        what = redact(f"{type(exc).__name__}: {exc}")
        raise SlideOpenError(shown, f"cannot be opened as a tiled TIFF or SVS ({what})") from exc
