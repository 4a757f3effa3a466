"""Readers of stored tiles: the decoded-tile cache and region assembly they share.

A stored-tile reader (the tiled-TIFF and the DICOM readers) keeps, for
each level, its stored tiles' geometry and the file offsets and byte counts
of their compressed data. Every stored tile a patch touches is read with
``os.pread`` (no shared file position, so worker threads need no lock
around I/O), decoded once into a slot of a bounded LRU cache, and copied
from there into the patch; only the part of a patch outside the level is
filled with the background. The overlapping patches of a grid (512 px on a
448 px step over 256 px stored tiles: about 3.3 decodes a patch for the 4
to 9 stored tiles it touches) reuse decoded tiles, and the cache's memory is
reused as tiles are evicted.
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import SlideError, SlideOpenError
from .base import decodes_in_this_thread
from .stored_jpeg import StoredJpegTiles

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# With the default size the cache holds at most the stored-tile rows of a band
# this many level pixels tall across the widest level (plus one row): all that
# a grid read in row order reuses (a patch row and the next one's overlap).
CACHE_BAND_PX = 1536
# Upper bound of what :meth:`TiffSlide.reserve_cache_band` may set.
MAX_RESERVED_CACHE_BYTES = 1024 * 1024 * 1024
# Decoded tiles a cache holds at most, whatever their size: a slot costs about 200 bytes of Python
# objects besides its pixels, which for tiles of a few pixels (a hostile file of 1 x 1 px tiles)
# would be most of the memory. 65,536 slots of 256 px tiles are 12 GiB, far past the byte bound.
MAX_CACHED_TILES = 65536


def fill_rgb(region: np.ndarray, rgb: tuple[int, int, int]) -> None:
    """Set every pixel of ``region`` (``... x 3`` uint8) to ``rgb``.

    A grey background is one byte fill; a coloured one a fill per channel.
    NumPy's broadcast of a 3-vector over a large image is far slower.
    """
    if rgb[0] == rgb[1] == rgb[2]:
        region.fill(rgb[0])
    else:
        for c in range(3):
            region[..., c] = rgb[c]


# Decoded tiles live in slots carved from slabs of about this many bytes,
# allocated as the cache grows and reused as tiles are evicted (never freed
# while the slide is open): a decode costs no allocation and, once the cache
# is warm, no page faults. A new array per decode took about 48 faults per
# 256 px tile, which on the development VM cost up to a third of a cold run.
_SLAB_BYTES = 8 * 1024 * 1024


class TileCacheInfo(NamedTuple):
    """A stored-tile reader's decoded-tile cache (:meth:`StoredTileSlide.cache_info`), as
    :func:`functools.lru_cache`'s ``cache_info`` tells of its cache.

    ``hits``: stored tiles read from the cache; ``misses``: stored tiles decoded into it (both since
    the slide was opened); ``tiles``: the tiles it holds; ``limit_bytes``: its bound;
    ``allocated_bytes``: the memory of its slots (over the bound by at most a slot per thread
    decoding at once); ``pinned``: tiles being copied from; ``decoding``: tiles being decoded.
    """

    hits: int
    misses: int
    tiles: int
    limit_bytes: int
    allocated_bytes: int
    pinned: int
    decoding: int


class TileCache:
    """Bounded LRU of decoded stored tiles whose memory is reused, not freed.

    Tiles are ``tile_h x tile_w x 3`` uint8 views into slabs allocated as
    the cache grows, up to ``limit`` bytes and :data:`MAX_CACHED_TILES`
    slots (``max_tiles``; each slot is a Python object and a dictionary
    entry, far more than the pixels of a tiny tile); past either the least
    recently used tile not being read gives up its slot to the next decode. A reader
    holds a *pin* on a tile while it copies from it (:meth:`get` pins,
    :meth:`unpin` releases), and a pinned tile is never evicted, so no slot
    is overwritten while a thread copies from it. With every cached tile
    pinned, a decode gets a slot over the bound (at most one per thread
    reading), given up again when evicted. Methods without "lock held by
    the caller" take the cache's lock; none decodes.
    """

    def __init__(self, limit: int, max_tiles: int | None = None):
        self.limit = int(limit)
        self.max_tiles = MAX_CACHED_TILES if max_tiles is None else int(max_tiles)
        self.slots = 0  # slots handed out (cached, free or being decoded into)
        self.lock = threading.Lock()
        self._tiles: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._pins: dict[tuple[int, int], int] = {}
        self._free: dict[tuple[int, int], list[np.ndarray]] = {}
        self.allocated = 0  # bytes of slabs and slots handed out
        self.inflight: dict[tuple[int, int], threading.Event] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        """The tile cached under ``key``, pinned; None if absent. Lock held by the caller."""
        tile = self._tiles.get(key)
        if tile is not None:
            self._tiles.move_to_end(key)
            self._pins[key] = self._pins.get(key, 0) + 1
            self.hits += 1
        return tile

    def unpin(self, key: tuple[int, int]) -> None:
        """Release one pin on ``key`` (taken by :meth:`get` or :meth:`put`)."""
        with self.lock:
            n = self._pins[key] - 1
            if n:
                self._pins[key] = n
            else:
                del self._pins[key]

    def slot(self, shape: tuple[int, int]) -> np.ndarray:
        """A writable ``shape + (3,)`` uint8 slot for a tile about to be decoded."""
        with self.lock:
            free = self._free.setdefault(shape, [])
            if not free:
                self._refill(shape, free)
            return free.pop()

    def _refill(self, shape: tuple[int, int], free: list[np.ndarray]) -> None:
        tile_bytes = shape[0] * shape[1] * 3
        room = min(self.limit - self.allocated, (self.max_tiles - self.slots) * tile_bytes)
        if room >= tile_bytes:
            n = max(1, min(-(-_SLAB_BYTES // tile_bytes), room // tile_bytes))
            slab = np.empty((n, shape[0], shape[1], 3), np.uint8)
            self.allocated += slab.nbytes
            self.slots += n
            free.extend(slab[i] for i in range(n - 1, -1, -1))
            return
        pins = self._pins
        while True:
            # The least recently used tile that no reader holds (almost always the first).
            key = next((k for k in self._tiles if k not in pins), None)
            if key is None:
                break
            tile = self._tiles.pop(key)
            if tile.base is None and (self.allocated > self.limit or self.slots > self.max_tiles):
                self.allocated -= tile.nbytes  # a slot from over the bound: let it go
                self.slots -= 1
                continue
            self._free.setdefault(tile.shape[:2], []).append(tile)
            if free:
                return
        # Everything cached is pinned or of another shape: go over the bound by one slot
        # (at most one per thread decoding at once).
        free.append(np.empty((shape[0], shape[1], 3), np.uint8))
        self.allocated += tile_bytes
        self.slots += 1

    def give_back(self, tile: np.ndarray) -> None:
        """Return a slot that was not :meth:`put` (its decode failed)."""
        with self.lock:
            self._free.setdefault(tile.shape[:2], []).append(tile)

    def put(self, key: tuple[int, int], tile: np.ndarray) -> None:
        """Cache ``tile`` (a slot from :meth:`slot`) under ``key``, pinned. Lock held by the caller."""
        self._tiles[key] = tile
        self._pins[key] = self._pins.get(key, 0) + 1

    def info(self) -> TileCacheInfo:
        """Its counters and size now (:class:`TileCacheInfo`)."""
        with self.lock:
            return TileCacheInfo(
                self.hits,
                self.misses,
                len(self._tiles),
                self.limit,
                self.allocated,
                len(self._pins),
                len(self.inflight),
            )

    def clear(self) -> None:
        with self.lock:
            self._tiles.clear()
            self._pins.clear()
            self._free.clear()
            self.allocated = 0
            self.slots = 0


# A region of at least this many stored tiles has them decoded by the region threads.
PARALLEL_REGION_TILES = 16
_REGION_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_REGION_POOL_LOCK = threading.Lock()


def _region_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads that decode the stored tiles of large regions (made on first use, and
    again in a forked child, which has none of its parent's threads)."""
    global _REGION_POOL
    with _REGION_POOL_LOCK:
        if _REGION_POOL is None or _REGION_POOL[0] != os.getpid():
            pool = concurrent.futures.ThreadPoolExecutor(
                min(8, os.cpu_count() or 1), thread_name_prefix="region-decode"
            )
            _REGION_POOL = (os.getpid(), pool)
        return _REGION_POOL[1]


