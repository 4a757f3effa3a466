"""DICOM whole-slide images (VL Whole Slide Microscopy, JPEG Baseline frames) read frame by frame.

Each pyramid level is a file of the series (:mod:`.dicom_file` finds them
and locates their frames); a frame is a stored tile, read with ``os.pread``
from its offset and decoded through the stored-tile cache of
:mod:`.stored_tiles`, like a tiled TIFF's tiles; its JPEG stream is
self-contained, so the GPU loader decodes it as it is. TILED_SPARSE levels'
tiles without a frame are background, never decoded for a thumbnail or a coarse tile
(:meth:`stored_tiles_present`): a level claiming 400,000 px square costs its frames. Frames are decoded in the colour
space the Photometric Interpretation names (YBR_FULL_422 / YBR_FULL: YCbCr,
RGB: no transform), never the decoder's guess.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ..errors import TileReadError
from .base import checked_mpp
from .dicom_file import DicomLevel, read_level, series_files
from .stored_tiles import StoredTileSlide, fill_rgb


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class DicomSlide(StoredTileSlide):
    """A DICOM WSI series opened from its folder or any of its files.

    ``cache_bytes`` bounds the decoded-tile cache as for
    :class:`~.tiff_backend.TiffSlide`.
    """

    backend = "dicom"

    def __init__(self, path: str | os.PathLike[str], cache_bytes: int | None = None):
        super().__init__(path)
        # A level's file is opened when its frames are first read, and stays open until close: a
        # series of thousands of level files (forged, or split by a scanner) opened at once would
        # run out of file descriptors (1024 by default, and `ulimit -n` may lower the hard limit
        # too, so raising the soft limit is no cure); a run reads two or three levels. The file
        # opened later must be the one checked here (same device, inode, size and mtime).
        self._fds: list[int | None] = []
        self._identities: list[tuple[int, int, int, int]] = []
        self._fd_lock = threading.Lock()
        try:
            self._levels: list[DicomLevel] = []
            level_files, self._associated = series_files(self.path)
            for p in level_files:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    self._levels.append(read_level(p, fd))
                    self._identities.append(_identity(os.fstat(fd)))
                finally:
                    os.close(fd)
                self._fds.append(None)
            self._init_levels()
            self._kinds = []
            for i, lv in enumerate(self._levels):  # each level's file open for its kind alone
                self._kinds.append(self._stored_jpeg_kind(i, lv.photometric))
                self._close_files(i)
        except BaseException:
            self._close_files()
            raise
        self._init_cache(cache_bytes)

    def _close_files(self, level: int | None = None) -> None:
        """Close the file of ``level`` (None: of every level) where it is open."""
        with self._fd_lock:
            which = range(len(self._fds)) if level is None else [level]
            fds = [self._fds[i] for i in which]
            for i in which:
                self._fds[i] = None
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def _init_levels(self) -> None:
        levels = self._levels
        self._set_level_geometry([f"level {i} ({os.path.basename(lv.path)})" for i, lv in enumerate(levels)])
        self._vendor = "dicom"
        ds = levels[0].header
        self._properties = {
            f"dicom.{name}": str(ds.get(name))
            for name in ("Manufacturer", "ManufacturerModelName", "SeriesInstanceUID", "PhotometricInterpretation")
            if ds.get(name) is not None
        }
        self._properties["dicom.TransferSyntaxUID"] = str(ds.file_meta.TransferSyntaxUID)
        self._mpp = self._find_mpp()

    def _find_mpp(self) -> tuple[float, float] | None:
        """Level 0's (x, y) um/px from the Shared Functional Groups' PixelSpacing (mm: rows, then columns)."""
        try:
            spacing = self._levels[0].header.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing
            row_mm, col_mm = float(spacing[0]), float(spacing[1])
        except (AttributeError, IndexError, TypeError, ValueError):
            return None
        return checked_mpp(self.path, col_mm * 1000, row_mm * 1000)

    # -- stored tiles -------------------------------------------------------
    def _level_fd(self, level: int) -> int:
        fd = self._fds[level]
        if fd is not None:
            return fd
        with self._fd_lock:
            fd = self._fds[level]
            if fd is None:
                fd = self._fds[level] = self._open_level_file(level)
        return fd

    def _open_level_file(self, level: int) -> int:
        """The level's file opened again, refused where it is no longer the file read at open."""
        path = self._levels[level].path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise TileReadError(self.path, f"cannot open {path}: {exc.strerror or exc}", level=level) from exc
        if _identity(os.fstat(fd)) != self._identities[level]:
            os.close(fd)
            raise TileReadError(self.path, f"{path} changed after the slide was opened", level=level)
        return fd

    def _jpeg_level(self, level: int) -> DicomLevel:
        return self._levels[level]

    def stored_tile_format(self, level: int) -> dict[str, Any]:
        """How ``level``'s frames are stored: JPEG, photometric "YCBCR" or "RGB", 3 interleaved samples,
        and the kind of JPEG the frames hold."""
        kind = self._kinds[level]
        return {
            "compression": "JPEG",
            "photometric": self._levels[level].photometric,
            "samples_per_pixel": 3,
            "planar": 1,
            "extra_samples": 0,
            "jpeg_kind": None if kind is None else kind.name,
            "jpeg_baseline": None if kind is None else kind.baseline,
        }

    @property
    def associated_image_names(self) -> tuple[str, ...]:
        """The series' LABEL, OVERVIEW and THUMBNAIL images, as OpenSlide names them."""
        return tuple(self._associated)

    def stored_tiles_present(self, level: int) -> np.ndarray | None:
        """Which tiles of ``level`` have a frame (``tiles_down x tiles_across``), where some have none
        (TILED_SPARSE); None where every tile has one."""
        lv = self._levels[level]
        has = lv.bytecounts > 0
        return None if has.all() else has.reshape(lv.tiles_down, lv.tiles_across)

    def _tile_name(self, level: int, tx: int, ty: int) -> str:
        return f"frame ({tx}, {ty}) of {os.path.basename(self._levels[level].path)}"

    def _stored_colour(self, level: int) -> str | None:
        return self._levels[level].photometric.lower()

    def _decode_tile(self, level: int, tx: int, ty: int, out: np.ndarray | None = None) -> np.ndarray:
        """Frame (tx, ty) of ``level`` decoded: ``tile_h x tile_w x 3`` uint8 RGB (background without a frame)."""
        lv = self._levels[level]
        if out is None:
            out = np.empty((lv.tile_h, lv.tile_w, 3), np.uint8)
        data = self.raw_tile(level, tx, ty)
        if not data:
            fill_rgb(out, self.background_rgb)
            return out
        return self._decode_jpeg_checked(level, tx, ty, data, out)

    def close(self) -> None:
        if not self._closed:
            self._close_files()
            self._cache.clear()
        super().close()
