"""Tile cores partition the slide: every box centre is owned by exactly one tile."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_pipeline.stitch import owned_by_tile, tile_core_px


def test_every_centre_is_owned_by_exactly_one_tile():
    tile, overlap, n_rows, n_cols = 512, 64, 3, 4
    step = tile - overlap
    rng = np.random.default_rng(0)
    # Centres anywhere on the padded grid, plus exactly on core boundaries.
    centres = rng.uniform(0, (n_cols - 1) * step + tile, (2000, 2))
    boundaries = np.array([step * k + overlap / 2 for k in range(1, n_cols)], dtype=np.float64)
    centres[:3] = np.c_[boundaries, boundaries[:3] * 0 + 100]
    boxes_level0 = np.c_[centres - 3, centres + 3]
    owners = np.zeros(len(centres), dtype=int)
    for r in range(n_rows):
        for c in range(n_cols):
            local = boxes_level0 - [c * step, r * step, c * step, r * step]
            inside = (local[:, 2] > 0) & (local[:, 0] < tile) & (local[:, 3] > 0) & (local[:, 1] < tile)
            owners += owned_by_tile(local, r, c, n_rows, n_cols, tile, overlap) & inside
    in_rows = centres[:, 1] < (n_rows - 1) * step + tile
    assert (owners[in_rows] == 1).all()


def test_core_of_inner_and_edge_tiles():
    assert tile_core_px(1, 1, 3, 3, 512, 64) == (32.0, 32.0, 480.0, 480.0)
    x0, y0, x1, y1 = tile_core_px(0, 2, 3, 3, 512, 64)
    assert (x0, x1) == (32.0, np.inf) and (y0, y1) == (-np.inf, 480.0)
    with pytest.raises(ValueError, match="row 3"):
        tile_core_px(3, 0, 3, 3, 512, 64)


def test_cores_partition_a_grid_whose_last_row_and_column_end_at_the_border():
    tile, overlap, n_rows, n_cols, shift = 512, 64, 3, 4, 300
    step = tile - overlap
    x0s = [c * step - (shift if c == n_cols - 1 else 0) for c in range(n_cols)]
    y0s = [r * step - (shift if r == n_rows - 1 else 0) for r in range(n_rows)]
    rng = np.random.default_rng(1)
    centres = rng.uniform(0, [x0s[-1] + tile, y0s[-1] + tile], (3000, 2))
    boxes_level0 = np.c_[centres - 3, centres + 3]
    owners = np.zeros(len(centres), dtype=int)
    for r in range(n_rows):
        for c in range(n_cols):
            local = boxes_level0 - [x0s[c], y0s[r], x0s[c], y0s[r]]
            inside = (local[:, 2] > 0) & (local[:, 0] < tile) & (local[:, 3] > 0) & (local[:, 1] < tile)
            owners += owned_by_tile(local, r, c, n_rows, n_cols, tile, overlap, (shift, shift)) & inside
    assert (owners == 1).all()
