"""Merging of duplicate boxes instead of suppressing them.

Clusters are the groups that greedy NMS forms: in processing order (descending
score, ties by index) each box not yet absorbed leads a cluster and absorbs
every not-yet-absorbed box whose overlap with it exceeds the threshold, as in
SAHI's greedy NMM. The clusters are then fused:

- ``method="nmm"``: the union of the cluster's boxes, the leader's score and
  label. For objects cut by a tile edge: each tile sees a part of the object,
  the parts overlap in the tiles' overlap zone, and their union is the whole
  object. Use with ``metric="ios"``: a part lies mostly inside the other
  parts' extent, so its IoU is low but its IoS high.
- ``method="wbf"``: weighted box fusion, the score-weighted mean of the
  cluster's coordinates and the mean of its scores (ensemble_boxes'
  ``conf_type="avg"`` for one model), the leader's label. For duplicates that
  each see the whole object but disagree by a few pixels (the same object
  seen from two tiles' contexts): averaging reduces the jitter where a union
  would grow the box. Use with ``metric="iou"``.

Same spatial-grid search as :func:`wsi_pipeline.stitch.global_nms`.
"""

from __future__ import annotations

import numpy as np

from wsi_pipeline.boxes.nms import (
    check_boxes,
    check_nms_options,
    matching_pairs,
    resolve_greedy,
    score_order,
)

METHODS = ("nmm", "wbf")


def cluster_leaders(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray | None = None,
    iou_threshold: float = 0.5,
    metric: str = "ios",
    class_agnostic: bool = False,
) -> np.ndarray:
    """For each box, the index of the box whose cluster absorbs it.

    Args: as :func:`merge_boxes`.

    Returns:
        N int64: ``leader[k] == k`` for the boxes greedy NMS keeps; otherwise
        the index of the highest-ranked kept box that matches box ``k``.
    """
    boxes, scores, labels = check_boxes(boxes, scores, labels)
    check_nms_options(iou_threshold, metric)
    n = len(boxes)
    order = score_order(scores)
    groups = None if labels is None or class_agnostic else labels[order]
    src, dst = matching_pairs(boxes[order], groups, iou_threshold, metric)
    kept = resolve_greedy(n, src, dst)
    leader_rank = np.arange(n, dtype=np.int64)
    edge = kept[src] & ~kept[dst]
    src, dst = src[edge], dst[edge]
    # The first kept match (lowest rank) is the one that absorbed the box.
    by_dst = np.lexsort((src, dst))
    src, dst = src[by_dst], dst[by_dst]
    first = np.r_[True, dst[1:] != dst[:-1]] if len(dst) else np.zeros(0, dtype=bool)
    leader_rank[dst[first]] = src[first]
    leader = np.empty(n, dtype=np.int64)
    leader[order] = order[leader_rank]
    return leader


def merge_boxes(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray | None = None,
    iou_threshold: float = 0.5,
    metric: str = "ios",
    method: str = "nmm",
    class_agnostic: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Merge duplicate boxes of a slide into one box per cluster.

    Args:
        boxes: N x 4 float (x0, y0, x1, y1), level-0 pixels.
        scores: N float.
        labels: N int class ids, or None (all one class).
        iou_threshold: a box joins a cluster when its overlap with the
            cluster's leader is strictly greater than this.
        metric: ``"ios"`` (intersection over the smaller box's area) or
            ``"iou"``.
        method: ``"nmm"`` (union box) or ``"wbf"`` (score-weighted mean box);
            see the module docstring for when to use which.
        class_agnostic: when True, boxes of different labels merge too (the
            leader's label wins).

    Returns:
        ``(boxes M x 4 float64, scores M float64, labels M int64 or None)``,
        one row per cluster, in the leaders' processing order (descending
        leader score).
    """
    if method not in METHODS:
        msg = f"method: expected one of {METHODS}, found {method!r}"
        raise ValueError(msg)
    leader = cluster_leaders(boxes, scores, labels, iou_threshold, metric, class_agnostic)
    boxes, scores, labels = check_boxes(boxes, scores, labels)
    order = score_order(scores)
    leaders = order[leader[order] == order]
    n_clusters = len(leaders)
    cluster_of_leader = np.full(len(boxes), -1, dtype=np.int64)
    cluster_of_leader[leaders] = np.arange(n_clusters)
    cluster = cluster_of_leader[leader]

    if method == "nmm":
        out = np.empty((n_clusters, 4), dtype=np.float64)
        out[:, :2] = np.inf
        out[:, 2:] = -np.inf
        np.minimum.at(out[:, 0], cluster, boxes[:, 0])
        np.minimum.at(out[:, 1], cluster, boxes[:, 1])
        np.maximum.at(out[:, 2], cluster, boxes[:, 2])
        np.maximum.at(out[:, 3], cluster, boxes[:, 3])
        out_scores = scores[leaders]
    else:
        weight = np.bincount(cluster, weights=scores, minlength=n_clusters)
        count = np.bincount(cluster, minlength=n_clusters)
        out = np.stack(
            [np.bincount(cluster, weights=scores * boxes[:, k], minlength=n_clusters) for k in range(4)],
            axis=1,
        )
        # Clusters whose scores sum to zero fall back to the plain mean.
        zero = weight <= 0
        if zero.any():
            plain = np.stack(
                [np.bincount(cluster, weights=boxes[:, k], minlength=n_clusters) for k in range(4)],
                axis=1,
            )
            out[zero] = plain[zero] / count[zero, None]
            weight = np.where(zero, 1.0, weight)
        out[~zero] /= weight[~zero, None]
        out_scores = np.bincount(cluster, weights=scores, minlength=n_clusters) / count
    out_labels = None if labels is None else labels[leaders]
    return out, out_scores, out_labels
