"""Box merging that finishes the slide's upper rows while the lower ones still arrive.

Greedy NMS (and NMM / WBF, whose clusters form the same way) decides a box
only through boxes it overlaps above the threshold, directly or along a
chain: the result inside one connected component of the "overlaps more than
the threshold" graph does not depend on any box outside it. Tiles arrive in
grid order, so once row R of tiles begins, no later box reaches above row
R's top edge ``y_final``: a component whose boxes all end at or above
``y_final`` can get no new member and is decided now, exactly as a global
pass over the whole slide would decide it. Only the open components are
held, a few tile rows of boxes, so memory follows the slide's width, not its
height or its total count of boxes (the kept boxes, 24 bytes each, are the
output).
"""

from __future__ import annotations

import numpy as np

from wsi_pipeline.boxes.nms import (
    check_boxes,
    global_nms,
    matching_pairs,
    reading_order,
    resolve_greedy,
    score_order,
)
from wsi_pipeline.stitch.merge import merge_boxes

METHODS = ("nms", "nmm", "wbf")


def connected_components(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Component label (the smallest member index) of each of ``n`` nodes given edges src-dst."""
    lab = np.arange(n, dtype=np.int64)
    if len(src) == 0:
        return lab
    while True:
        m = np.minimum(lab[src], lab[dst])
        new = lab.copy()
        np.minimum.at(new, src, m)
        np.minimum.at(new, dst, m)
        while True:  # pointer jumping: follow labels to their roots
            nxt = new[new]
            if np.array_equal(nxt, new):
                break
            new = nxt
        if np.array_equal(new, lab):
            return lab
        lab = new


class StreamingMerger:
    """Merge a slide's boxes (level-0 pixels) as rows of tiles complete.

    Args:
        method: ``"nms"`` (:func:`~.nms.global_nms`), ``"nmm"`` or ``"wbf"``
            (:func:`~.merge.merge_boxes`).
        iou_threshold, metric: as those functions take them. Boxes merge
            only with boxes of their own label.

    Use: :meth:`add` boxes as they come; :meth:`flush` with the top edge of
    the first tile row still to come; :meth:`finish` at the end. The result
    equals the method run once over all the boxes (tests check it), up to
    the order of rows.
    """

    def __init__(self, method: str = "nms", iou_threshold: float = 0.5, metric: str = "iou"):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, found {method!r}")
        self.method = method
        self.iou_threshold = iou_threshold
        self.metric = metric
        self._boxes: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.pending = 0  # boxes held, undecided
        self.peak_pending = 0

    def add(self, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        """Boxes N x 4 (x0, y0, x1, y1, level-0 px), scores N, labels N (int)."""
        if len(boxes):
            self._boxes.append(np.asarray(boxes, np.float64).reshape(-1, 4))
            self._scores.append(np.asarray(scores, np.float64).reshape(-1))
            self._labels.append(np.asarray(labels, np.int64).reshape(-1))
            self.pending += len(boxes)
            self.peak_pending = max(self.peak_pending, self.pending)

    def flush(self, y_final: float) -> None:
        """Decide every component whose boxes all end at or above ``y_final`` (level-0 y)."""
        if not self._boxes:
            return
        boxes = np.concatenate(self._boxes)
        scores = np.concatenate(self._scores)
        labels = np.concatenate(self._labels)
        boxes, scores, labels = check_boxes(boxes, scores, labels)
        n = len(boxes)
        if np.isfinite(y_final):
            order = score_order(scores)
            groups = labels[order]
            src, dst = matching_pairs(boxes[order], groups, self.iou_threshold, self.metric)
            comp_sorted = connected_components(n, src, dst)
            comp = np.empty(n, np.int64)
            comp[order] = comp_sorted
            bottom = np.full(n, -np.inf)
            np.maximum.at(bottom, comp, boxes[:, 3])
            final = bottom[comp] <= y_final
            # Greedy NMS decides each component from its own edges: the pairs found above decide the
            # closed components directly, in processing order, as global_nms would.
            kept = order[resolve_greedy(n, src, dst) & final[order]] if self.method == "nms" else None
        else:
            final, kept = np.ones(n, bool), None
        if kept is not None:
            self._keep(boxes[kept], scores[kept], labels[kept])
        elif final.any():
            self._decide(boxes[final], scores[final], labels[final])
        rest = ~final
        self._boxes, self._scores, self._labels = (
            ([boxes[rest]], [scores[rest]], [labels[rest]]) if rest.any() else ([], [], [])
        )
        self.pending = int(rest.sum())

    def _decide(self, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        if self.method == "nms":
            keep = global_nms(boxes, scores, labels, self.iou_threshold, self.metric)
            b, s, lab = boxes[keep], scores[keep], labels[keep]
        else:
            b, s, lab = merge_boxes(boxes, scores, labels, self.iou_threshold, self.metric, self.method)
        self._keep(b, s, lab)

    def _keep(self, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        # Decided boxes are the output: keep them compact, and in reading order. The stitcher
        # sorts the slide's boxes so at the end (a stable sort: the same order either way); sorted
        # a row at a time here, meanwhile, they come nearly sorted and that sort has less left to
        # do (Stitcher.finish: benchmarks/bench_stitcher.py --merge process).
        b = boxes.astype(np.float32)
        order = reading_order(b)
        self._out.append((b[order], scores[order].astype(np.float32), labels[order].astype(np.int32)))

    def take_decided(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The boxes decided since the last take (as :meth:`finish` gives them), or None: none.

        :meth:`finish` then gives only the boxes decided after it; the takes and the finish,
        concatenated in order, are what :meth:`finish` alone would give.
        """
        if not self._out:
            return None
        b, s, lab = (np.concatenate(parts) for parts in zip(*self._out, strict=True))
        self._out = []
        return b, s, lab.astype(np.int64)

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decide what is left; (boxes M x 4 float32, scores M float32, labels M int64) of the slide."""
        self.flush(np.inf)
        rest = self.take_decided()
        if rest is None:
            return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)
        return rest
