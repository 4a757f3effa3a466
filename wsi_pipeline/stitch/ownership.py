"""Tile ownership: keep a box only in the one tile whose core holds its centre.

A tile's core is the tile minus half the overlap on every side that has a
neighbouring tile; a side on the slide's border (first or last row or column)
owns everything out to the border. The last row and column may be moved back
to end at the slide's border (``last_shift_px``, the grid's edge policy); their
cores then start where their neighbour's ends. Neighbouring cores share their boundary
(half-open intervals), so the cores of a grid partition the slide and every
point belongs to exactly one tile. This is an O(N) alternative to global NMS,
exact when objects are smaller than half the overlap and the detector's boxes
for one object agree across tiles (see docs/stitching.md).
"""

from __future__ import annotations

import numpy as np


def tile_core_px(
    row: int,
    col: int,
    n_rows: int,
    n_cols: int,
    tile_size_px: int,
    overlap_px: int,
    last_shift_px: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float, float, float]:
    """The core of tile (row, col) as (x0, y0, x1, y1) in the tile's pixels.

    Half-open: a point (x, y) is in the core when x0 <= x < x1 and
    y0 <= y < y1. Sides without a neighbour extend to -inf / +inf.
    ``last_shift_px``: (x, y) pixels by which the last column and row lie
    before the lattice (``TilingGeometry.last_shift_grid``).
    """
    if not (0 <= row < n_rows and 0 <= col < n_cols):
        msg = f"tile (row {row}, col {col}): expected inside a grid of {n_rows} x {n_cols} tiles"
        raise ValueError(msg)
    if not 0 <= overlap_px < tile_size_px:
        msg = f"overlap_px: expected 0 <= overlap < tile size {tile_size_px}, found {overlap_px}"
        raise ValueError(msg)
    half = overlap_px / 2.0
    x0 = half + (last_shift_px[0] if col == n_cols - 1 else 0) if col > 0 else -np.inf
    y0 = half + (last_shift_px[1] if row == n_rows - 1 else 0) if row > 0 else -np.inf
    x1 = tile_size_px - half if col < n_cols - 1 else np.inf
    y1 = tile_size_px - half if row < n_rows - 1 else np.inf
    return (x0, y0, x1, y1)


def owned_by_tile(
    boxes_tile_px: np.ndarray,
    row: int,
    col: int,
    n_rows: int,
    n_cols: int,
    tile_size_px: int = 512,
    overlap_px: int = 64,
    last_shift_px: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """Mask of the boxes of tile (row, col) that this tile owns.

    Args:
        boxes_tile_px: N x 4 float (x0, y0, x1, y1) in the tile's pixels (at
            the level it was read at, before mapping to level 0).
        row, col: the tile's position in the grid; n_rows, n_cols the grid's
            size, which tells which sides have a neighbour.
        tile_size_px, overlap_px: tile side and overlap in the same pixels.
        last_shift_px: see :func:`tile_core_px`.

    Returns:
        N bool: True where the box centre lies in the tile's core.
    """
    boxes = np.asarray(boxes_tile_px, dtype=np.float64)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        msg = f"boxes_tile_px: expected an N x 4 array (x0, y0, x1, y1), found shape {boxes.shape}"
        raise ValueError(msg)
    x0, y0, x1, y1 = tile_core_px(row, col, n_rows, n_cols, tile_size_px, overlap_px, last_shift_px)
    cx = (boxes[:, 0] + boxes[:, 2]) / 2.0
    cy = (boxes[:, 1] + boxes[:, 3]) / 2.0
    return (cx >= x0) & (cx < x1) & (cy >= y0) & (cy < y1)


def touches_inner_edge(
    boxes_tile_px: np.ndarray,
    row: int | np.ndarray,
    col: int | np.ndarray,
    n_rows: int,
    n_cols: int,
    tile_size_px: int = 512,
    overlap_px: int = 64,
    margin_px: float = 1.0,
) -> np.ndarray:
    """Mask of the boxes of tile (row, col) cut by a tile border that has a neighbour.

    A box within ``margin_px`` of such a border is (likely) an object cut by
    the tile, whose whole box the neighbouring tile sees when the object is
    smaller than the overlap. Dropping these before global NMS keeps a cut
    box from surviving beside the whole one (their IoU is often below the
    NMS threshold). Borders on the slide's edge keep their boxes.

    Args:
        boxes_tile_px: N x 4 float (x0, y0, x1, y1) in the tile's pixels.
        row, col: the tile's grid position, or N ints: each box's own tile
            (boxes of several tiles at once).

    Returns:
        N bool.
    """
    b = np.asarray(boxes_tile_px, dtype=np.float64).reshape(-1, 4)
    row, col = np.asarray(row), np.asarray(col)
    if row.ndim == 0 and col.ndim == 0:
        tile_core_px(int(row), int(col), n_rows, n_cols, tile_size_px, overlap_px)  # checks the arguments
    elif row.shape != (len(b),) or col.shape != (len(b),):
        raise ValueError(f"row, col: expected ints or {len(b)} values each, found shapes {row.shape}, {col.shape}")
    far = tile_size_px - margin_px
    cut = (col > 0) & (b[:, 0] <= margin_px)
    cut |= (row > 0) & (b[:, 1] <= margin_px)
    cut |= (col < n_cols - 1) & (b[:, 2] >= far)
    cut |= (row < n_rows - 1) & (b[:, 3] >= far)
    return cut
