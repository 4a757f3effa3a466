"""Exact neighbour search for axis-aligned boxes through a uniform spatial grid.

Global NMS and box merging only ever compare boxes that intersect. A uniform
grid over the slide finds every intersecting pair without the N x N matrix
that a dense implementation (e.g. torchvision's ``nms``) builds: each box is
entered into the grid cells it covers, boxes sharing a cell are candidate
pairs, and a pair is reported only in the one cell that holds the top-left
corner of the two boxes' intersection, so no pair is reported twice.

All coordinates are level-0 pixels (x0, y0, x1, y1), origin top-left,
x right, y down. Everything here is vectorised numpy; hand-written because no
dependency of the core install offers an exact sparse box-overlap search.
"""

from __future__ import annotations

import numpy as np

# A box covering more cells than this is compared with all boxes directly
# instead of being entered into every cell it covers (a box much larger than
# the typical one would otherwise add thousands of grid entries).
_MAX_CELLS_PER_BOX = 16
# Bound on the temporary matrix built when comparing large boxes with all boxes.
_BRUTE_FORCE_CHUNK_ELEMENTS = 1 << 22


def choose_cell_size(boxes: np.ndarray) -> float:
    """Grid cell side in level-0 pixels for ``boxes`` (N x 4 float, x0 y0 x1 y1).

    Three times the median box side keeps most boxes within 1-4 cells and few
    unrelated boxes per cell; it is raised to a third of the 99.9th
    percentile so that at most about 0.1 % of the boxes fall back to the
    direct comparison. The result never changes which pairs are found,
    only how fast.
    """
    if len(boxes) == 0:
        return 1.0
    side = np.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    side = side[side > 0]
    if len(side) == 0:
        return 1.0
    median, p999 = np.quantile(side, [0.5, 0.999])
    return float(max(3.0 * median, p999 / 3.0, 1e-6))


