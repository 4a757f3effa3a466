"""Tiled TIFF, BigTIFF and OME-TIFF read stored tile by stored tile with tifffile.

This is the fast path for tile grids (:mod:`.stored_tiles`: the decoded-tile
cache and region assembly): every stored tile a patch touches is decoded
once (3-sample JPEG straight with libjpeg-turbo through simplejpeg, which
reports corrupt data (see :mod:`.damage`), anything else with the page's own
codec) and reused by the overlapping patches of a grid. OpenSlide also caches tiles, but
32 MiB by default (a band of grid rows does not fit) and each call pays its
own ARGB conversion; the benchmark ``benchmarks/bench_reader.py`` compares
the two.

Pyramid levels and associated images are found by OpenSlide's rules
(:mod:`.tiff_levels`). Each level's geometry and tile table are checked
against the file before anything is allocated (:mod:`.tiff_file`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import tifffile

from ..errors import SlideError, SlideOpenError, TileReadError
from ..io.ome_xml import read_ome_pixels
from .base import checked_mpp, composite_rgba
from .jpeg_kind import JpegKind
from .resolution import aperio_mpp, tiff_page_mpp
from .stored_tiles import StoredTileSlide, fill_rgb
from .tiff_file import check_page_data, check_tag_types, open_tifffile, page_name, refuse_cmyk
from .tiff_levels import tiff_pyramid

# TIFF compression 33003: Aperio's JPEG 2000 of YCbCr samples (33005 holds RGB).
APERIO_JP2000_YCBCR = 33003


@dataclass
class _Level:
    page: tifffile.TiffPage
    width: int
    height: int
    tile_w: int
    tile_h: int
    tiles_across: int
    tiles_down: int
    offsets: np.ndarray
    bytecounts: np.ndarray
    jpegtables: bytes | None
    # How stored tiles are decoded when not through page.decode: "simplejpeg"
    # (reports corrupt data) or None.
    decoder: str | None = None
    # The kind of JPEG the level's tiles hold (None: not JPEG, or no tile stored).
    jpeg_kind: JpegKind | None = None


def _tag_name(value: Any) -> str:
    """A TIFF tag's value by its name where tifffile knows it (an enum), else as a number."""
    return str(getattr(value, "name", value))


def _aperio_fields(description: str) -> dict[str, Any]:
    """The ``key = value`` fields of an Aperio ImageDescription (empty where it has none)."""
    try:
        return dict(tifffile.tifffile.svs_description_metadata(description))
    except Exception:  # malformed: the slide is still read, without its fields
        return {}


