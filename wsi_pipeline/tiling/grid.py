"""The tile grid: where each patch of a slide lies, in level-0 pixels.

Edge policy: the grid PADS. Tile origins lie on a regular lattice
(``origin = index * step * downsample`` in level-0 pixels) and the last
column and row extend past the slide edge, the outside filled with the
slide's background colour. Shifting the last tile back inside would put its
origin off the lattice, so its heatmap would not land on the model's stride
grid and its overlap with its neighbour would differ from every other
tile's; padding keeps every overlap identical and every placement exact, at
the price of some background pixels in the last row and column.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from ..geometry import TilingGeometry
from ..slide.base import Slide

DEFAULT_TILE_SIZE = 512
DEFAULT_OVERLAP = 64


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


def read_tile(slide: Slide, tile: Tile, out: np.ndarray | None = None) -> np.ndarray:
    """Read ``tile`` from ``slide`` (resizing if the grid reads at a target mpp).

    ``out``, if given, is a ``size x size x 3`` uint8 array filled in place
    (written by the slide's ``read_region_into`` when no resize is needed).
    """
    location = (tile.x0_level0, tile.y0_level0)
    region_size = (tile.read_size, tile.read_size)
    if out is not None and tile.read_size == tile.size:
        return slide.read_region_into(location, tile.level, region_size, out)
    region = slide.read_region(location, tile.level, region_size)
    if tile.read_size != tile.size:
        region = cv2.resize(region, (tile.size, tile.size), interpolation=cv2.INTER_AREA)
    if out is None:
        return region
    out[...] = region
    return out
