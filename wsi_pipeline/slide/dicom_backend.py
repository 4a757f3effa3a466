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

import contextlib
import os
from typing import Any

import imagecodecs
import numpy as np
import simplejpeg

from ..errors import TileReadError
from .base import checked_mpp
from .dicom_file import DicomLevel, read_level, series_level_files
from .stored_tiles import StoredTileSlide, _fill

# libjpeg's colour spaces (J_COLOR_SPACE): what the stream holds, for each stored photometric.
_JCS = {"RGB": 2, "YCBCR": 3}


class DicomSlide(StoredTileSlide):
    """A DICOM WSI series opened from its folder or any of its files.

    ``cache_bytes`` bounds the decoded-tile cache as for
    :class:`~.tiff_backend.TiffSlide`.
    """

    backend = "dicom"

    def __init__(self, path: str | os.PathLike[str], cache_bytes: int | None = None):
        super().__init__(path)
        self._fds: list[int] = []
        try:
            self._levels: list[DicomLevel] = []
            for p in series_level_files(self.path):
                self._fds.append(os.open(p, os.O_RDONLY))
                self._levels.append(read_level(p, self._fds[-1]))
            self._init_levels()
            self._decoders = [self._direct_decoder(i) for i in range(len(self._levels))]
            self._kinds = [self._stored_jpeg_kind(i, lv.photometric) for i, lv in enumerate(self._levels)]
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self._init_cache(cache_bytes)

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
        return self._fds[level]

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

    def stored_tiles_present(self, level: int) -> np.ndarray | None:
        """Which tiles of ``level`` have a frame (``tiles_down x tiles_across``), where some have none
        (TILED_SPARSE); None where every tile has one."""
        lv = self._levels[level]
        has = lv.bytecounts > 0
        return None if has.all() else has.reshape(lv.tiles_down, lv.tiles_across)

    def _reference_decode(self, level: int, data: bytes, out: np.ndarray | None = None) -> np.ndarray:
        """A frame decoded by libjpeg told the stream's colour space (from the photometric)."""
        jcs = _JCS[self._levels[level].photometric]
        return imagecodecs.jpeg8_decode(data, colorspace=jcs, outcolorspace=2, out=out)

    def _direct_decoder(self, level: int) -> str:
        """ "simplejpeg" (which reports corrupt data) where it decodes the level's first frame to the
        pixels libjpeg gives when told the colour space, else "imagecodecs" (told it each time)."""
        lv = self._levels[level]
        nonempty = np.flatnonzero(lv.bytecounts)
        if not len(nonempty):
            return "simplejpeg"
        i = int(nonempty[0])
        data = os.pread(self._fds[level], int(lv.bytecounts[i]), int(lv.offsets[i]))
        with contextlib.suppress(Exception):  # a frame that does not decode: reads report it
            ref = self._reference_decode(level, data)
            if np.array_equal(simplejpeg.decode_jpeg(data, strict=False), ref):
                return "simplejpeg"
        return "imagecodecs"

    def _decode_tile(self, level: int, tx: int, ty: int, out: np.ndarray | None = None) -> np.ndarray:
        """Frame (tx, ty) of ``level`` decoded: ``tile_h x tile_w x 3`` uint8 RGB (background without a frame)."""
        lv = self._levels[level]
        if out is None:
            out = np.empty((lv.tile_h, lv.tile_w, 3), np.uint8)
        data = self.raw_tile(level, tx, ty)
        if not data:
            _fill(out, self.background_rgb)
            return out
        if self._decoders[level] == "simplejpeg" and self._decode_jpeg_checked(level, tx, ty, data, out):
            return out
        try:
            img = self._reference_decode(level, data)
        except Exception as exc:  # imagecodecs raises its own error types
            raise TileReadError(
                self.path,
                f"cannot decode frame ({tx}, {ty}) of {os.path.basename(lv.path)}: {exc}",
                self._tile_origin_level0(level, tx, ty),
                level,
            ) from exc
        if img.shape != out.shape:
            raise TileReadError(
                self.path,
                f"frame ({tx}, {ty}) of {os.path.basename(lv.path)} decoded to shape {img.shape}, "
                f"expected {lv.tile_h}x{lv.tile_w}x3",
                self._tile_origin_level0(level, tx, ty),
                level,
            )
        out[...] = img
        return out

    def close(self) -> None:
        if not self._closed:
            for fd in self._fds:
                os.close(fd)
            self._cache.clear()
        super().close()