class TiffSlide(StoredTileSlide):
    """A tiled TIFF opened with :mod:`tifffile`.

    ``cache_bytes`` bounds the decoded-tile cache shared by all threads
    reading this slide. By default it is the smaller of 256 MiB and a band
    of stored-tile rows :data:`~.stored_tiles.CACHE_BAND_PX` pixels tall across the widest
    level (104 MiB for a 20,000 px wide slide in 256 px tiles): a grid read
    in row order keeps all its reuse between rows, for patches up to about
    1024 px, and less memory is first touched (on a VM page faults are
    dear). Past about 50,000 px wide (256 px tiles) the 256 MiB bound
    applies instead, and wide enough slides lose part of the reuse between
    rows. Give ``cache_bytes`` for other access orders; it is then used as
    given.
    """

    backend = "tifffile"

    def __init__(self, path: str | os.PathLike[str], cache_bytes: int | None = None):
        super().__init__(path)
        self._tif = self._open_tiff()
        try:
            self._init_levels()
            self._fd = self._open_fd()
        except BaseException:
            self._tif.close()
            raise
        try:
            for i, lv in enumerate(self._levels):
                lv.decoder = self._direct_decoder(lv)
                if lv.page.compression == tifffile.COMPRESSION.JPEG:
                    lv.jpeg_kind = self._stored_jpeg_kind(i, _tag_name(lv.page.photometric))
        except BaseException:
            self._close_fd()
            self._tif.close()
            raise
        self._init_cache(cache_bytes)

    # Where the file is opened: a reader of a file elsewhere (a remote one) opens it otherwise.
    def _open_tiff(self) -> tifffile.TiffFile:
        return open_tifffile(self.path)

    def _file_size(self) -> int:
        return os.path.getsize(self.path)

    def _open_fd(self) -> int:
        return os.open(self.path, os.O_RDONLY)

    def _close_fd(self) -> None:
        os.close(self._fd)

    # -- opening ------------------------------------------------------------
    def _init_levels(self) -> None:
        tif = self._tif
        try:
            pyramid = tiff_pyramid(tif)
        except ValueError as exc:
            raise SlideOpenError(self.path, str(exc)) from exc
        file_size = self._file_size()
        levels = [self._level(page, file_size) for page in pyramid.levels]
        self._levels = levels
        self._set_level_geometry()
        self._vendor = pyramid.vendor
        self._associated = pyramid.associated
        self.level_notes = tuple(pyramid.notes)
        compression = levels[0].page.compression
        props = {"tiff.compression": str(getattr(compression, "name", compression))}
        if levels[0].page.description:
            props["tiff.ImageDescription"] = levels[0].page.description[:4096]
        if pyramid.vendor == "aperio":
            props.update((f"aperio.{k}", str(v)) for k, v in _aperio_fields(levels[0].page.description).items())
        self._properties = props
        self._mpp = self._find_mpp(levels[0].page)

    @property
    def associated_image_names(self) -> tuple[str, ...]:
        """The names of the associated images (``"thumbnail"``, ``"label"``, ``"macro"``), as OpenSlide names them."""
        return tuple(self._associated)

    def _level(self, page: tifffile.TiffPage, file_size: int) -> _Level:
        """A pyramid level from its TIFF page, once its geometry and tile table are checked."""

        def bad(reason: str) -> SlideOpenError:
            return SlideOpenError(self.path, f"page {page_name(page)}: {reason}")

        check_tag_types(self.path, page)
        refuse_cmyk(self.path, page, "tifffile")
        if not page.is_tiled:
            raise bad("TIFF is not tiled (expected a tiled TIFF for the tile reader)")
        if page.dtype != np.uint8:
            raise bad(f"expected 8-bit samples, found {page.dtype} ({page.bitspersample} bits per sample)")
        spp = page.samplesperpixel
        if spp not in (1, 3, 4) or page.planarconfig != 1 and spp > 1:
            raise bad(f"expected 1, 3 or 4 interleaved samples per pixel, found {spp}")
        if page.imagedepth != 1 or page.tiledepth != 1:
            raise bad("volumetric (depth > 1) TIFF is not supported")
        if page.compression not in tifffile.TIFF.DECOMPRESSORS:
            raise bad(
                f"compression {int(page.compression)} is not one this reader decodes (expected JPEG, "
                "deflate, LZW, JPEG 2000, or another codec tifffile knows)"
            )
        check_page_data(self.path, page, file_size)
        width, height, tw, th = page.imagewidth, page.imagelength, page.tilewidth, page.tilelength
        across, down = math.ceil(width / tw), math.ceil(height / th)
        offsets, counts = page.dataoffsets, page.databytecounts
        # An empty tile's offset is never read (and may be any 64-bit value).
        offsets = np.array([o if c else 0 for o, c in zip(offsets, counts, strict=False)], np.int64)
        return _Level(page, width, height, tw, th, across, down, offsets, np.asarray(counts, np.int64), page.jpegtables)

    def stored_tiles_present(self, level: int) -> np.ndarray | None:
        """Which tiles of ``level`` hold data (``tiles_down x tiles_across``), where some are empty
        (TileByteCounts 0: background, as OpenSlide reads them); None where every tile holds data."""
        lv = self._levels[level]
        has = lv.bytecounts[: lv.tiles_down * lv.tiles_across] > 0
        return None if has.all() else has.reshape(lv.tiles_down, lv.tiles_across)

    def _find_mpp(self, page: tifffile.TiffPage) -> tuple[float, float] | None:
        if self._tif.is_ome:
            try:
                ome = read_ome_pixels(self._tif.ome_metadata or "")
                try:
                    size = ome.physical_size_um()
                except ValueError:
                    return checked_mpp(self.path, *ome.physical_size)  # warns: unreadable
                if size is not None:
                    return checked_mpp(self.path, *size)
            except ValueError:  # unreadable OME-XML: the TIFF tags may still say
                pass
        if self._vendor == "aperio":
            # Aperio keeps the pixel size in its ImageDescription ("MPP = 0.2499"), as OpenSlide reads it.
            mpp_svs = aperio_mpp(self.path, page.description)
            return checked_mpp(self.path, mpp_svs, mpp_svs) if mpp_svs is not None else None
        mpp = tiff_page_mpp(page)
        return checked_mpp(self.path, *mpp) if mpp else None

    # -- stored tiles -------------------------------------------------------
    def stored_tile_format(self, level: int) -> dict[str, Any]:
        """How ``level``'s tiles are stored: compression, photometric, samples per pixel, planar config."""
        page = self._levels[level].page
        return {
            "compression": _tag_name(page.compression),
            "photometric": _tag_name(page.photometric),
            "samples_per_pixel": int(page.samplesperpixel),
            "planar": int(page.planarconfig),
            "extra_samples": len(page.extrasamples or ()),
            "jpeg_kind": None if self._levels[level].jpeg_kind is None else self._levels[level].jpeg_kind.name,
            "jpeg_baseline": None if self._levels[level].jpeg_kind is None else self._levels[level].jpeg_kind.baseline,
        }

    def _level_fd(self, level: int) -> int:
        return self._fd

    def _jpeg_level(self, level: int) -> _Level:
        """``level``'s record, or SlideError where its tiles are not JPEG."""
        lv = self._levels[level]
        if lv.page.compression != tifffile.COMPRESSION.JPEG:
            raise SlideError(self.path, f"level {level} is {_tag_name(lv.page.compression)}, not JPEG")
        return lv

    def _direct_decoder(self, lv: _Level) -> str | None:
        """How ``lv``'s stored tiles are decoded without tifffile's per-tile wrapper: "simplejpeg"
        (libjpeg-turbo, told the Photometric tag's colour space, damaged tiles reported) for 8-bit,
        3-sample interleaved JPEG tagged RGB or YCbCr (the tiles OpenSlide also decodes straight
        with libjpeg), else None (``page.decode``)."""
        page = lv.page
        if (
            page.compression == tifffile.COMPRESSION.JPEG
            and page.samplesperpixel == 3
            and page.planarconfig == 1
            and not page.extrasamples
            and page.bitspersample == 8
            and page.photometric in (tifffile.PHOTOMETRIC.RGB, tifffile.PHOTOMETRIC.YCBCR)
        ):
            return "simplejpeg"
        return None

    def _stored_colour(self, level: int) -> str | None:
        page = self._levels[level].page
        if self._levels[level].decoder != "simplejpeg":
            return None
        return "ycbcr" if page.photometric == tifffile.PHOTOMETRIC.YCBCR else "rgb"

    def _decode_tile(self, level: int, tx: int, ty: int, out: np.ndarray | None = None) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded: ``tile_h x tile_w x 3`` uint8 RGB.

        Written into ``out`` (that shape) when given, else into a new array.
        """
        lv = self._levels[level]
        shape = (lv.tile_h, lv.tile_w, 3)
        if out is None:
            out = np.empty(shape, np.uint8)
        i = ty * lv.tiles_across + tx
        data = self.raw_tile(level, tx, ty)
        if not data:
            fill_rgb(out, self.background_rgb)
            return out
        if lv.decoder == "simplejpeg":
            return self._decode_jpeg_checked(level, tx, ty, data, out)
        try:
            seg, _, _ = lv.page.decode(data, i, jpegtables=lv.jpegtables)
        except TileReadError:
            raise
        except Exception as exc:  # codecs raise their own error types
            raise self._tile_error(level, tx, ty, f"cannot decode stored tile ({tx}, {ty}): {exc}") from exc
        if seg is None:
            raise self._tile_error(level, tx, ty, f"stored tile ({tx}, {ty}) decoded to nothing")
        spp = lv.page.samplesperpixel
        if seg.size != lv.tile_h * lv.tile_w * spp:
            raise self._tile_error(
                level,
                tx,
                ty,
                f"stored tile ({tx}, {ty}) decoded to shape {seg.shape}, expected {lv.tile_h}x{lv.tile_w}x{spp}",
            )
        seg = seg.reshape(lv.tile_h, lv.tile_w, spp)
        if spp == 1:
            seg = np.repeat(seg, 3, axis=2)
        elif spp == 4:
            seg = composite_rgba(seg, self.background_rgb)
        elif lv.page.compression == APERIO_JP2000_YCBCR:
            # Aperio's YCbCr JPEG 2000 holds Y, Cb, Cr planes without the codestream's colour
            # transform; tifffile returns them as they are, OpenSlide converts them (JFIF's full range).
            cv2.cvtColor(seg[..., [0, 2, 1]], cv2.COLOR_YCrCb2RGB, dst=out)
            return out
        out[...] = seg
        return out

    def close(self) -> None:
        if not self._closed:
            self._tif.close()
            self._close_fd()
            self._cache.clear()
        super().close()
