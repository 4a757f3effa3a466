"""Global NMS and box merging against plain greedy references and torchvision."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_pipeline.stitch import cluster_leaders, global_nms, intersecting_pairs, merge_boxes


def _overlap(a: np.ndarray, b: np.ndarray, metric: str) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(w, 0.0) * max(h, 0.0)
    if inter <= 0:
        return 0.0
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    if metric == "iou":
        return inter / (area_a + area_b - inter)
    return inter / min(area_a, area_b)


def reference_nms(boxes, scores, labels=None, thr=0.5, metric="iou") -> list[int]:
    """Textbook greedy NMS, one box at a time; ties broken by index."""
    order = sorted(range(len(boxes)), key=lambda k: (-scores[k], k))
    kept: list[int] = []
    for k in order:
        if all(
            (labels is not None and labels[k] != labels[q]) or _overlap(boxes[k], boxes[q], metric) <= thr for q in kept
        ):
            kept.append(k)
    return kept


def clustered_boxes(rng, n_objects, span, dup=4, jitter=2.0, size=(8.0, 30.0), n_classes=3):
    """Objects with 1..dup jittered duplicates each, plus a few large boxes."""
    centres = rng.uniform(0, span, (n_objects, 2))
    sides = rng.uniform(*size, (n_objects, 2))
    reps = rng.integers(1, dup + 1, n_objects)
    c = np.repeat(centres, reps, 0) + rng.normal(0, jitter, (reps.sum(), 2))
    s = np.repeat(sides, reps, 0) * rng.uniform(0.7, 1.3, (reps.sum(), 2))
    big_c = rng.uniform(0, span, (max(1, n_objects // 50), 2))
    big_s = rng.uniform(size[1] * 3, size[1] * 12, (len(big_c), 2))
    c = np.concatenate([c, big_c])
    s = np.concatenate([s, big_s])
    boxes = np.concatenate([c - s / 2, c + s / 2], 1)
    scores = rng.random(len(boxes))
    labels = rng.integers(0, n_classes, len(boxes))
    return boxes, scores, labels


@pytest.mark.parametrize("metric", ["iou", "ios"])
@pytest.mark.parametrize("thr", [0.0, 0.3, 0.5, 0.8])
def test_global_nms_equals_plain_greedy_loop(metric, thr):
    rng = np.random.default_rng(int(thr * 10) + (metric == "ios"))
    boxes, scores, labels = clustered_boxes(rng, 60, 150)
    # Quantised scores make ties, which must follow the documented order.
    scores = np.round(scores * 8) / 8
    got = global_nms(boxes, scores, iou_threshold=thr, metric=metric)
    assert got.dtype == np.int64
    assert got.tolist() == reference_nms(boxes, scores, thr=thr, metric=metric)
    got = global_nms(boxes, scores, labels, iou_threshold=thr, metric=metric)
    assert got.tolist() == reference_nms(boxes, scores, labels, thr=thr, metric=metric)


@pytest.mark.parametrize("seed", range(6))
def test_global_nms_equals_torchvision(seed):
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(100 + seed)
    boxes, scores, labels = clustered_boxes(rng, int(rng.integers(50, 3000)), float(rng.choice([300, 3000])))
    tb, ts, tl = (torch.from_numpy(a) for a in (boxes, scores, labels))
    for thr in (0.1, 0.5, 0.7):
        expected = ops.nms(tb, ts, thr).numpy()
        np.testing.assert_array_equal(global_nms(boxes, scores, iou_threshold=thr), expected)
        expected = ops.batched_nms(tb, ts, tl, thr).numpy()
        np.testing.assert_array_equal(global_nms(boxes, scores, labels, iou_threshold=thr), expected)
        agnostic = global_nms(boxes, scores, labels, iou_threshold=thr, class_agnostic=True)
        np.testing.assert_array_equal(agnostic, ops.nms(tb, ts, thr).numpy())


def test_long_suppression_chain_is_resolved_exactly():
    # Each box overlaps the next by IoU > 0.5 and scores decrease along the chain:
    # greedy keeps every other box, which needs one decision after another.
    n = 400
    x = np.arange(n) * 2.0
    boxes = np.stack([x, np.zeros(n), x + 10.0, np.full(n, 10.0)], 1)
    scores = np.linspace(1.0, 0.0, n)
    got = global_nms(boxes, scores, iou_threshold=0.5)
    assert got.tolist() == reference_nms(boxes, scores, thr=0.5)


def test_intersecting_pairs_finds_every_overlap_once():
    rng = np.random.default_rng(7)
    boxes, _, _ = clustered_boxes(rng, 150, 200)
    i, j, inter = intersecting_pairs(boxes)
    found = {(int(a), int(b)) for a, b in zip(i, j, strict=True)}
    assert len(found) == len(i), "a pair was reported twice"
    expected = set()
    for a in range(len(boxes)):
        for b in range(a + 1, len(boxes)):
            w = min(boxes[a, 2], boxes[b, 2]) - max(boxes[a, 0], boxes[b, 0])
            h = min(boxes[a, 3], boxes[b, 3]) - max(boxes[a, 1], boxes[b, 1])
            if w > 0 and h > 0:
                expected.add((a, b))
    assert found == expected
    assert (inter > 0).all()


def test_empty_and_degenerate_inputs():
    assert global_nms(np.zeros((0, 4)), np.zeros(0)).shape == (0,)
    # Zero-area boxes overlap nothing and are all kept.
    boxes = np.array([[5, 5, 5, 9], [5, 5, 5, 9], [0, 0, 10, 10]], dtype=np.float32)
    assert sorted(global_nms(boxes, np.array([0.9, 0.8, 0.7])).tolist()) == [0, 1, 2]


def test_bad_inputs_raise_config_error():
    with pytest.raises(ValueError, match="N x 4"):
        global_nms(np.zeros((3, 5)), np.zeros(3))
    with pytest.raises(ValueError, match="scores"):
        global_nms(np.zeros((3, 4)), np.zeros(2))
    with pytest.raises(ValueError, match="metric"):
        global_nms(np.zeros((3, 4)), np.zeros(3), metric="giou")
    with pytest.raises(ValueError, match="finite"):
        global_nms(np.array([[0, 0, np.nan, 1]]), np.zeros(1))


def reference_nmm(boxes, scores, thr, metric):
    """SAHI-style greedy NMM: leader absorbs all remaining boxes that match it."""
    remaining = sorted(range(len(boxes)), key=lambda k: (-scores[k], k))
    clusters = []
    while remaining:
        lead = remaining.pop(0)
        members = [k for k in remaining if _overlap(boxes[lead], boxes[k], metric) > thr]
        remaining = [k for k in remaining if k not in members]
        clusters.append([lead, *members])
    return clusters


@pytest.mark.parametrize("metric", ["iou", "ios"])
def test_merge_clusters_equal_greedy_nmm(metric):
    rng = np.random.default_rng(3)
    boxes, scores, _ = clustered_boxes(rng, 80, 200)
    clusters = reference_nmm(boxes, scores, 0.4, metric)
    leader = cluster_leaders(boxes, scores, iou_threshold=0.4, metric=metric)
    for members in clusters:
        assert (leader[members] == members[0]).all()

    merged, merged_scores, merged_labels = merge_boxes(boxes, scores, iou_threshold=0.4, metric=metric, method="nmm")
    assert merged_labels is None
    assert len(merged) == len(clusters)
    for row, members in enumerate(clusters):
        group = boxes[members]
        np.testing.assert_allclose(merged[row], [*group[:, :2].min(0), *group[:, 2:].max(0)])
        assert merged_scores[row] == scores[members[0]]

    fused, fused_scores, _ = merge_boxes(boxes, scores, iou_threshold=0.4, metric=metric, method="wbf")
    for row, members in enumerate(clusters):
        w = scores[members]
        np.testing.assert_allclose(fused[row], (boxes[members] * w[:, None]).sum(0) / w.sum())
        np.testing.assert_allclose(fused_scores[row], w.mean())


def test_merge_recovers_object_cut_by_tile_edge():
    # An object 0..100 x 0..40 seen as two parts by tiles overlapping on x 40..64.
    left_part = [0.0, 0.0, 64.0, 40.0]
    right_part = [40.0, 0.0, 100.0, 40.0]
    other = [300.0, 300.0, 320.0, 320.0]
    boxes = np.array([left_part, right_part, other])
    scores = np.array([0.9, 0.8, 0.7])
    labels = np.array([1, 1, 1])
    merged, merged_scores, merged_labels = merge_boxes(boxes, scores, labels, iou_threshold=0.3, metric="ios")
    np.testing.assert_allclose(merged, [[0, 0, 100, 40], other])
    np.testing.assert_allclose(merged_scores, [0.9, 0.7])
    assert merged_labels.tolist() == [1, 1]
    # Different classes never merge unless asked.
    merged, _, _ = merge_boxes(boxes, scores, np.array([1, 2, 1]), iou_threshold=0.3)
    assert len(merged) == 3
    merged, _, labels_out = merge_boxes(boxes, scores, np.array([1, 2, 1]), iou_threshold=0.3, class_agnostic=True)
    assert len(merged) == 2 and labels_out.tolist() == [1, 1]


def test_merge_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        merge_boxes(np.zeros((1, 4)), np.zeros(1), method="soft")
