"""The :class:`Slide` interface every reader backend implements.

Coordinates follow OpenSlide: ``location`` is in level-0 pixels (origin
top-left, x right, y down); ``size`` is in pixels of the level read. Pixels
come back as ``HxWx3 uint8`` RGB, C-contiguous, with any area outside the
slide filled with the slide's background colour.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import cv2
import numpy as np

from .. import slide_warnings
from ..errors import ClosedError, SlideError, TileReadError
from .area import shrink_sparse
from .damage import DamagedTile, DamageLog

# A microscope slide scanned at any objective lies well inside this range;
# values outside it come from placeholder resolution tags (72 or 96 dpi gives
# about 350 or 265 um/px) and would make every physical measurement wrong.
PLAUSIBLE_MPP_RANGE = (0.02, 20.0)

# A thumbnail of a level larger than this (bytes of RGB) is made band by band,
# each band read and shrunk before the next: its memory does not grow with the slide.
THUMBNAIL_BAND_BYTES = 64 * 1024 * 1024


_THIS_THREAD = threading.local()


@contextlib.contextmanager
def decoding_in_this_thread() -> Iterator[None]:
    """Within it, a region this thread reads has its stored tiles decoded by this thread, however
    many (a stored-tile reader otherwise hands a large region's tiles to its region threads).

    For reader threads that already run side by side with a model on the same CPU: every core is
    busy there, and handing tiles over only adds work (benchmarks/HISTORY.md, 2026-12-06 09:2x).
    """
    before = getattr(_THIS_THREAD, "decodes", False)
    _THIS_THREAD.decodes = True
    try:
        yield
    finally:
        _THIS_THREAD.decodes = before


def decodes_in_this_thread() -> bool:
    """Whether the calling thread is inside :func:`decoding_in_this_thread`."""
    return getattr(_THIS_THREAD, "decodes", False)


class Slide(abc.ABC):
    """A multi-resolution image read by one backend.

    Subclasses set ``_level_dimensions`` (list of (width, height)),
    ``_level_downsamples``, ``_mpp``, ``_vendor``, ``_properties`` and
    ``background_rgb``, and implement :meth:`_read_level`.
    """

    backend: str = "abstract"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        # Where the slide is, whatever the working directory later; an array's name stays as it is.
        self.absolute_path = os.path.abspath(self.path) if os.path.exists(self.path) else self.path
        self.background_rgb: tuple[int, int, int] = (255, 255, 255)
        self._level_dimensions: list[tuple[int, int]] = []
        self._level_downsamples: list[float] = []
        self._mpp: tuple[float, float] | None = None
        self._vendor: str | None = None
        self._properties: dict[str, str] = {}
        self._damage = DamageLog(self.path)
        self._closed = False

    # -- metadata -----------------------------------------------------------
    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 (width, height) in pixels."""
        return self._level_dimensions[0]

    @property
    def level_count(self) -> int:
        return len(self._level_dimensions)

    @property
    def level_dimensions(self) -> tuple[tuple[int, int], ...]:
        """(width, height) of each level, level 0 first."""
        return tuple(self._level_dimensions)

    @property
    def level_downsamples(self) -> tuple[float, ...]:
        """Level-0 pixels per pixel of each level (1.0 for level 0)."""
        return tuple(self._level_downsamples)

    @property
    def mpp(self) -> tuple[float, float] | None:
        """Level-0 (x, y) micrometres per pixel, or None where unknown."""
        return self._mpp

    @property
    def vendor(self) -> str | None:
        return self._vendor

    # Where the levels differ from OpenSlide's rule for the format, and why (see .tiff_levels).
    level_notes: tuple[str, ...] = ()
    # Whether grid reads between stored levels decode JPEG tiles reduced (a run's resample = reduced;
    # tiling/grid.read_tile), where the reader can (:meth:`reduced_scales`).
    reduced_decode: bool = False

    def reduced_scales(self, level: int) -> tuple[int, ...]:
        """The factors ``k`` by which ``level`` can be read reduced in its decoder
        (:meth:`read_region_reduced`); none for this reader."""
        return ()

    def read_region_reduced(
        self, location: tuple[int, int], level: int, scale: int, size: tuple[int, int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """A ``size`` region of ``level`` at 1/``scale`` of its resolution, decoded reduced; only for
        a ``scale`` of :meth:`reduced_scales`."""
        raise SlideError(self.path, f"level {level} cannot be read reduced by this reader")

    @property
    def associated_image_names(self) -> tuple[str, ...]:
        """The names of the slide's associated images (``"thumbnail"``, ``"label"``, ``"macro"``, ...),
        as OpenSlide names them; empty where the format has none."""
        return ()

    @property
    def properties(self) -> Mapping[str, str]:
        return dict(self._properties)

    @property
    def on_damaged_tile(self) -> str:
        """What a stored tile decoded with a decoder warning does: "warn" (log and list it) or "fail"."""
        return self._damage.policy

    @on_damaged_tile.setter
    def on_damaged_tile(self, policy: str) -> None:
        self._damage.policy = policy

    @property
    def damaged_tiles(self) -> list[DamagedTile]:
        """The stored tiles read so far that decoded with a decoder warning (see :mod:`.damage`)."""
        return self._damage.tiles()

    def report_damage(self, level: int, col: int, row: int, origin_level0: tuple[int, int], message: str) -> None:
        """Record stored tile (col, row) of ``level`` as decoded with a corrupt-data warning where
        another process decoded it (:class:`~.damage.DamageLog`; raises under the "fail" policy)."""
        self._damage.report(level, col, row, origin_level0, message)

    def damage_summary(self) -> dict:
        """``{"count", "policy", "tiles"}`` of the damaged stored tiles read so far (a run's summary entry)."""
        return self._damage.summary()

    def best_level_for_downsample(self, downsample: float) -> int:
        """The finest-resolution level whose downsample does not exceed ``downsample``.

        As OpenSlide: the largest level index with ``level_downsamples[i] <=
        downsample`` (a small tolerance absorbs rounding of level sizes). A
        level whose shape is not level 0's (:func:`level_shape_agrees`) is
        never picked: its pixels would be read as if they lay where they do not.
        """
        w0, h0 = self._level_dimensions[0]
        best = 0
        for i, d in enumerate(self._level_downsamples):
            w, h = self._level_dimensions[i]
            if d <= downsample * (1 + 1e-6) + 1e-9 and level_shape_agrees(w0, h0, w, h):
                best = i
        return best

    # -- pixels -------------------------------------------------------------
    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """Read a ``size`` = (width, height) region of ``level`` at level-0 ``location``.

        Returns an ``(height, width, 3)`` uint8 RGB array; pixels outside the
        slide are the background colour. A failure to read or decode the
        file is raised as :class:`TileReadError` naming the file and place.

        >>> from wsi_pipeline.slide.image import ImageSlide
        >>> s = ImageSlide.from_array(np.zeros((10, 20, 3), np.uint8))
        >>> s.read_region((15, 5), 0, (10, 10)).shape
        (10, 10, 3)
        """
        w, h = self._check_region(level, size)
        x0, y0 = int(location[0]), int(location[1])
        with self._reading((x0, y0), level):
            return self._read_level(x0, y0, level, w, h)

    def read_region_into(
        self, location: tuple[int, int], level: int, size: tuple[int, int], out: np.ndarray
    ) -> np.ndarray:
        """:meth:`read_region` written into ``out`` (``height x width x 3`` uint8), returned.

        Readers that assemble regions from stored tiles write into ``out``
        directly (no copy from a new array); this default copies.
        """
        self._check_out(size, out)
        out[...] = self.read_region(location, level, size)
        return out

    def _check_out(self, size: tuple[int, int], out: np.ndarray) -> None:
        w, h = int(size[0]), int(size[1])
        if out.shape != (h, w, 3) or out.dtype != np.uint8:
            raise ValueError(f"{self.path}: output buffer is {out.shape} {out.dtype}, expected ({h}, {w}, 3) uint8")

    # -- stored tiles (readers of tiled files override these; GPU decoding needs them) --
    def stored_tile_format(self, level: int) -> dict[str, Any] | None:
        """How ``level``'s tiles are stored (compression, photometric, samples per pixel, planar
        config, extra samples), or None where this reader gives no stored tiles."""
        return None

    def tile_grid_shape(self, level: int) -> tuple[int, int, int, int]:
        """(tile_width, tile_height, tiles_across, tiles_down) of ``level``'s stored tiles."""
        raise SlideError(self.path, f"the {self.backend} reader gives no stored tiles")

    def raw_tile_jpeg(self, level: int, tx: int, ty: int) -> bytes:
        """Stored tile (tx, ty) of ``level`` as a self-contained JPEG stream (empty: no data)."""
        raise SlideError(self.path, f"the {self.backend} reader gives no stored tiles")

    def decode_stored_tile(self, level: int, tx: int, ty: int, out: np.ndarray) -> np.ndarray:
        """Stored tile (tx, ty) of ``level`` decoded into ``out`` (``tile_h x tile_w x 3`` uint8
        RGB) as this reader decodes it for its regions (colour space from the file's tags,
        corrupt data reported; a tile stored empty is the background); returns ``out``."""
        raise SlideError(self.path, f"the {self.backend} reader gives no stored tiles")

    def stored_tiles_present(self, level: int) -> np.ndarray | None:
        """``tiles_down x tiles_across`` bool: which of ``level``'s stored tiles hold data, where
        some hold none (they are background: a TILED_SPARSE DICOM level); None where every tile
        holds data or the reader gives no stored tiles."""
        return None

    def raw_tiles_jpeg(self, level: int, tiles: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`raw_tile_jpeg` of many stored tiles ``(tx, ty)``, back to back.

        Returns one uint8 array holding the streams one after the other and
        their lengths (int64, 0 for a tile without data), in the order given.
        """
        streams = [self.raw_tile_jpeg(level, tx, ty) for tx, ty in tiles]
        lengths = np.fromiter((len(b) for b in streams), np.int64, len(streams))
        return np.frombuffer(bytearray(b"".join(streams)), np.uint8), lengths

    # -- decoded-tile cache (readers that keep one override these) ------------
    def clear_cache(self) -> None:  # noqa: B027  (no cache: nothing to free)
        """Free the decoded pixels this reader holds; reads after it decode again."""

    def reserve_cache_band(self, level: int, height_px: int) -> int:
        """Let the cache hold a band ``height_px`` pixels tall across ``level``; its limit in bytes (0: none)."""
        return 0

    def fetch_ahead(self, level: int, boxes: Sequence[tuple[int, int, int, int]]) -> None:  # noqa: B027
        """A hint: the regions ``boxes`` (``x0, y0, x1, y1`` in ``level``'s pixels) are read soon. A
        reader whose reads wait on a network (a remote slide) starts fetching them; others ignore it."""

    @contextlib.contextmanager
    def _reading(self, location_level0: tuple[int, int], level: int) -> Iterator[None]:
        """The read paths' error boundary: what a reader library raises becomes :class:`TileReadError`."""
        try:
            yield
        except SlideError:
            raise
        except MemoryError as exc:
            raise TileReadError(
                self.path, "reading it needs more memory than is available", location_level0, level
            ) from exc
        except Exception as exc:
            raise TileReadError(
                self.path, f"cannot read it ({type(exc).__name__}: {exc})", location_level0, level
            ) from exc

    def _check_region(self, level: int, size: tuple[int, int]) -> tuple[int, int]:
        """(width, height) of a region request, after checking the slide is open and the level exists."""
        self._check_open()
        if not 0 <= level < self.level_count:
            raise ValueError(f"{self.path}: level {level} does not exist (slide has {self.level_count} levels)")
        w, h = int(size[0]), int(size[1])
        if w <= 0 or h <= 0:
            raise ValueError(f"{self.path}: region size must be positive, got {size}")
        return w, h

    @abc.abstractmethod
    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        """Backend read; same contract as :meth:`read_region`."""

    def get_thumbnail(self, max_size: tuple[int, int] | int, reduced: bool = False) -> np.ndarray:
        """The whole slide, downscaled to fit ``max_size`` (width, height), aspect kept.

        Read from the finest level no finer than needed; a level over
        :data:`THUMBNAIL_BAND_BYTES` is read in bands of rows, each shrunk
        before the next is read. A level stored in part (:meth:`stored_tiles_present`) is made
        from the tiles it stores alone, the others background without a read: a sparse level
        claiming 400,000 px a side costs its stored tiles, not 2,048 bands. With ``reduced``, a
        level at least twice the thumbnail's size whose JPEG tiles decode reduced
        (:meth:`reduced_scales`) is decoded at 1/2, 1/4 or 1/8 in the DCT domain before it is
        shrunk (:func:`thumbnail_source`): close to, not equal to, the full decode shrunk.
        """
        tw, th, level, k = thumbnail_source(self, max_size, reduced)
        lw, lh = self._level_dimensions[level]
        present = self.stored_tiles_present(level)
        if present is not None:
            return _thumbnail_of_stored_tiles(self, level, tw, th, present)
        if k > 1 or lw * lh * 3 > THUMBNAIL_BAND_BYTES:
            return _banded_thumbnail(self, level, tw, th, k)
        region = self.read_region((0, 0), level, (lw, lh))
        if (lw, lh) == (tw, th):
            return region
        return np.ascontiguousarray(cv2.resize(region, (tw, th), interpolation=cv2.INTER_AREA))

    def decoded_tile_count(self) -> int | None:
        """How many stored tiles this reader has decoded since it was opened (None: a reader
        without stored tiles of its own, which cannot tell)."""
        return None

    def stored_tile_pixels(
        self, level: int, present: np.ndarray, box: tuple[int, int, int, int]
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(x0, y0, pixels)`` of each ``present`` stored tile of ``level`` that meets ``box``
        (``x0, y0, x1, y1`` level pixels), decoded one at a time into one buffer (each valid until
        the next), clipped to the level; in the read paths' error boundary."""
        lw, lh = self._level_dimensions[level]
        ds = self._level_downsamples[level]
        tile_w, tile_h = self.tile_grid_shape(level)[:2]
        buf = np.empty((tile_h, tile_w, 3), np.uint8)
        x0, y0, x1, y1 = box
        rows, cols = slice(max(0, y0 // tile_h), -(-y1 // tile_h)), slice(max(0, x0 // tile_w), -(-x1 // tile_w))
        for ty, tx in zip(*np.nonzero(present[rows, cols]), strict=True):
            tx, ty = int(tx) + cols.start, int(ty) + rows.start
            px, py = tx * tile_w, ty * tile_h
            with self._reading((round(px * ds), round(py * ds)), level):
                self.decode_stored_tile(level, tx, ty, buf)
            yield px, py, buf[: min(tile_h, lh - py), : min(tile_w, lw - px)]

    # -- life cycle ---------------------------------------------------------
    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.path}: slide is closed")

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        w, h = self.dimensions
        return f"<{type(self).__name__} {os.path.basename(self.path)!r} {w}x{h} levels={self.level_count}>"


# The thumbnail's ways of reading a level too large to read whole (Slide.get_thumbnail).


def thumbnail_source(slide: Slide, max_size: tuple[int, int] | int, reduced: bool = False) -> tuple[int, int, int, int]:
    """``(width, height, level, k)``: the size of :meth:`Slide.get_thumbnail`'s image for ``max_size``
    and where it comes from: ``level``, its stored tiles decoded at 1/``k`` (1: whole). ``k`` is
    the largest of the level's :meth:`~Slide.reduced_scales` that keeps the decoded level at least the
    thumbnail's size, where ``reduced`` and the level stores all its tiles."""
    if isinstance(max_size, int):
        max_size = (max_size, max_size)
    w0, h0 = slide.dimensions
    scale = max(w0 / max_size[0], h0 / max_size[1], 1.0)
    tw, th = max(1, round(w0 / scale)), max(1, round(h0 / scale))
    level = slide.best_level_for_downsample(scale)
    k = 1
    if reduced and slide.stored_tiles_present(level) is None:
        ds = slide.level_downsamples[level]
        k = max((f for f in slide.reduced_scales(level) if ds * f <= scale), default=1)
    return tw, th, level, k


def _banded_thumbnail(slide: Slide, level: int, tw: int, th: int, k: int = 1) -> np.ndarray:
    """``level`` of ``slide`` (decoded at 1/``k``, :meth:`Slide.read_region_reduced`) shrunk to
    ``th x tw``, read in bands of whole thumbnail rows."""
    lw, lh = slide.level_dimensions[level]
    lw, lh = -(-lw // k), -(-lh // k)
    ds = slide.level_downsamples[level] * k
    level_rows_per_row = lh / th
    rows_per_band = max(1, int(THUMBNAIL_BAND_BYTES // (lw * 3 * max(level_rows_per_row, 1.0))))
    out = np.empty((th, tw, 3), np.uint8)
    for r0 in range(0, th, rows_per_band):
        r1 = min(th, r0 + rows_per_band)
        y0 = round(r0 * level_rows_per_row)
        y1 = lh if r1 == th else max(y0 + 1, round(r1 * level_rows_per_row))
        if k == 1:
            band = slide.read_region((0, round(y0 * ds)), level, (lw, y1 - y0))
        else:
            band = slide.read_region_reduced((0, round(y0 * ds)), level, k, (lw, y1 - y0))
        out[r0:r1] = cv2.resize(band, (tw, r1 - r0), interpolation=cv2.INTER_AREA)
    return out


def _thumbnail_of_stored_tiles(slide: Slide, level: int, tw: int, th: int, present: np.ndarray) -> np.ndarray:
    """``level`` of ``slide`` shrunk to ``th x tw`` from its ``present`` stored tiles, decoded one at a time."""
    lw, lh = slide.level_dimensions[level]
    parts = slide.stored_tile_pixels(level, present, (0, 0, lw, lh))
    return shrink_sparse(np.arange(lw), np.arange(lh), tw, th, parts, slide.background_rgb)


def level_shape_agrees(w0: int, h0: int, w: int, h: int, slack_px: float = 1.0) -> bool:
    """Whether a ``w x h`` level can be level 0 (``w0 x h0``) shrunk by one factor on both axes.

    A pyramid level's sides are level 0's divided by its downsample and rounded
    (up or down: writers differ), so a level of downsample ``d`` has
    ``w0 / d - slack_px < w < w0 / d + slack_px``, and the same for ``h``: the level agrees
    where some ``d`` meets both (OpenSlide's tolerance of a level's rounding; a file's pages are
    taken as levels with 2 px, for writers that round each level from the one above, .tiff_levels).
    A 512 x 128 page of a 1024 x 1024 slide (2 x one way, 8 x the other) does not.

    >>> level_shape_agrees(1000, 1000, 500, 500), level_shape_agrees(1001, 999, 501, 499)
    (True, True)
    >>> level_shape_agrees(1024, 1024, 512, 128)
    False
    """
    if min(w, h) < 1:
        return False
    # The downsamples each axis allows: w0 / (w + s) < d < w0 / (w - s) (no upper bound for w <= s).
    s = slack_px
    low = max(w0 / (w + s), h0 / (h + s))
    high = min(w0 / (w - s) if w > s else math.inf, h0 / (h - s) if h > s else math.inf)
    return low < high


def checked_mpp(path: str, mpp_x: float | None, mpp_y: float | None) -> tuple[float, float] | None:
    """Return (mpp_x, mpp_y) if both are known and plausible, else None.

    An implausible value warns (naming the file) and is dropped rather than
    raised: the slide can still be tiled by level, just not measured.
    """
    if mpp_x is None or mpp_y is None:
        return None
    try:
        mx, my = float(mpp_x), float(mpp_y)
    except (TypeError, ValueError):
        slide_warnings.warn(f"{path}: unreadable mpp ({mpp_x!r}, {mpp_y!r}); treating mpp as unknown", stacklevel=3)
        return None
    lo, hi = PLAUSIBLE_MPP_RANGE
    if not (math.isfinite(mx) and math.isfinite(my) and lo <= mx <= hi and lo <= my <= hi):
        slide_warnings.warn(
            f"{path}: implausible resolution {mx:.4g} x {my:.4g} um/px (expected {lo}-{hi} um/px, "
            "a placeholder 72-dpi tag gives about 350); treating mpp as unknown",
            stacklevel=3,
        )
        return None
    return (mx, my)


def paste_into_background(out_h: int, out_w: int, background: tuple[int, int, int]) -> np.ndarray:
    """A new ``(out_h, out_w, 3)`` uint8 array filled with ``background``."""
    out = np.empty((out_h, out_w, 3), np.uint8)
    out[...] = np.asarray(background, np.uint8)
    return out


def composite_rgba(rgba: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    """Composite premultiplied-free RGBA (as OpenSlide returns) onto ``background``.

    OpenSlide's ``read_region`` gives un-premultiplied RGBA where pixels
    outside the slide or in sparse regions are transparent.
    """
    alpha = rgba[..., 3]
    rgb = rgba[..., :3]
    if alpha.min() == 255:
        return np.ascontiguousarray(rgb)
    bg = np.asarray(background, np.float32)
    a = alpha.astype(np.float32)[..., None] / 255.0
    out = rgb.astype(np.float32) * a + bg * (1.0 - a)
    return np.ascontiguousarray(np.clip(out + 0.5, 0, 255).astype(np.uint8))