def intersecting_pairs(
    boxes: np.ndarray,
    groups: np.ndarray | None = None,
    cell_size: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of boxes with a positive intersection area.

    Args:
        boxes: N x 4 float64 (x0, y0, x1, y1), level-0 pixels.
        groups: N int64 or None; when given, only boxes of the same group
            (e.g. the same class) are paired.
        cell_size: grid cell side in the boxes' units; chosen from the box
            sizes when None.

    Returns:
        ``(i, j, inter)``: int64 arrays of box indices with ``i < j`` and the
        float64 intersection area of each pair. Pairs come in no particular
        order. Boxes of zero or negative width or height take part in no pair.
    """
    boxes = np.asarray(boxes, dtype=np.float64)
    n = len(boxes)
    if n < 2:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), np.zeros(0, dtype=np.float64)
    if cell_size is None:
        cell_size = choose_cell_size(boxes)
    boxes = np.ascontiguousarray(boxes.T).T  # column-major: fast column gathers
    x0, y0, x1, y1 = (boxes[:, k] for k in range(4))
    valid = (x1 > x0) & (y1 > y0)

    cx0 = np.floor(x0 / cell_size).astype(np.int64)
    cy0 = np.floor(y0 / cell_size).astype(np.int64)
    cx1 = np.floor(x1 / cell_size).astype(np.int64)
    cy1 = np.floor(y1 / cell_size).astype(np.int64)
    ncx = cx1 - cx0 + 1
    ncy = cy1 - cy0 + 1
    ncells = ncx * ncy
    large = valid & (ncells > _MAX_CELLS_PER_BOX)
    in_grid = np.flatnonzero(valid & ~large)

    pieces_i: list[np.ndarray] = []
    pieces_j: list[np.ndarray] = []
    if len(in_grid) >= 2:
        i, j = _grid_pairs(
            boxes,
            in_grid,
            cx0,
            cy0,
            ncx,
            ncy,
            cell_size,
            None if groups is None else np.asarray(groups, dtype=np.int64),
        )
        pieces_i.append(i)
        pieces_j.append(j)
    large_idx = np.flatnonzero(large)
    if len(large_idx):
        i, j = _brute_force_pairs(boxes, large_idx, valid, large, groups)
        pieces_i.append(i)
        pieces_j.append(j)
    if not pieces_i:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), np.zeros(0, dtype=np.float64)
    i = np.concatenate(pieces_i)
    j = np.concatenate(pieces_j)
    inter = _intersection(boxes, i, j)
    swap = i > j
    i[swap], j[swap] = j[swap], i[swap]
    return i, j, inter


def _intersection(boxes: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    # Same operation order as torchvision's CPU kernel, so that results agree
    # bit for bit on float64 input.
    w = np.minimum(boxes[i, 2], boxes[j, 2]) - np.maximum(boxes[i, 0], boxes[j, 0])
    h = np.minimum(boxes[i, 3], boxes[j, 3]) - np.maximum(boxes[i, 1], boxes[j, 1])
    return np.maximum(w, 0.0) * np.maximum(h, 0.0)


def _grid_pairs(
    boxes: np.ndarray,
    idx: np.ndarray,
    cx0: np.ndarray,
    cy0: np.ndarray,
    ncx: np.ndarray,
    ncy: np.ndarray,
    cell_size: float,
    groups: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    empty = np.zeros(0, dtype=np.int64)
    # One grid entry per (box, covered cell), built offset by offset (boxes
    # cover at most a few cells, so this beats a generic repeat/divmod).
    boxes_parts, cx_parts, cy_parts = [], [], []
    sel_y = idx
    dy = 0
    while len(sel_y):
        sel_x = sel_y
        dx = 0
        while len(sel_x):
            boxes_parts.append(sel_x)
            cx_parts.append(cx0[sel_x] + dx)
            cy_parts.append(cy0[sel_x] + dy)
            dx += 1
            sel_x = sel_x[ncx[sel_x] > dx]
        dy += 1
        sel_y = sel_y[ncy[sel_y] > dy]
    entry_box = np.concatenate(boxes_parts)
    entry_cx = np.concatenate(cx_parts)
    entry_cy = np.concatenate(cy_parts)

    gx0 = entry_cx.min()
    gy0 = entry_cy.min()
    span_x = int(entry_cx.max() - gx0 + 1)
    span_y = int(entry_cy.max() - gy0 + 1)
    cell_id = (entry_cy - gy0) * span_x + (entry_cx - gx0)
    if groups is not None:
        g = groups[entry_box]
        g = g - g.min()
        if (int(g.max()) + 1) * span_x * span_y >= 2**62:
            msg = "box coordinates span too large a grid; pass a larger cell_size"
            raise OverflowError(msg)
        cell_id = g * (span_x * span_y) + cell_id

    order = np.argsort(cell_id)
    cell_sorted = cell_id[order]
    # Pair every entry with the entries d places later in the sorted list
    # while they share its cell; ``active`` shrinks to the entries whose run
    # is still long enough, so the total work is O(entries + pairs).
    n_entries = len(cell_sorted)
    same_next = np.flatnonzero(cell_sorted[1:] == cell_sorted[:-1])
    left_parts, right_parts = [], []
    active = same_next
    d = 1
    while len(active):
        left_parts.append(active)
        right_parts.append(active + d)
        d += 1
        active = active[active + d < n_entries]
        active = active[cell_sorted[active + d] == cell_sorted[active]]
    if not left_parts:
        return empty, empty.copy()
    left = np.concatenate(left_parts)
    right = np.concatenate(right_parts)

    e_left = order[left]
    a = entry_box[e_left]
    b = entry_box[order[right]]
    # Keep the pair only in the cell holding its intersection's top-left
    # corner, and only when the intersection is not empty.
    x0, y0, x1, y1 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    ix = np.maximum(x0[a], x0[b])
    iy = np.maximum(y0[a], y0[b])
    keep = (ix < np.minimum(x1[a], x1[b])) & (iy < np.minimum(y1[a], y1[b]))
    keep &= np.floor(ix / cell_size).astype(np.int64) == entry_cx[e_left]
    keep &= np.floor(iy / cell_size).astype(np.int64) == entry_cy[e_left]
    return a[keep], b[keep]


def _brute_force_pairs(
    boxes: np.ndarray,
    large_idx: np.ndarray,
    valid: np.ndarray,
    large: np.ndarray,
    groups: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    n = len(boxes)
    out_i: list[np.ndarray] = []
    out_j: list[np.ndarray] = []
    chunk = max(1, _BRUTE_FORCE_CHUNK_ELEMENTS // n)
    all_idx = np.arange(n)
    for start in range(0, len(large_idx), chunk):
        li = large_idx[start : start + chunk]
        bl = boxes[li]
        w = np.minimum(bl[:, None, 2], boxes[None, :, 2]) - np.maximum(bl[:, None, 0], boxes[None, :, 0])
        h = np.minimum(bl[:, None, 3], boxes[None, :, 3]) - np.maximum(bl[:, None, 1], boxes[None, :, 1])
        hit = (w > 0) & (h > 0) & valid[None, :]
        # A pair of two large boxes is reported once, by its lower index.
        hit &= ~large[None, :] | (all_idx[None, :] > li[:, None])
        if groups is not None:
            hit &= groups[li][:, None] == groups[None, :]
        r, c = np.nonzero(hit)
        out_i.append(li[r])
        out_j.append(c.astype(np.int64))
    return np.concatenate(out_i), np.concatenate(out_j)
