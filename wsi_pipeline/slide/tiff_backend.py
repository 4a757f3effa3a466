"""Tiled TIFF, BigTIFF and OME-TIFF read stored tile by stored tile with tifffile.

This is the fast path for tile grids: every stored tile a patch touches is
read with ``os.pread`` (no shared file position, so worker threads need no
lock around I/O), decoded once with the page's own codec (imagecodecs) and
kept in a bounded LRU cache, so the overlapping patches of a grid reuse
decoded tiles instead of decoding them again. OpenSlide's ``read_region``
has no such cache across calls for this use, which is why this backend
exists beside it.

Pyramids are found as tifffile's series levels: successive reduced pages
(generic pyramidal TIFF) or SubIFDs (OME-TIFF).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import imagecodecs
import numpy as np
import tifffile

from ..errors import SlideError, TileReadError
from .base import Slide, checked_mpp
from .resolution import tiff_page_mpp

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


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
    jpeg_args: dict | None = None


def _fill(region: np.ndarray, rgb: tuple[int, int, int]) -> None:
    """Set every pixel of ``region`` (``... x 3`` uint8) to ``rgb``.

    A grey background is one byte fill; a coloured one a fill per channel.
    NumPy's broadcast of a 3-vector over a large image is far slower.
    """
    if rgb[0] == rgb[1] == rgb[2]:
        region.fill(rgb[0])
    else:
        for c in range(3):
            region[..., c] = rgb[c]


class TiffSlide(Slide):
    """A tiled TIFF opened with :mod:`tifffile`.

    ``cache_bytes`` bounds the decoded-tile cache shared by all threads
    reading this slide.
    """

    backend = "tifffile"

    def __init__(self, path: str | os.PathLike[str], cache_bytes: int = DEFAULT_CACHE_BYTES):
        super().__init__(path)
        try:
            self._tif = tifffile.TiffFile(self.path)
        except (tifffile.TiffFileError, ValueError, OSError) as exc:
            raise SlideError(self.path, f"not a readable TIFF: {exc}") from exc
        try:
            self._init_levels()
        except Exception:
            self._tif.close()
            raise
        self._fd = os.open(self.path, os.O_RDONLY)
        for lv in self._levels:
            lv.jpeg_args = self._direct_jpeg_args(lv)
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = int(cache_bytes)
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int], threading.Event] = {}

    # -- opening ------------------------------------------------------------
    def _init_levels(self) -> None:
        tif = self._tif
        if not tif.series:
            raise SlideError(self.path, "TIFF holds no image")
        series = tif.series[0]
        pages = [lvl.keyframe for lvl in series.levels] if series.levels else [series.keyframe]
        file_size = os.path.getsize(self.path)
        levels: list[_Level] = []
        for page in pages:
            if not page.is_tiled:
                raise SlideError(self.path, "TIFF is not tiled (expected a tiled TIFF for the tile reader)")
            if page.dtype != np.uint8:
                raise SlideError(self.path, f"expected 8-bit samples, found {page.dtype}")
            spp = page.samplesperpixel
            if spp not in (1, 3, 4) or page.planarconfig != 1 and spp > 1:
                raise SlideError(
                    self.path, f"expected 1, 3 or 4 interleaved samples per pixel, found {spp}"
                )
            if page.imagedepth != 1:
                raise SlideError(self.path, "volumetric (tile depth > 1) TIFF is not supported")
            offsets = np.asarray(page.dataoffsets, np.int64)
            counts = np.asarray(page.databytecounts, np.int64)
            th, tw = page.tilelength, page.tilewidth
            across = math.ceil(page.imagewidth / tw)
            down = math.ceil(page.imagelength / th)
            if len(offsets) < across * down:
                raise SlideError(
                    self.path,
                    f"tile table lists {len(offsets)} tiles, expected {across * down} for "
                    f"{page.imagewidth}x{page.imagelength} in {tw}x{th} tiles",
                )
            end = int((offsets + counts).max()) if len(offsets) else 0
            if end > file_size:
                raise SlideError(
                    self.path,
                    f"file is truncated or claims an impossible size: tile data reaches byte {end} "
                    f"but the file has {file_size} bytes ({page.imagewidth}x{page.imagelength} claimed)",
                )
            levels.append(
                _Level(page, page.imagewidth, page.imagelength, tw, th, across, down,
                       offsets, counts, page.jpegtables)
            )
        self._levels = levels
        w0, h0 = levels[0].width, levels[0].height
        self._level_dimensions = [(lv.width, lv.height) for lv in levels]
        # OpenSlide's rule: the mean of the two axes' ratios.
        self._level_downsamples = [((w0 / lv.width) + (h0 / lv.height)) / 2 for lv in levels]
        self._vendor = "ome-tiff" if tif.is_ome else ("bigtiff" if tif.is_bigtiff else "tiff")
        props = {"tiff.compression": str(levels[0].page.compression.name)}
        if levels[0].page.description:
            props["tiff.ImageDescription"] = levels[0].page.description[:4096]
        self._properties = props
        self._mpp = self._find_mpp(levels[0].page)

    def _find_mpp(self, page: tifffile.TiffPage) -> tuple[float, float] | None:
        if self._tif.is_ome:
            import xml.etree.ElementTree as ET

            try:
                root = ET.fromstring(self._tif.ome_metadata or "")
                for el in root.iter():
                    if el.tag.endswith("Pixels"):
                        px, py = el.get("PhysicalSizeX"), el.get("PhysicalSizeY")
                        unit = el.get("PhysicalSizeXUnit", "µm")
                        if px and py:
                            scale = {"µm": 1.0, "um": 1.0, "nm": 1e-3, "mm": 1e3}.get(unit)
                            if scale is not None:
                                return checked_mpp(self.path, float(px) * scale, float(py) * scale)
                        break
            except ET.ParseError:
                pass
        mpp = tiff_page_mpp(page)
        return checked_mpp(self.path, *mpp) if mpp else None

    # -- stored tiles -------------------------------------------------------
    def tile_grid_shape(self, level: int) -> tuple[int, int, int, int]:
        """(tile_width, tile_height, tiles_across, tiles_down) of a level's stored tiles."""
        lv = self._levels[level]
        return lv.tile_w, lv.tile_h, lv.tiles_across, lv.tiles_down

    @property
    def jpeg_tables(self) -> bytes | None:
        """Level 0's shared JPEGTables (quantisation and Huffman tables), if any."""
        return self._levels[0].jpegtables

    def raw_tile(self, level: int, tx: int, ty: int) -> bytes:
        """The stored, still compressed bytes of tile (tx, ty) of ``level``."""
        lv = self._levels[level]
        i = ty * lv.tiles_across + tx
        n = int(lv.bytecounts[i])
        return os.pread(self._fd, n, int(lv.offsets[i])) if n else b""

    def raw_tile_jpeg(self, level: int, tx: int, ty: int) -> bytes:
        """Tile (tx, ty) as a self-contained JPEG stream (JPEGTables spliced in).

        TIFF JPEG tiles usually share their tables in the JPEGTables tag;
        a standalone decoder (such as a GPU one) needs them inside the stream.
        """
        lv = self._levels[level]
        if lv.page.compression != tifffile.COMPRESSION.JPEG:
            raise SlideError(self.path, f"level {level} is {lv.page.compression.name}, not JPEG")
        data = self.raw_tile(level, tx, ty)
        tables = lv.jpegtables
        if not tables:
            return data
        # tables: SOI ... EOI; tile: SOI ... EOI. Result: SOI + tables body + tile body.
        return data[:2] + tables[2:-2] + data[2:]

    def _direct_jpeg_args(self, lv: _Level) -> dict | None:
        """Keyword arguments that decode ``lv``'s JPEG tiles with imagecodecs directly.

        The direct call skips tifffile's per-tile wrapper (segment bookkeeping,
        reshape and padding). It is used only for 3-sample interleaved JPEG
        levels, and only after the first stored tile decodes to exactly the
        pixels ``page.decode`` gives; otherwise None (use ``page.decode``).
        """
        page = lv.page
        colorspace_for = getattr(tifffile.tifffile, "jpeg_decode_colorspace", None)
        if (
            colorspace_for is None
            or page.compression != tifffile.COMPRESSION.JPEG
            or page.samplesperpixel != 3
            or page.planarconfig != 1
            or page.extrasamples
        ):
            return None
        colorspace, outcolorspace = colorspace_for(
            page.photometric, page.planarconfig, page.extrasamples, page.is_jfif
        )
        kwargs = {"tables": lv.jpegtables, "colorspace": colorspace, "outcolorspace": outcolorspace}
        nonempty = np.flatnonzero(lv.bytecounts)
        if not len(nonempty):
            return None
        i = int(nonempty[0])
        data = os.pread(self._fd, int(lv.bytecounts[i]), int(lv.offsets[i]))
        try:
            direct = imagecodecs.jpeg8_decode(data, **kwargs)
            ref, _, _ = page.decode(data, i, jpegtables=lv.jpegtables)
        except Exception:  # a tile that does not decode: let the general path report it
            return None
        ref = ref.reshape(ref.shape[-3], ref.shape[-2], 3)
        if direct.shape != (lv.tile_h, lv.tile_w, 3) or not np.array_equal(direct, ref):
            return None
        return kwargs

    def _decode_tile(self, level: int, tx: int, ty: int) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded: ``tile_h x tile_w x 3`` uint8 RGB."""
        lv = self._levels[level]
        i = ty * lv.tiles_across + tx
        data = self.raw_tile(level, tx, ty)
        if not data:
            tile = np.empty((lv.tile_h, lv.tile_w, 3), np.uint8)
            _fill(tile, self.background_rgb)
            return tile
        try:
            if lv.jpeg_args is not None:
                seg = imagecodecs.jpeg8_decode(data, **lv.jpeg_args)
                if seg.shape == (lv.tile_h, lv.tile_w, 3):
                    return seg
            seg, _, _ = lv.page.decode(data, i, jpegtables=lv.jpegtables)
        except Exception as exc:  # codecs raise their own error types
            raise TileReadError(
                self.path, f"cannot decode stored tile ({tx}, {ty}): {exc}",
                (int(tx * lv.tile_w * self._level_downsamples[level]),
                 int(ty * lv.tile_h * self._level_downsamples[level])), level,
            ) from exc
        if seg is None:
            raise TileReadError(self.path, f"stored tile ({tx}, {ty}) decoded to nothing", None, level)
        spp = lv.page.samplesperpixel
        seg = seg.reshape(seg.shape[-3], seg.shape[-2], spp)
        if spp == 1:
            seg = np.repeat(seg, 3, axis=2)
        elif spp == 4:
            from .openslide_backend import composite_rgba

            seg = composite_rgba(seg, self.background_rgb)
        return np.ascontiguousarray(seg)

    def _get_tile(self, level: int, tx: int, ty: int) -> np.ndarray:
        """Decoded stored tile from the cache, decoding it (once, whatever the threads) if absent."""
        key = (level, ty * self._levels[level].tiles_across + tx)
        cache = self._cache
        while True:
            with self._lock:
                tile = cache.get(key)
                if tile is not None:
                    cache.move_to_end(key)
                    return tile
                event = self._inflight.get(key)
                if event is None:
                    event = threading.Event()
                    self._inflight[key] = event
                    break
            # Another thread is decoding this tile: wait and use its result.
            event.wait()
        try:
            tile = self._decode_tile(level, tx, ty)
            with self._lock:
                cache[key] = tile
                self._cache_bytes += tile.nbytes
                while self._cache_bytes > self._cache_limit and len(cache) > 1:
                    _, old = cache.popitem(last=False)
                    self._cache_bytes -= old.nbytes
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            event.set()
        return tile

    # -- regions ------------------------------------------------------------
    def read_region_into(
        self, location: tuple[int, int], level: int, size: tuple[int, int], out: np.ndarray
    ) -> np.ndarray:
        """:meth:`read_region` written into ``out`` (``height x width x 3`` uint8), returned.

        Saves the copy from a new array when the caller has a buffer (a
        batch slot of the tile loader).
        """
        self._check_open()
        if not 0 <= level < self.level_count:
            raise ValueError(
                f"{self.path}: level {level} does not exist (slide has {self.level_count} levels)"
            )
        w, h = int(size[0]), int(size[1])
        if w <= 0 or h <= 0:
            raise ValueError(f"{self.path}: region size must be positive, got {size}")
        if out.shape != (h, w, 3) or out.dtype != np.uint8:
            raise ValueError(
                f"{self.path}: output buffer is {out.shape} {out.dtype}, expected ({h}, {w}, 3) uint8"
            )
        self._assemble(int(location[0]), int(location[1]), level, out)
        return out

    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        out = np.empty((h, w, 3), np.uint8)
        self._assemble(x0_level0, y0_level0, level, out)
        return out

    def _assemble(self, x0_level0: int, y0_level0: int, level: int, out: np.ndarray) -> None:
        """Fill ``out`` (``h x w x 3``) with the region of ``level`` at level-0 (x0, y0).

        Each stored tile the region touches is copied once from the decoded-tile
        cache; only the part outside the level is filled with the background.
        """
        h, w = out.shape[:2]
        lv = self._levels[level]
        ds = self._level_downsamples[level]
        # Level-0 location to this level's pixels, as OpenSlide does.
        x0 = int(math.floor(x0_level0 / ds))
        y0 = int(math.floor(y0_level0 / ds))
        ix0, iy0 = max(x0, 0), max(y0, 0)
        ix1, iy1 = min(x0 + w, lv.width), min(y0 + h, lv.height)
        if ix0 >= ix1 or iy0 >= iy1:
            _fill(out, self.background_rgb)
            return
        # Background only where the region leaves the level: bands above, below, left, right.
        bg = self.background_rgb
        if iy0 > y0:
            _fill(out[: iy0 - y0], bg)
        if iy1 < y0 + h:
            _fill(out[iy1 - y0:], bg)
        if ix0 > x0:
            _fill(out[iy0 - y0:iy1 - y0, : ix0 - x0], bg)
        if ix1 < x0 + w:
            _fill(out[iy0 - y0:iy1 - y0, ix1 - x0:], bg)
        tw, th = lv.tile_w, lv.tile_h
        for ty in range(iy0 // th, (iy1 - 1) // th + 1):
            ty0 = ty * th
            sy0, sy1 = max(iy0, ty0), min(iy1, ty0 + th)
            dst_rows = out[sy0 - y0:sy1 - y0]
            for tx in range(ix0 // tw, (ix1 - 1) // tw + 1):
                tx0 = tx * tw
                sx0, sx1 = max(ix0, tx0), min(ix1, tx0 + tw)
                tile = self._get_tile(level, tx, ty)
                dst_rows[:, sx0 - x0:sx1 - x0] = tile[sy0 - ty0:sy1 - ty0, sx0 - tx0:sx1 - tx0]

    def close(self) -> None:
        if not self._closed:
            self._tif.close()
            os.close(self._fd)
            self._cache.clear()
        super().close()
