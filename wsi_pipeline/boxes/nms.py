"""Global non-maximum suppression over a whole slide's boxes.

Hand-written rather than taken from torchvision: ``torchvision.ops.nms``
compares every box with every other (O(N^2) time, and memory for the GPU
kernel's mask), which a slide with a million boxes cannot afford, and torch is
not part of the core install. Here a spatial grid finds only intersecting
pairs (:mod:`wsi_pipeline.boxes.spatial_grid`) and the greedy suppression is
resolved over that sparse graph. The result is identical to a greedy NMS over
all boxes at once.
"""

from __future__ import annotations

import numpy as np

from wsi_pipeline.boxes.spatial_grid import intersecting_pairs

METRICS = ("iou", "ios")
# After this many vectorised rounds the remaining boxes (a long chain of
# boxes each suppressing the next) are resolved one by one.
_MAX_VECTOR_ROUNDS = 24


def score_order(scores: np.ndarray) -> np.ndarray:
    """Indices of ``scores`` in processing order: descending score, ties by index.

    This is the deterministic order every function in this package uses.
    """
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")


def reading_order(boxes: np.ndarray) -> np.ndarray:
    """Indices sorting N x 4 boxes (x0, y0, ...; float32, >= 0 or NaN) by y0, then x0; ties keep their order.

    Non-negative float32 values order as their bit patterns do, so one stable
    sort of (y0 bits << 32 | x0 bits) does what ``np.lexsort((x0, y0))`` does,
    several times faster on a slide's hundreds of thousands of boxes.
    """
    x0 = np.ascontiguousarray(boxes[:, 0], np.float32) + np.float32(0)  # -0.0 -> 0.0
    y0 = np.ascontiguousarray(boxes[:, 1], np.float32) + np.float32(0)
    if (x0 < 0).any() or (y0 < 0).any():
        return np.lexsort((x0, y0))
    key = (y0.view(np.uint32).astype(np.uint64) << np.uint64(32)) | x0.view(np.uint32)
    return np.argsort(key, kind="stable")


def check_boxes(
    boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Validate and convert to (N x 4 float64, N float64, N int64 or None)."""
    boxes = np.asarray(boxes)
    scores = np.asarray(scores)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        msg = f"boxes: expected an N x 4 array (x0, y0, x1, y1), found shape {boxes.shape}"
        raise ValueError(msg)
    if scores.shape != (len(boxes),):
        msg = f"scores: expected shape ({len(boxes)},) to match the boxes, found {scores.shape}"
        raise ValueError(msg)
    boxes = boxes.astype(np.float64, copy=False)
    scores = scores.astype(np.float64, copy=False)
    if not (np.isfinite(boxes).all() and np.isfinite(scores).all()):
        msg = "boxes and scores: expected finite values, found NaN or infinity"
        raise ValueError(msg)
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != (len(boxes),):
            msg = f"labels: expected shape ({len(boxes)},) to match the boxes, found {labels.shape}"
            raise ValueError(msg)
        labels = labels.astype(np.int64, copy=False)
    return boxes, scores, labels


def check_nms_options(iou_threshold: float, metric: str) -> None:
    if metric not in METRICS:
        msg = f"metric: expected one of {METRICS}, found {metric!r}"
        raise ValueError(msg)
    if not 0.0 <= iou_threshold <= 1.0:
        msg = f"iou_threshold: expected a value in [0, 1], found {iou_threshold}"
        raise ValueError(msg)


def matching_pairs(
    boxes_sorted: np.ndarray,
    groups: np.ndarray | None,
    threshold: float,
    metric: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i, j), i < j, of boxes whose overlap exceeds ``threshold``.

    ``boxes_sorted`` is N x 4 float64 already in processing order, so ``i``
    ranks above ``j``. Overlap is IoU (``metric="iou"``) or intersection
    over the smaller box's area (``"ios"``); strictly greater than the
    threshold matches, as in torchvision.
    """
    i, j, inter = intersecting_pairs(boxes_sorted, groups)
    area = (boxes_sorted[:, 2] - boxes_sorted[:, 0]) * (boxes_sorted[:, 3] - boxes_sorted[:, 1])
    if metric == "iou":
        denom = area[i] + area[j] - inter
    else:
        denom = np.minimum(area[i], area[j])
    # inter > 0 implies both areas > 0, so denom > 0.
    match = inter / denom > threshold
    return i[match], j[match]


def resolve_greedy(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Boolean mask of boxes kept by greedy suppression over a sparse graph.

    Boxes are ranks 0..n-1 (0 first); an edge ``src -> dst`` (src < dst)
    means "src suppresses dst if src is kept". Greedy NMS keeps a box iff no
    kept box ranks above it among its matches. Resolved in vectorised rounds:
    a box whose predecessors are all suppressed is kept, a box with a kept
    predecessor is suppressed; every round decides at least the
    highest-ranked undecided box, and realistic slides need a handful.
    """
    undecided, kept, suppressed = 0, 1, 2
    state = np.full(n, kept, dtype=np.int8)
    state[dst] = undecided
    rounds = 0
    while len(dst):
        s = state[src]
        state[dst[s == kept]] = suppressed
        live = (state[dst] == undecided) & (s != suppressed)
        src, dst = src[live], dst[live]
        pending = state == undecided
        pending[dst] = False
        state[pending] = kept
        rounds += 1
        if rounds >= _MAX_VECTOR_ROUNDS and len(dst):
            _resolve_sequential(state, src, dst)
            break
    return state == kept


def _resolve_sequential(state: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    # Long suppression chains: walk the undecided boxes in rank order.
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    nodes = np.unique(np.concatenate([src, dst]))
    starts = np.searchsorted(src, nodes, side="left")
    ends = np.searchsorted(src, nodes, side="right")
    for node, a, b in zip(nodes.tolist(), starts.tolist(), ends.tolist(), strict=True):
        if state[node] == 0:
            state[node] = 1
        if state[node] == 1 and b > a:
            succ = dst[a:b]
            state[succ[state[succ] == 0]] = 2


def global_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray | None = None,
    iou_threshold: float = 0.5,
    metric: str = "iou",
    class_agnostic: bool = False,
) -> np.ndarray:
    """Greedy non-maximum suppression over all boxes of a slide.

    Args:
        boxes: N x 4 float (x0, y0, x1, y1), level-0 pixels.
        scores: N float.
        labels: N int class ids, or None (all one class).
        iou_threshold: a box is suppressed by a kept box whose overlap with it
            is strictly greater than this.
        metric: ``"iou"`` (intersection over union) or ``"ios"``
            (intersection over the smaller box's area).
        class_agnostic: when True, boxes of different labels suppress each
            other too.

    Returns:
        int64 indices into ``boxes`` of the kept boxes, in processing order:
        descending score, ties broken by ascending index. Equal to
        ``torchvision.ops.batched_nms`` (``nms`` when no labels) on the same
        boxes when no two scores tie.
    """
    boxes, scores, labels = check_boxes(boxes, scores, labels)
    check_nms_options(iou_threshold, metric)
    n = len(boxes)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = score_order(scores)
    groups = None if labels is None or class_agnostic else labels[order]
    src, dst = matching_pairs(boxes[order], groups, iou_threshold, metric)
    keep = resolve_greedy(n, src, dst)
    return order[np.flatnonzero(keep)].astype(np.int64)