class StoredTileSlide(StoredJpegTiles):
    """A slide read stored tile by stored tile through a bounded decoded-tile cache.

    Subclasses set ``_levels``: per level an object with ``width``,
    ``height``, ``tile_w``, ``tile_h``, ``tiles_across``, ``tiles_down``,
    ``offsets`` and ``bytecounts`` (int64 arrays indexed ``ty *
    tiles_across + tx``, count 0 for a tile without data) and
    ``jpegtables`` (JPEG tables shared by the level's tiles, or None); call
    :meth:`_init_cache`; and implement :meth:`_level_fd` (the open file a
    level's tiles are in), :meth:`_jpeg_level` and :meth:`_decode_tile`.
    """

    _levels: Sequence[Any]

    def _set_level_geometry(self, names: Sequence[str] | None = None) -> None:
        """Check that no level of ``_levels`` is larger than level 0, then set the level dimensions
        and downsamples (OpenSlide's rule: the mean of the two axes' ratios). ``names``: how each
        level is named in the error (default: its number)."""
        levels = self._levels
        w0, h0 = levels[0].width, levels[0].height
        for i, lv in enumerate(levels[1:], 1):
            if lv.width > w0 or lv.height > h0:
                name = f"level {i}" if names is None else names[i]
                raise SlideOpenError(
                    self.path,
                    f"pyramid {name} is {lv.width}x{lv.height}, larger than level 0 ({w0}x{h0}); "
                    "expected each level no larger than level 0",
                )
        self._level_dimensions = [(lv.width, lv.height) for lv in levels]
        self._level_downsamples = [((w0 / lv.width) + (h0 / lv.height)) / 2 for lv in levels]

    def _init_cache(self, cache_bytes: int | None) -> None:
        """The decoded-tile cache: ``cache_bytes``, or by default the smaller of
        :data:`DEFAULT_CACHE_BYTES` and a band :data:`CACHE_BAND_PX` tall across the widest level."""
        if cache_bytes is None:
            band = max(
                (-(-CACHE_BAND_PX // lv.tile_h) + 1) * lv.tiles_across * lv.tile_h * lv.tile_w * 3
                for lv in self._levels
            )
            cache_bytes = min(DEFAULT_CACHE_BYTES, band)
        self._cache = TileCache(cache_bytes)

    @abc.abstractmethod
    def _level_fd(self, level: int) -> int:
        """The open file descriptor holding ``level``'s stored tiles."""

    @abc.abstractmethod
    def _jpeg_level(self, level: int) -> Any:
        """``level``'s record, or SlideError where its tiles are not JPEG."""

    @abc.abstractmethod
    def _decode_tile(self, level: int, tx: int, ty: int, out: np.ndarray | None = None) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded into ``out``: ``tile_h x tile_w x 3`` uint8 RGB."""

    def clear_cache(self) -> None:
        """Free the decoded tiles (e.g. once a grid read is over); reads after it decode again."""
        self._cache.clear()

    def decoded_tile_count(self) -> int:
        """How many stored tiles this reader has decoded since it was opened (whole or reduced)."""
        return self._cache.info().misses

    def cache_info(self) -> TileCacheInfo:
        """The decoded-tile cache's counters and size now (:class:`TileCacheInfo`)."""
        return self._cache.info()

    def reserve_cache_band(self, level: int, height_px: int) -> int:
        """Let the cache hold a band ``height_px`` pixels tall across ``level`` (at most 1 GiB).

        A reader with many patches in flight (a loader with many workers)
        spans more grid rows than the default band; with a band too small
        for them, stored tiles would be decoded twice. The cache only grows
        here, never shrinks; returns its limit in bytes.
        """
        lv = self._levels[level]
        band = (-(-int(height_px) // lv.tile_h) + 1) * lv.tiles_across * lv.tile_h * lv.tile_w * 3
        with self._cache.lock:
            self._cache.limit = max(self._cache.limit, min(MAX_RESERVED_CACHE_BYTES, band))
            return self._cache.limit

    def tile_grid_shape(self, level: int) -> tuple[int, int, int, int]:
        """(tile_width, tile_height, tiles_across, tiles_down) of a level's stored tiles."""
        lv = self._levels[level]
        return lv.tile_w, lv.tile_h, lv.tiles_across, lv.tiles_down

    def raw_tile(self, level: int, tx: int, ty: int) -> bytes:
        """The stored, still compressed bytes of tile (tx, ty) of ``level``."""
        lv = self._levels[level]
        i = ty * lv.tiles_across + tx
        n = int(lv.bytecounts[i])
        return self._pread(level, n, int(lv.offsets[i])) if n else b""

    def decode_stored_tile(self, level: int, tx: int, ty: int, out: np.ndarray) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded into ``out`` (``tile_h x tile_w x 3`` uint8 RGB)
        as :meth:`read_region` decodes it, without the cache (a tile without data: background)."""
        lv = self._levels[level]
        if not (0 <= tx < lv.tiles_across and 0 <= ty < lv.tiles_down):
            raise SlideError(self.path, f"level {level} has no stored tile ({tx}, {ty})")
        self._check_out((lv.tile_w, lv.tile_h), out)
        return self._decode_tile(level, tx, ty, out)

    def _tile_origin_level0(self, level: int, tx: int, ty: int) -> tuple[int, int]:
        lv, ds = self._levels[level], self._level_downsamples[level]
        return int(tx * lv.tile_w * ds), int(ty * lv.tile_h * ds)

    def _get_tile(self, level: int, tx: int, ty: int, scale: int = 1) -> tuple[tuple[int, ...], np.ndarray]:
        """(key, decoded stored tile, at 1/``scale`` of its size), pinned in the cache: unpin the key
        once copied from.

        A tile absent from the cache is decoded once whatever the number of
        threads asking; the others wait for it.
        """
        idx = ty * self._levels[level].tiles_across + tx
        key = (level, idx) if scale == 1 else (level, idx, scale)
        cache = self._cache
        while True:
            with cache.lock:
                tile = cache.get(key)
                if tile is not None:
                    return key, tile
                event = cache.inflight.get(key)
                if event is None:
                    event = threading.Event()
                    cache.inflight[key] = event
                    cache.misses += 1
                    break
            # Another thread is decoding this tile: wait and use its result.
            event.wait()
        try:
            lv = self._levels[level]
            slot = cache.slot((lv.tile_h // scale, lv.tile_w // scale))
            try:
                tile = (
                    self._decode_tile(level, tx, ty, slot) if scale == 1 else self._decode_reduced(level, tx, ty, slot)
                )
            except BaseException:
                cache.give_back(slot)
                raise
            with cache.lock:
                cache.put(key, slot)
        finally:
            with cache.lock:
                cache.inflight.pop(key, None)
            event.set()
        return key, slot

    # -- regions ------------------------------------------------------------
    def read_region_into(
        self, location: tuple[int, int], level: int, size: tuple[int, int], out: np.ndarray
    ) -> np.ndarray:
        """:meth:`read_region` written into ``out`` (``height x width x 3`` uint8), returned.

        Saves the copy from a new array when the caller has a buffer (a
        batch slot of the tile loader).
        """
        self._check_region(level, size)
        self._check_out(size, out)
        x0, y0 = int(location[0]), int(location[1])
        with self._reading((x0, y0), level):
            self._assemble(x0, y0, level, out)
        return out

    def reduced_scales(self, level: int) -> tuple[int, ...]:
        """The factors ``k`` by which ``level`` can be read reduced while its JPEG tiles decode
        (libjpeg-turbo's DCT scaling: each side at 1/2, 1/4 or 1/8, for tiles ``k`` divides); ()
        where its tiles are not JPEG the reader decodes itself."""
        lv = self._levels[level]
        if self._stored_colour(level) is None:
            return ()
        return tuple(k for k in (2, 4, 8) if lv.tile_w % k == 0 and lv.tile_h % k == 0)

    def read_region_reduced(
        self, location: tuple[int, int], level: int, scale: int, size: tuple[int, int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """A ``size`` region of ``level`` at 1/``scale`` of its resolution (one pixel for each
        ``scale x scale`` block of the level, ``scale`` one of :meth:`reduced_scales`), at level-0
        ``location``: each stored tile decoded reduced in the DCT domain, not decoded whole and
        shrunk. Close to, not equal to, ``cv2.INTER_AREA`` of the full-size pixels
        (benchmarks/HISTORY.md gives the difference). Past the level: background."""
        if scale not in self.reduced_scales(level):
            raise SlideError(self.path, f"level {level} cannot be read at 1/{scale}: {self.reduced_scales(level)}")
        self._check_region(level, size)
        if out is None:
            out = np.empty((int(size[1]), int(size[0]), 3), np.uint8)
        self._check_out(size, out)
        x0, y0 = int(location[0]), int(location[1])
        with self._reading((x0, y0), level):
            self._assemble(x0, y0, level, out, scale)
        return out

    def _decode_reduced(self, level: int, tx: int, ty: int, out: np.ndarray) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded at ``out``'s size (1/k of the tile's)."""
        data = self.raw_tile(level, tx, ty)
        if not data:
            fill_rgb(out, self.background_rgb)
            return out
        return self._decode_jpeg_checked(level, tx, ty, data, out)

    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        out = np.empty((h, w, 3), np.uint8)
        self._assemble(x0_level0, y0_level0, level, out)
        return out

    def _assemble(self, x0_level0: int, y0_level0: int, level: int, out: np.ndarray, scale: int = 1) -> None:
        """Fill ``out`` (``h x w x 3``) with the region of ``level`` at level-0 (x0, y0), the level
        read at 1/``scale`` (:meth:`read_region_reduced`).

        Each stored tile the region touches is copied once from the decoded-tile
        cache; only the part outside the level is filled with the background.
        """
        h, w = out.shape[:2]
        lv = self._levels[level]
        ds = self._level_downsamples[level] * scale
        # Level-0 location to this level's pixels, as OpenSlide does.
        x0 = int(math.floor(x0_level0 / ds))
        y0 = int(math.floor(y0_level0 / ds))
        ix0, iy0 = max(x0, 0), max(y0, 0)
        ix1, iy1 = min(x0 + w, -(-lv.width // scale)), min(y0 + h, -(-lv.height // scale))
        if ix0 >= ix1 or iy0 >= iy1:
            fill_rgb(out, self.background_rgb)
            return
        # Background only where the region leaves the level: bands above, below, left, right.
        bg = self.background_rgb
        if iy0 > y0:
            fill_rgb(out[: iy0 - y0], bg)
        if iy1 < y0 + h:
            fill_rgb(out[iy1 - y0 :], bg)
        if ix0 > x0:
            fill_rgb(out[iy0 - y0 : iy1 - y0, : ix0 - x0], bg)
        if ix1 < x0 + w:
            fill_rgb(out[iy0 - y0 : iy1 - y0, ix1 - x0 :], bg)
        tw, th = lv.tile_w // scale, lv.tile_h // scale
        cache = self._cache

        def copy_tile(tx: int, ty: int) -> None:
            ty0, tx0 = ty * th, tx * tw
            sy0, sy1 = max(iy0, ty0), min(iy1, ty0 + th)
            sx0, sx1 = max(ix0, tx0), min(ix1, tx0 + tw)
            key, tile = self._get_tile(level, tx, ty, scale)
            try:
                out[sy0 - y0 : sy1 - y0, sx0 - x0 : sx1 - x0] = tile[sy0 - ty0 : sy1 - ty0, sx0 - tx0 : sx1 - tx0]
            finally:
                cache.unpin(key)

        tiles = [
            (tx, ty) for ty in range(iy0 // th, (iy1 - 1) // th + 1) for tx in range(ix0 // tw, (ix1 - 1) // tw + 1)
        ]
        if len(tiles) < PARALLEL_REGION_TILES or decodes_in_this_thread():
            for tx, ty in tiles:
                copy_tile(tx, ty)
            return
        # A large region (a thumbnail's level, say): its tiles decoded by several threads (the
        # decoders release the interpreter lock), each copying into its own part of ``out``.
        pool = _region_pool()
        futures = [pool.submit(copy_tile, tx, ty) for tx, ty in tiles]
        concurrent.futures.wait(futures)  # every copy ended before ``out`` goes back to the caller
        for fut in futures:
            fut.result()
