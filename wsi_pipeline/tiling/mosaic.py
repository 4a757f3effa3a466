"""Which stored tiles a batch of patches touches, and where they lie in the batch's mosaic.

Torch-free: the GPU decoder (:mod:`.gpu_decode`) lays a batch's decoded stored tiles out as one
mosaic on the device, each in its slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np


def stored_tiles_touched(
    xs0: Iterable[int], ys0: Iterable[int], size: int, tile_w: int, tile_h: int, level_w: int, level_h: int
) -> list[tuple[int, int]]:
    """The stored tiles ``(tx, ty)`` that patches touch, row-major, clipped to the level.

    ``xs0``, ``ys0``: the patches' level-pixel origins; ``size``: their side
    in pixels; ``tile_w``, ``tile_h``: the stored tiles'; ``level_w``,
    ``level_h``: the level's. A patch wholly past the level's edge touches none.
    """
    x0, y0 = np.asarray(list(xs0), np.int64), np.asarray(list(ys0), np.int64)
    if x0.shape != y0.shape:
        raise ValueError(f"expected as many x as y origins, found {x0.shape[0]} and {y0.shape[0]}")
    x1, y1 = np.minimum(x0 + size, level_w), np.minimum(y0 + size, level_h)
    x0, y0 = np.maximum(x0, 0), np.maximum(y0, 0)
    inside = (x0 < x1) & (y0 < y1)
    if not inside.any():
        return []
    tx0, tx1 = x0[inside] // tile_w, (x1[inside] - 1) // tile_w  # inclusive stored-tile ranges
    ty0, ty1 = y0[inside] // tile_h, (y1[inside] - 1) // tile_h
    # Mark each patch's rectangle of stored tiles on a grid around them, one offset at a time
    # (a patch spans a few stored tiles per axis); the grid's nonzero cells come out row-major.
    ox, oy = int(tx0.min()), int(ty0.min())
    touched = np.zeros((int(ty1.max()) - oy + 1, int(tx1.max()) - ox + 1), bool)
    for dy in range(int((ty1 - ty0).max()) + 1):
        for dx in range(int((tx1 - tx0).max()) + 1):
            ok = (ty0 + dy <= ty1) & (tx0 + dx <= tx1)
            touched[ty0[ok] + dy - oy, tx0[ok] + dx - ox] = True
    ty, tx = np.nonzero(touched)
    return list(zip((tx + ox).tolist(), (ty + oy).tolist(), strict=True))


class MosaicLayout(NamedTuple):
    """Where a batch's stored tiles lie in its mosaic: the first stored tile (``tx0``, ``ty0``), the
    mosaic's ``rows`` and ``cols`` of stored tiles, and the slot (row-major) of each stored tile."""

    tx0: int
    ty0: int
    rows: int
    cols: int
    slots: dict[tuple[int, int], int]


def mosaic_layout(needed: list[tuple[int, int]]) -> MosaicLayout:
    """The mosaic of the stored tiles ``needed`` (``(tx, ty)``, row-major, as
    :func:`stored_tiles_touched` gives them): their bounding box of stored tiles."""
    tx0, tx1 = min(tx for tx, _ in needed), max(tx for tx, _ in needed)
    ty0, ty1 = needed[0][1], needed[-1][1]
    rows, cols = ty1 - ty0 + 1, tx1 - tx0 + 1
    slots = {(tx, ty): (ty - ty0) * cols + (tx - tx0) for tx, ty in needed}
    return MosaicLayout(tx0, ty0, rows, cols, slots)


__all__ = ["MosaicLayout", "mosaic_layout", "stored_tiles_touched"]
