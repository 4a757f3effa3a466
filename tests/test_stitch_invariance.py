"""Tiling invariance: tiled detections, once stitched, match whole-image detections.

The "detector" is deterministic and model-free: dark pixels -> connected
components -> one box per component, scored by its pixel area. Run per tile,
an object cut by a tile edge yields a partial box (smaller area, lower
score), so stitching has to remove or repair partial boxes.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from wsi_pipeline.stitch import global_nms, merge_boxes, owned_by_tile

TILE = 128
OVERLAP = 32
STEP = TILE - OVERLAP
SIZE = 400  # tiles at 0, 96, 192, 288; the last ones extend past the image (padded white)


def detect(gray: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boxes (x0, y0, x1, y1, pixel edges) and area scores of dark blobs."""
    n, _, stats, _ = cv2.connectedComponentsWithStats((gray < 128).astype(np.uint8), connectivity=8)
    stats = stats[1:n]
    boxes = np.stack([stats[:, 0], stats[:, 1], stats[:, 0] + stats[:, 2], stats[:, 1] + stats[:, 3]], axis=1).astype(
        np.float64
    )
    return boxes, stats[:, cv2.CC_STAT_AREA].astype(np.float64)


def detect_tiled(gray: np.ndarray, keep_owned: bool = False):
    """Run ``detect`` on each tile of the step lattice; boxes mapped to image pixels."""
    n = -(-(gray.shape[0] - OVERLAP) // STEP)
    padded = np.full((STEP * n + OVERLAP,) * 2, 255, dtype=np.uint8)
    padded[: gray.shape[0], : gray.shape[1]] = gray
    all_boxes, all_scores = [], []
    for r in range(n):
        for c in range(n):
            boxes, scores = detect(padded[r * STEP : r * STEP + TILE, c * STEP : c * STEP + TILE])
            if keep_owned:
                mask = owned_by_tile(boxes, r, c, n, n, TILE, OVERLAP)
                boxes, scores = boxes[mask], scores[mask]
            all_boxes.append(boxes + [c * STEP, r * STEP, c * STEP, r * STEP])
            all_scores.append(scores)
    return np.concatenate(all_boxes), np.concatenate(all_scores)


def precision_recall(pred: np.ndarray, truth: np.ndarray, min_iou: float = 0.9) -> tuple[float, float]:
    """One-to-one greedy matching at IoU >= min_iou."""
    used = np.zeros(len(truth), dtype=bool)
    matched = 0
    for p in pred:
        w = np.minimum(p[2], truth[:, 2]) - np.maximum(p[0], truth[:, 0])
        h = np.minimum(p[3], truth[:, 3]) - np.maximum(p[1], truth[:, 1])
        inter = np.clip(w, 0, None) * np.clip(h, 0, None)
        union = (p[2] - p[0]) * (p[3] - p[1]) + (truth[:, 2] - truth[:, 0]) * (truth[:, 3] - truth[:, 1]) - inter
        iou = np.where(used, 0.0, inter / union)
        k = int(np.argmax(iou))
        if iou[k] >= min_iou:
            used[k] = True
            matched += 1
    return matched / max(len(pred), 1), matched / max(len(truth), 1)


def blob_image(centres: list[tuple[int, int]], radius: int) -> np.ndarray:
    gray = np.full((SIZE, SIZE), 255, dtype=np.uint8)
    for x, y in centres:
        cv2.circle(gray, (x, y), radius, 0, thickness=-1)
    return gray


def spaced(candidates, min_distance: float) -> list[tuple[int, int]]:
    chosen: list[tuple[int, int]] = []
    for x, y in candidates:
        if all((x - a) ** 2 + (y - b) ** 2 >= min_distance**2 for a, b in chosen):
            chosen.append((x, y))
    return chosen


def small_objects() -> np.ndarray:
    """Blobs of diameter 13 (< half the overlap) on tile edges, four-tile corners and at random."""
    edges = [96, 128, 192, 224, 288, 320]  # tile starts and ends
    candidates = [(e1, e2) for e1 in edges for e2 in edges]  # corners of four tiles
    candidates += [(e, v) for e in edges for v in (40, 160, 250, 370)]  # on vertical seams
    candidates += [(v, e) for e in edges for v in (20, 150, 260, 380)]  # on horizontal seams
    rng = np.random.default_rng(0)
    candidates += [tuple(int(v) for v in rng.integers(8, SIZE - 8, 2)) for _ in range(200)]
    return blob_image(spaced(candidates, 22), radius=6)


def test_global_nms_makes_tiled_detections_equal_whole_image_detections():
    gray = small_objects()
    truth, _ = detect(gray)
    assert len(truth) > 80
    boxes, scores = detect_tiled(gray)
    # Raw tiled output has partial duplicates along every seam.
    precision_raw, recall_raw = precision_recall(boxes, truth)
    assert recall_raw == 1.0 and precision_raw < 0.8
    keep = global_nms(boxes, scores, iou_threshold=0.5, metric="ios")
    precision, recall = precision_recall(boxes[keep], truth)
    assert precision >= 0.99 and recall >= 0.99


def test_ownership_makes_tiled_detections_equal_whole_image_detections():
    gray = small_objects()
    truth, _ = detect(gray)
    boxes, _ = detect_tiled(gray, keep_owned=True)
    precision, recall = precision_recall(boxes, truth)
    assert precision >= 0.99 and recall >= 0.99
    assert len(boxes) == len(truth)


def test_merge_recovers_objects_larger_than_the_overlap():
    # Diameter 45 > overlap 32: centred in an overlap band, no tile sees the whole object.
    centres = [(112, 50), (50, 208), (112, 112), (208, 304), (304, 208), (128, 300), (300, 40), (208, 208)]
    gray = blob_image(centres, radius=22)
    truth, _ = detect(gray)
    assert len(truth) == len(centres)
    boxes, scores = detect_tiled(gray)

    keep = global_nms(boxes, scores, iou_threshold=0.5, metric="ios")
    _, recall_nms = precision_recall(boxes[keep], truth)
    assert recall_nms < 0.9, "NMS alone keeps partial boxes of objects cut in every tile"

    merged, _, _ = merge_boxes(boxes, scores, iou_threshold=0.5, metric="ios", method="nmm")
    precision, recall = precision_recall(merged, truth)
    assert precision >= 0.99 and recall >= 0.99


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_reading_order_equals_lexsort(n):
    from wsi_pipeline.boxes.nms import reading_order

    rng = np.random.default_rng(n)
    boxes = rng.uniform(0, 50, (n, 4)).round(0).astype(np.float32)  # many ties
    if n > 3:
        boxes[0, 1], boxes[1, 0], boxes[2, 1] = -0.0, np.nan, np.nan
    np.testing.assert_array_equal(reading_order(boxes), np.lexsort((boxes[:, 0], boxes[:, 1])))
    boxes[:, 0] -= 25  # negative coordinates take the general sort
    np.testing.assert_array_equal(reading_order(boxes), np.lexsort((boxes[:, 0], boxes[:, 1])))
