"""The tile grid: where each patch of a slide lies, in level-0 pixels.

Edge policy: tile origins lie on a regular lattice (``origin = index * step *
downsample`` in level-0 pixels), except the last column's and row's, which
are shifted back so that the tile ends at the slide's border
(:attr:`TilingGeometry.last_shift_grid`): the detector sees image pixels
only. Padding a tile past the border with a flat colour drew an edge across
it that a detector took for an object (thin "scratches" along the bottom of
a frame 448k + 510 px high); reflecting the image into the padding doubled
objects cut by the border, which the pathology model then missed (measured
with ``benchmarks/edge_policy.py``, benchmarks/HISTORY.md). With a heatmap the
shifted origin is rounded up to the heatmap stride, so a few pixels (fewer
than the stride) may lie past the border; those, and an axis shorter than one
tile (which is then one tile), are filled by reflecting the image
(:func:`fill_past_edge`; the GPU loader gathers the same pixels).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from ..geometry import TilingGeometry
from ..slide.area import shrink_banded, shrink_sparse
from ..slide.base import Slide

DEFAULT_TILE_SIZE = 512
DEFAULT_OVERLAP = 64
# A resampled tile's region of its level is read whole (one read, one cv2.resize) up to this many
# level pixels a side, or twice the tile's side; a larger one (a grid far coarser than the level it
# reads) a band of rows at a time, so that its memory follows the tile, not the ratio of resolutions.
WHOLE_READ_MAX_PX = 4096


@dataclass(frozen=True)
class Tile:
    """One patch of a grid.

    ``x0_level0, y0_level0``: its top-left corner in level-0 pixels.
    ``size``: its width and height in output pixels (the model's input).
    ``downsample``: level-0 pixels per output pixel.
    ``level``: the slide level it is read from; ``read_size`` the region
    size in that level's pixels (equal to ``size`` unless resized).
    """

    index: int
    row: int
    col: int
    x0_level0: int
    y0_level0: int
    size: int
    downsample: float
    level: int
    read_size: int

    @property
    def extent_level0(self) -> float:
        """Side length of the tile in level-0 pixels."""
        return self.size * self.downsample

    @property
    def bounds_level0(self) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) in level-0 pixels."""
        e = self.extent_level0
        return (self.x0_level0, self.y0_level0, self.x0_level0 + e, self.y0_level0 + e)


class TileGrid(Sequence[Tile]):
    """Overlapping square tiles covering a slide at a level or a target resolution.

    Give ``level`` to read a pyramid level as it is, or ``mpp`` to read at a
    target resolution: the nearest finer level is read and resized when no
    level has exactly that resolution. With neither, level 0 is used.

    >>> from wsi_pipeline.slide.image import ImageSlide
    >>> grid = TileGrid(ImageSlide.from_array(np.zeros((1000, 1500, 3), np.uint8)))
    >>> grid.n_cols, grid.n_rows, len(grid)
    (4, 3, 12)
    >>> t = grid[5]; (t.row, t.col, t.x0_level0, t.y0_level0)
    (1, 1, 448, 448)
    >>> t = grid[11]; (t.row, t.col, t.x0_level0, t.y0_level0)  # the last: ends at the border
    (2, 3, 988, 488)
    """

    def __init__(
        self,
        slide: Slide,
        tile_size: int = DEFAULT_TILE_SIZE,
        overlap: int = DEFAULT_OVERLAP,
        level: int | None = None,
        mpp: float | None = None,
        *,
        geometry: TilingGeometry | None = None,
    ):
        if geometry is None:
            geometry = TilingGeometry.for_slide(slide, tile_size, overlap, level=level, mpp=mpp)
        self.slide = slide
        self.geometry = geometry
        g = geometry  # a frozen value: its numbers are copied for the grid's hot paths
        self.tile_size, self.overlap, self.step = g.tile, g.overlap, g.step
        self.level, self.downsample, self.read_size = g.level, g.downsample, g.read_size
        self.n_cols, self.n_rows = g.n_cols, g.n_rows

    def __len__(self) -> int:
        return self.n_rows * self.n_cols

    def tile(self, row: int, col: int) -> Tile:
        if not (0 <= row < self.n_rows and 0 <= col < self.n_cols):
            raise IndexError(f"tile ({row}, {col}) outside a {self.n_rows}x{self.n_cols} grid")
        return self.tiles_at(np.array([row]), np.array([col]))[0]

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.tile(index // self.n_cols, index % self.n_cols)

    def __iter__(self) -> Iterator[Tile]:
        rows, cols = np.divmod(np.arange(len(self)), self.n_cols)
        return iter(self.tiles_at(rows, cols))

    def tiles_at(self, rows: np.ndarray, cols: np.ndarray) -> list[Tile]:
        """The tiles (rows[i], cols[i]), their origins computed for all at once.

        The same tiles as :meth:`tile` gives one by one, a slide's thousands
        of them without a Python call per coordinate.
        """
        rows, cols = np.asarray(rows, np.int64).ravel(), np.asarray(cols, np.int64).ravel()
        if len(rows) and not (
            0 <= rows.min() and rows.max() < self.n_rows and 0 <= cols.min() and cols.max() < self.n_cols
        ):
            raise IndexError(f"tiles outside a {self.n_rows}x{self.n_cols} grid")
        g, n_cols = self.geometry, self.n_cols
        xs = np.atleast_1d(g.col_x0_level0(cols)).tolist()
        ys = np.atleast_1d(g.row_y0_level0(rows)).tolist()
        size, downsample, level, read_size = self.tile_size, self.downsample, self.level, self.read_size
        return [
            Tile(r * n_cols + c, r, c, x, y, size, downsample, level, read_size)
            for r, c, x, y in zip(rows.tolist(), cols.tolist(), xs, ys, strict=True)
        ]

    def read(self, tile: Tile) -> np.ndarray:
        """The tile's pixels: ``size x size x 3`` uint8 RGB."""
        return read_tile(self.slide, tile)

    def select(self, tissue_fraction: np.ndarray, min_fraction: float) -> list[Tile]:
        """Tiles whose tissue fraction (an ``n_rows x n_cols`` array) is at least ``min_fraction``."""
        frac = np.asarray(tissue_fraction).reshape(self.n_rows, self.n_cols)
        rows, cols = np.nonzero((frac >= min_fraction) & (frac > 0))  # grid order: row-major
        return self.tiles_at(rows, cols)

    def __repr__(self) -> str:
        return (
            f"TileGrid({self.n_rows}x{self.n_cols} tiles of {self.tile_size}px, overlap {self.overlap}, "
            f"level {self.level}, downsample {self.downsample:.4g})"
        )


def reflect_index(coords: np.ndarray, extent: int) -> np.ndarray:
    """``coords`` (pixels of an axis ``extent`` long) with those past its end mirrored back inside.

    Reflection without repeating the edge pixel (OpenCV's BORDER_REFLECT_101),
    repeated as often as needed, so an axis shorter than a tile fills it.

    >>> reflect_index(np.arange(8), 3).tolist()
    [0, 1, 2, 1, 0, 1, 2, 1]
    """
    coords = np.asarray(coords, np.int64)
    if extent <= 1:
        return np.where(coords < extent, coords, 0)
    period = 2 * (extent - 1)
    folded = coords % period
    return np.where(coords < extent, coords, np.where(folded < extent, folded, period - folded))


def tile_origin_at_level(slide: Slide, tile: Tile) -> tuple[int, int]:
    """The tile's top-left in pixels of its level, as the readers compute it."""
    ds = slide.level_downsamples[tile.level]
    return int(math.floor(tile.x0_level0 / ds)), int(math.floor(tile.y0_level0 / ds))


def fill_past_edge(region: np.ndarray, x0: int, y0: int, level_width: int, level_height: int) -> np.ndarray:
    """Fill the part of ``region`` (read at level pixel ``x0, y0``) past the level's edge by reflection."""
    h, w = region.shape[:2]
    if y0 + h > level_height > y0:
        rows = reflect_index(np.arange(y0, y0 + h), level_height) - y0
        region[level_height - y0 :] = region[rows[level_height - y0 :]]
    if x0 + w > level_width > x0:
        cols = reflect_index(np.arange(x0, x0 + w), level_width) - x0
        region[:, level_width - x0 :] = region[:, cols[level_width - x0 :]]
    return region


def reduced_factor(slide: Slide, tile: Tile) -> int:
    """The factor ``k`` by which ``tile`` is read from its level's JPEG tiles decoded reduced
    (``slide.reduced_decode``, an integer factor the reader offers, an origin on a multiple of
    ``k``); 0 where it is read at full size and shrunk."""
    if not slide.reduced_decode or tile.read_size == tile.size:
        return 0
    k, rest = divmod(tile.read_size, tile.size)
    x0, y0 = tile_origin_at_level(slide, tile)
    if rest or k not in slide.reduced_scales(tile.level) or x0 % k or y0 % k:
        return 0
    return k


def reads_whole(tile: Tile) -> bool:
    """Whether ``tile``'s region of its level is read whole (else a band at a time: :func:`read_tile`)."""
    return tile.read_size <= max(WHOLE_READ_MAX_PX, 2 * tile.size)


def source_map(x0: int, n: int, extent: int) -> np.ndarray:
    """The level pixel of each of ``n`` pixels of an axis from ``x0`` (-1: background), as
    :func:`read_tile` fills them: the level, reflected past its end (:func:`fill_past_edge`),
    background before its start or where the region starts past its end."""
    coords = np.arange(x0, x0 + n, dtype=np.int64)
    if x0 >= extent:
        return np.full(n, -1, np.int64)
    return np.where(coords < 0, -1, reflect_index(coords, extent))


def level0_at(level_px: int, downsample: float) -> int:
    """A level-0 coordinate the readers take to ``level_px`` of a level (``floor(x / downsample)``)."""
    x = math.ceil(level_px * downsample)
    while x > 0 and math.floor((x - 1) / downsample) == level_px:
        x -= 1
    while math.floor(x / downsample) < level_px:
        x += 1
    return x


def read_tile_banded(slide: Slide, tile: Tile) -> np.ndarray:
    """:func:`read_tile`'s pixels of a tile whose region is not read whole (:func:`reads_whole`).

    The region is shrunk as ``cv2.INTER_AREA`` shrinks it, from bands of its rows
    (:func:`~..slide.area.shrink_banded`); only the part inside the level is read, each level row
    about once where a tile reaches past a small slide's edge (the reflection is a map of pixels).
    """
    lw, lh = slide.level_dimensions[tile.level]
    ds = slide.level_downsamples[tile.level]
    x0, y0 = tile_origin_at_level(slide, tile)

    def read_rows(r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        return slide.read_region((level0_at(c0, ds), level0_at(r0, ds)), tile.level, (c1 - c0, r1 - r0))

    xmap, ymap = source_map(x0, tile.read_size, lw), source_map(y0, tile.read_size, lh)
    present = slide.stored_tiles_present(tile.level)
    if present is not None:  # a sparse level: its stored tiles in the region alone, absent ones background
        xs, ys = xmap[xmap >= 0], ymap[ymap >= 0]
        box = (
            (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
            if len(xs) and len(ys)
            else (0, 0, 0, 0)
        )
        parts = slide.stored_tile_pixels(tile.level, present, box)
        return shrink_sparse(xmap, ymap, tile.size, tile.size, parts, slide.background_rgb)
    return shrink_banded(read_rows, xmap, ymap, tile.size, tile.size, slide.background_rgb)


def read_tile(slide: Slide, tile: Tile, out: np.ndarray | None = None) -> np.ndarray:
    """Read ``tile`` from ``slide`` (resizing if the grid reads at a target mpp; a region larger
    than :func:`reads_whole` allows a band at a time, :func:`read_tile_banded`).

    ``out``, if given, is a ``size x size x 3`` uint8 array filled in place
    (written by the slide's ``read_region_into`` when no resize is needed).
    Pixels past the slide's edge are the image reflected (:func:`fill_past_edge`).
    """
    location = (tile.x0_level0, tile.y0_level0)
    region_size = (tile.read_size, tile.read_size)
    lw, lh = slide.level_dimensions[tile.level]
    x0, y0 = tile_origin_at_level(slide, tile)
    k = reduced_factor(slide, tile)
    if k:  # the level's JPEG tiles decoded at 1/k, which stands for INTER_AREA by k
        region = slide.read_region_reduced(location, tile.level, k, (tile.size, tile.size), out)
        return fill_past_edge(region, x0 // k, y0 // k, -(-lw // k), -(-lh // k))
    if out is not None and tile.read_size == tile.size:
        return fill_past_edge(slide.read_region_into(location, tile.level, region_size, out), x0, y0, lw, lh)
    if not reads_whole(tile):
        region = read_tile_banded(slide, tile)
    else:
        region = fill_past_edge(slide.read_region(location, tile.level, region_size), x0, y0, lw, lh)
        if tile.read_size != tile.size:
            region = cv2.resize(region, (tile.size, tile.size), interpolation=cv2.INTER_AREA)
    if out is None:
        return region
    out[...] = region
    return out
