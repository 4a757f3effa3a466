"""Tiling geometry: the one definition of where tiles and heatmap pixels lie.

Four pixel planes, named by suffix wherever a value is in one of them:

- ``_level0``: the slide's full-resolution pixels; detections are reported here.
- ``_grid``: pixels at the grid's resolution, ``downsample`` level-0 pixels
  each; tiles are ``tile`` grid pixels square and their origins lie on a
  lattice of ``step = tile - overlap`` grid pixels.
- ``_tile``: pixels of one tile, origin at its top-left corner (the model's
  input and its boxes).
- ``_heatmap``: the slide heatmap's pixels, ``heatmap_stride`` grid pixels
  each (``heatmap_scale_level0`` level-0 pixels).

Edge policy: tile origins lie on the lattice except the last row's and
column's, which are shifted back to end at the slide's border (rounded up to
the heatmap stride, so heatmaps still land on whole heatmap pixels): a tile
holds image pixels only, never padding, wherever the slide is at least a tile
large. An axis shorter than a tile is one tile, padded by reflection (see
:mod:`wsi_pipeline.tiling.grid`).
:class:`TilingGeometry` is built and validated once per run
(:meth:`TilingGeometry.for_slide`); the grid, the tissue fractions, the
blender, the ownership policy and the stitcher's level-0 mapping read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import slide_warnings
from .errors import ConfigError

# Relative tolerance under which two resolutions count as equal.
RESOLUTION_RTOL = 1e-6
# A grid is read from the nearest finer level shrunk at most this many times (a 512 px tile then
# reads at most a 32,768 px square of the level, a band at a time): 0.25 um/px read at 16. Coarser,
# each tile would decode more of the level than a whole thumbnail; a level nearer is needed.
MAX_SHRINK = 64


class _Pyramid(Protocol):
    """What the geometry needs of a slide (any :class:`~wsi_pipeline.slide.Slide`)."""

    path: object
    dimensions: tuple[int, int]
    mpp: tuple[float, float] | None
    level_count: int
    level_downsamples: tuple[float, ...]

    def best_level_for_downsample(self, downsample: float) -> int: ...


def check_tiling(tile: int, overlap: int, heatmap_stride: int | None = None, *, where: str = "") -> None:
    """Raise :class:`ConfigError` unless ``tile`` and ``overlap`` (grid pixels) make a grid.

    A grid needs ``0 <= overlap < tile``; with a heatmap, the tile and the
    step ``tile - overlap`` must be multiples of its stride, so that every
    tile's heatmap lands on whole heatmap pixels. ``where`` prefixes the
    message (e.g. the model card's path).
    """
    pre = f"{where}: " if where else ""
    if tile <= 0:
        raise ConfigError(f"{pre}tile size: expected a positive number of pixels, found {tile}")
    if not 0 <= overlap < tile:
        raise ConfigError(f"{pre}overlap: expected at least 0 and less than the tile size {tile}, found {overlap}")
    if heatmap_stride is not None and (tile % heatmap_stride or (tile - overlap) % heatmap_stride):
        raise ConfigError(
            f"{pre}overlap: tile size minus overlap ({tile} - {overlap}) must be a multiple of the "
            f"model's heatmap stride {heatmap_stride}"
        )


def read_resolution(
    slide: _Pyramid, level: int | None = None, mpp: float | None = None, preferred_mpp: float | None = None
) -> tuple[int, float]:
    """The level to read and the downsample (level-0 pixels per grid pixel) of a grid.

    ``level``: read that level as it is. ``mpp``: read at that resolution
    (micrometres per pixel), from the nearest finer level, resized where no
    level matches; a slide without a known resolution, or one coarser than
    asked, is an error. ``preferred_mpp`` (a model's resolution) is the same
    request, but where it cannot be met the grid reads level 0 with a warning.
    With none of them, level 0.
    """
    if level is not None and (mpp is not None or preferred_mpp is not None):
        raise ConfigError("give a level or a target mpp, not both")
    if level is not None:
        if not 0 <= level < slide.level_count:
            raise ConfigError(f"{slide.path}: level {level} does not exist (slide has {slide.level_count})")
        return int(level), float(slide.level_downsamples[level])
    want = mpp if mpp is not None else preferred_mpp
    if want is None:
        return 0, float(slide.level_downsamples[0])
    if not (want > 0 and math.isfinite(want)):
        raise ConfigError(f"target mpp must be a positive number, got {want}")
    if slide.mpp is None:
        if mpp is not None:
            raise ConfigError(
                f"{slide.path}: a target mpp of {mpp} was asked for, but the slide's "
                "resolution is unknown; choose a level instead"
            )
        slide_warnings.warn(
            f"{slide.path}: resolution unknown; the model expects {want} um/px, reading level 0", stacklevel=3
        )
        return 0, float(slide.level_downsamples[0])
    if want < slide.mpp[0] * (1 - RESOLUTION_RTOL):
        if mpp is not None:
            raise ConfigError(
                f"{slide.path}: target {mpp} um/px is finer than the slide's level 0 "
                f"({slide.mpp[0]:.4g} um/px); upsampling is not supported"
            )
        slide_warnings.warn(
            f"{slide.path}: level 0 is {slide.mpp[0]:.4g} um/px, coarser than the model's "
            f"{want} um/px; reading level 0 as it is",
            stacklevel=3,
        )
        return 0, float(slide.level_downsamples[0])
    downsample = want / slide.mpp[0]
    level = slide.best_level_for_downsample(downsample)
    shrink = downsample / slide.level_downsamples[level]
    if shrink > MAX_SHRINK * (1 + RESOLUTION_RTOL):
        level_mpp = slide.mpp[0] * slide.level_downsamples[level]
        level_0 = "" if level == 0 else f"; level 0: {slide.mpp[0]:.4g} um/px"
        raise ConfigError(
            f"{slide.path}: reading {want:g} um/px needs level {level} ({level_mpp:.4g} um/px{level_0}), "
            f"its nearest finer level, shrunk {shrink:.4g} times; at most {MAX_SHRINK} times is read: "
            f"read a slide with a pyramid level nearer {want:g} um/px, or choose a level (--level)"
        )
    return level, float(downsample)


@dataclass(frozen=True)
class TilingGeometry:
    """A slide's tile lattice and heatmap plane; built and checked once.

    Attributes:
        width_level0, height_level0: the slide's size in level-0 pixels.
        tile: tile side in grid pixels (the model's input size).
        overlap: overlap of neighbouring tiles, grid pixels.
        downsample: level-0 pixels per grid pixel.
        level: the slide level tiles are read from.
        level_downsample: level-0 pixels per pixel of ``level``.
        heatmap_stride: grid pixels per heatmap pixel, None without a heatmap.
    """

    width_level0: int
    height_level0: int
    tile: int
    overlap: int
    downsample: float = 1.0
    level: int = 0
    level_downsample: float = 1.0
    heatmap_stride: int | None = None

    def __post_init__(self) -> None:
        check_tiling(self.tile, self.overlap, self.heatmap_stride)
        if min(self.width_level0, self.height_level0) <= 0 or not self.downsample > 0:
            raise ConfigError(
                f"tiling: expected a positive slide size and downsample, found "
                f"{self.width_level0} x {self.height_level0} level-0 px at downsample {self.downsample}"
            )

    @classmethod
    def for_slide(
        cls,
        slide: _Pyramid,
        tile: int,
        overlap: int,
        *,
        level: int | None = None,
        mpp: float | None = None,
        preferred_mpp: float | None = None,
        heatmap_stride: int | None = None,
    ) -> TilingGeometry:
        """The geometry of ``slide`` read as :func:`read_resolution` decides."""
        lvl, ds = read_resolution(slide, level, mpp, preferred_mpp)
        w0, h0 = slide.dimensions
        return cls(
            int(w0), int(h0), int(tile), int(overlap), ds, lvl, float(slide.level_downsamples[lvl]), heatmap_stride
        )

    # -- the grid plane ----------------------------------------------------------
    @property
    def step(self) -> int:
        """Distance between neighbouring tile origins, grid pixels."""
        return self.tile - self.overlap

    @property
    def read_size(self) -> int:
        """A tile's side in pixels of ``level`` (equal to ``tile`` unless the grid resizes)."""
        ratio = self.downsample / self.level_downsample
        return self.tile if abs(ratio - 1) < RESOLUTION_RTOL else int(round(self.tile * ratio))

    @property
    def width_grid(self) -> int:
        return math.ceil(self.width_level0 / self.downsample)

    @property
    def height_grid(self) -> int:
        return math.ceil(self.height_level0 / self.downsample)

    @property
    def n_cols(self) -> int:
        return max(1, math.ceil(max(self.width_grid - self.overlap, 1) / self.step))

    @property
    def n_rows(self) -> int:
        return max(1, math.ceil(max(self.height_grid - self.overlap, 1) / self.step))

    @property
    def tile_extent_level0(self) -> float:
        """A tile's side in level-0 pixels."""
        return self.tile * self.downsample

    @property
    def last_shift_grid(self) -> tuple[int, int]:
        """(x, y) grid pixels by which the last column and row are moved back from the lattice.

        The last tile of an axis ends at the slide's border (its origin
        rounded up to the heatmap stride) instead of reaching past it; 0 where
        the lattice tile already ends there or the axis is shorter than a tile.
        """
        return (
            _last_shift(self.n_cols, self.step, self.tile, self.width_grid, self.heatmap_stride or 1),
            _last_shift(self.n_rows, self.step, self.tile, self.height_grid, self.heatmap_stride or 1),
        )

    def col_x0_grid(self, col: int | np.ndarray) -> np.ndarray:
        """Grid x of the left edge of tile column(s) ``col``."""
        col = np.asarray(col, np.int64)
        return col * self.step - np.where(col == self.n_cols - 1, self.last_shift_grid[0], 0)

    def row_y0_grid(self, row: int | np.ndarray) -> np.ndarray:
        """Grid y of the top edge of tile row(s) ``row``."""
        row = np.asarray(row, np.int64)
        return row * self.step - np.where(row == self.n_rows - 1, self.last_shift_grid[1], 0)

    def col_x0_level0(self, col: int | np.ndarray) -> int | np.ndarray:
        """Level-0 x of the left edge of tile column(s) ``col`` (rounded to whole pixels)."""
        return _round_level0(self.col_x0_grid(col) * self.downsample)

    def row_y0_level0(self, row: int | np.ndarray) -> int | np.ndarray:
        """Level-0 y of the top edge of tile row(s) ``row`` (rounded to whole pixels)."""
        return _round_level0(self.row_y0_grid(row) * self.downsample)

    def core_tiles_level0(self, x_level0: np.ndarray, y_level0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grid rows and columns (int32) of the tiles whose cores hold the level-0 points ``x, y``.

        A tile's core is the tile less half the overlap on each side with a neighbour (as
        :mod:`~wsi_pipeline.stitch.ownership` keeps boxes): the cores partition the slide, so a
        merged box, whose centre is in it, is traced to one tile, the one that saw it whole.
        """
        half = self.overlap / 2.0

        def index(v_level0: np.ndarray, n: int) -> np.ndarray:
            v = np.nan_to_num(np.asarray(v_level0, np.float64) / self.downsample, nan=0.0)
            return np.clip(np.floor((v - half) / self.step), 0, n - 1).astype(np.int32)

        return index(y_level0, self.n_rows), index(x_level0, self.n_cols)

    def tile_to_level0(self, boxes_tile: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Boxes in tile pixels to level-0 pixels.

        ``boxes_tile``: N x 4 float (x0, y0, x1, y1) in the pixels of each
        box's tile; ``rows``, ``cols``: N ints, each box's tile. Returns N x 4
        float32 in level-0 pixels, not clipped to the slide.
        """
        b = np.asarray(boxes_tile, np.float32).reshape(-1, 4) * np.float32(self.downsample)
        b[:, [0, 2]] += np.asarray(self.col_x0_level0(cols), np.float32).reshape(-1, 1)
        b[:, [1, 3]] += np.asarray(self.row_y0_level0(rows), np.float32).reshape(-1, 1)
        return b

    # -- the heatmap plane -------------------------------------------------------
    def _stride(self) -> int:
        if self.heatmap_stride is None:
            raise ValueError("this geometry has no heatmap plane (heatmap_stride is None)")
        return self.heatmap_stride

    @property
    def heatmap_scale_level0(self) -> float:
        """Level-0 pixels per heatmap pixel (the grid's downsample without a heatmap)."""
        return self.downsample * (self.heatmap_stride or 1)

    @property
    def heatmap_tile(self) -> int:
        """A tile's side in heatmap pixels."""
        return self.tile // self._stride()

    @property
    def heatmap_step(self) -> int:
        """Distance between tile origins in heatmap pixels."""
        return self.step // self._stride()

    @property
    def heatmap_width(self) -> int:
        return math.ceil(self.width_grid / self._stride())

    @property
    def heatmap_height(self) -> int:
        return math.ceil(self.height_grid / self._stride())

    def heatmap_pixel_size_um(self, mpp: tuple[float, float] | None) -> tuple[float, float] | None:
        """(x, y) micrometres per heatmap pixel for a slide of ``mpp`` (None: unknown)."""
        if not mpp:
            return None
        return (mpp[0] * self.heatmap_scale_level0, mpp[1] * self.heatmap_scale_level0)


def _last_shift(n: int, step: int, tile: int, extent_grid: int, stride: int) -> int:
    lattice = (n - 1) * step
    if extent_grid <= tile:
        return 0
    at_border = -(-(extent_grid - tile) // stride) * stride
    return max(0, lattice - at_border)


def _round_level0(v: np.ndarray) -> int | np.ndarray:
    r = np.rint(v).astype(np.int64)
    return int(r) if r.ndim == 0 else r


__all__ = ["RESOLUTION_RTOL", "TilingGeometry", "check_tiling", "read_resolution"]
