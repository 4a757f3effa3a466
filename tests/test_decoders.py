"""Output decoders on hand-made model outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline.errors import ModelError
from wsi_pipeline.inference.card_spec import ClassSpec, DecoderSpec, HeatmapSpec, InputSpec, ModelCard, OutputSpec
from wsi_pipeline.inference.decoder_registry import validate_decoder_params
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.tile_detections import TileDetections


def make_card(
    decoder: str,
    outputs: tuple[OutputSpec, ...],
    heatmap: HeatmapSpec | None = None,
    n_classes: int = 2,
    tile_px: int = 64,
    **params,
) -> ModelCard:
    return ModelCard(
        name="t",
        version="1",
        model_path=Path("/nonexistent/t.onnx"),
        sha256="0" * 64,
        input=InputSpec("image", (tile_px, tile_px)),
        outputs=outputs,
        decoder=DecoderSpec(decoder, params),
        classes=tuple(ClassSpec(f"c{i}") for i in range(n_classes)),
        heatmap=heatmap,
        card_path=Path("/nonexistent/t.card.json"),
    )


CENTERNET_OUTPUTS = (
    OutputSpec("boxes", ("b", 4, 4)),
    OutputSpec("scores", ("b", 4)),
    OutputSpec("labels", ("b", 4), "int32"),
    OutputSpec("heatmap", ("b", 2, 8, 8)),
)


def centernet_outputs() -> dict[str, np.ndarray]:
    boxes = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    scores = np.array([[0.9, 0.5, 0.31, 0.1], [0.2, 0.1, 0.05, 0.0]], np.float32)
    labels = np.array([[0, 1, 1, 0], [1, 1, 0, 0]], np.int32)
    heat = np.linspace(-3, 3, 2 * 2 * 8 * 8, dtype=np.float32).reshape(2, 2, 8, 8)
    return {"boxes": boxes, "scores": scores, "labels": labels, "heatmap": heat}


def test_centernet_keeps_scores_at_or_above_threshold_per_tile():
    card = make_card(
        "centernet", CENTERNET_OUTPUTS, HeatmapSpec("heatmap", 8, ("x", "y"), "none"), score_threshold=0.31
    )
    out = centernet_outputs()
    dets = decode(out, card)
    assert len(dets) == 2
    first, second = dets
    np.testing.assert_array_equal(first.scores, out["scores"][0, :3])
    np.testing.assert_array_equal(first.boxes, out["boxes"][0, :3])
    assert first.labels.dtype == np.int64 and first.labels.tolist() == [0, 1, 1]
    assert first.boxes.dtype == np.float32 and first.scores.dtype == np.float32
    assert len(second) == 0 and second.boxes.shape == (0, 4)
    # activation "none": the heatmap comes back as the model wrote it, per tile
    np.testing.assert_array_equal(second.heatmap, out["heatmap"][1])


def test_centernet_max_detections_and_sigmoid_heatmap():
    card = make_card(
        "centernet",
        CENTERNET_OUTPUTS,
        HeatmapSpec("heatmap", 8, ("x", "y"), "sigmoid"),
        score_threshold=0.0,
        max_detections=2,
    )
    out = centernet_outputs()
    dets = decode(out, card)
    assert [len(d) for d in dets] == [2, 2]
    np.testing.assert_allclose(dets[0].heatmap, 1 / (1 + np.exp(-out["heatmap"][0])), rtol=1e-6)
    assert dets[0].heatmap.shape == (2, 8, 8)


def test_softmax_heatmap_sums_to_one_over_channels():
    card = make_card("centernet", CENTERNET_OUTPUTS, HeatmapSpec("heatmap", 8, ("x", "y"), "softmax"))
    dets = decode(centernet_outputs(), card)
    np.testing.assert_allclose(dets[0].heatmap.sum(axis=0), 1.0, rtol=1e-5)


BSL_OUTPUTS = (
    OutputSpec("dets", ("b", 3, 4)),
    OutputSpec("conf", ("b", 3)),
    OutputSpec("cls", ("b", 3), "int64"),
    OutputSpec("count", ("b",), "int64"),
)


def test_boxes_scores_labels_formats_offset_padding_and_normalisation():
    card = make_card(
        "boxes_scores_labels",
        BSL_OUTPUTS,
        boxes="dets",
        scores="conf",
        labels="cls",
        num_detections="count",
        box_format="cxcywh",
        normalized=True,
        label_offset=-1,
        score_threshold=0.25,
        tile_px=100,
    )
    out = {
        "dets": np.array(
            [
                [[0.5, 0.5, 0.2, 0.4], [0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.1, 0.1]],
                [[0.5, 0.5, 1.0, 1.0], [0, 0, 0, 0], [0, 0, 0, 0]],
            ],
            np.float32,
        ),
        "conf": np.array([[0.3, 0.9, 0.8], [0.7, 0.9, 0.9]], np.float32),
        "cls": np.array([[2, 0, 1], [1, 1, 1]], np.int64),
        "count": np.array([3, 1], np.int64),
    }
    first, second = decode(out, card)
    # row 1 has label 0 -> -1 after the offset: background/padding, dropped
    np.testing.assert_allclose(first.boxes, [[25, 25, 35, 35], [40, 30, 60, 70]], atol=1e-4)
    assert first.scores.tolist() == pytest.approx([0.8, 0.3])
    assert first.labels.tolist() == [0, 1]
    # only the first row of tile 2 is valid (count 1), though the padding scores high
    assert len(second) == 1
    np.testing.assert_allclose(second.boxes, [[0, 0, 100, 100]])


def test_boxes_scores_labels_accepts_unbatched_outputs_as_one_tile():
    card = make_card(
        "boxes_scores_labels",
        (OutputSpec("boxes", (3, 4)), OutputSpec("scores", (3,)), OutputSpec("labels", (3,), "int64")),
        box_format="xywh",
    )
    dets = decode(
        {
            "boxes": np.array([[1, 2, 3, 4]] * 3, np.float32),
            "scores": np.array([0.1, 0.5, 0.2], np.float32),
            "labels": np.array([0, 1, 0]),
        },
        card,
    )
    assert len(dets) == 1
    np.testing.assert_array_equal(dets[0].boxes[0], [1, 2, 4, 6])
    assert dets[0].scores.tolist() == pytest.approx([0.5, 0.2, 0.1])
    assert dets[0].heatmap is None


def _yolo_rows() -> np.ndarray:
    return np.array(
        [
            [10, 10, 8, 8, 0.90, 0.05],  # kept
            [11, 10, 8, 8, 0.80, 0.10],  # same class, IoU ~0.78 with row 0: suppressed
            [10, 11, 8, 8, 0.10, 0.70],  # other class over row 0: kept (class-aware NMS)
            [40, 40, 4, 2, 0.30, 0.20],  # alone: kept
            [50, 50, 4, 4, 0.01, 0.02],  # below threshold
        ],
        np.float32,
    )


def test_yolo_thresholds_and_runs_class_aware_nms_per_tile():
    card = make_card("yolo", (OutputSpec("output0", ("b", 6, 5)),), score_threshold=0.25, iou_threshold=0.5)
    rows = _yolo_rows()
    raw = np.stack([rows.T, rows.T * np.array([[1], [1], [1], [1], [0], [0]], np.float32)])
    first, second = decode({"output0": raw}, card)
    assert first.scores.tolist() == pytest.approx([0.9, 0.7, 0.3])
    assert first.labels.tolist() == [0, 1, 0]
    np.testing.assert_allclose(first.boxes, [[6, 6, 14, 14], [6, 7, 14, 15], [38, 39, 42, 41]])
    assert len(second) == 0


def test_yolo_channels_last_with_objectness():
    card = make_card(
        "yolo",
        (OutputSpec("out", ("b", 2, 7)),),
        output="out",
        channels_last=True,
        objectness=True,
        score_threshold=0.5,
    )
    raw = np.array([[[10, 10, 4, 4, 0.5, 0.9, 0.1], [30, 30, 4, 4, 1.0, 0.2, 0.8]]], np.float32)
    (det,) = decode({"out": raw}, card)
    # 0.5 * 0.9 = 0.45 is under the threshold; 1.0 * 0.8 passes
    assert det.scores.tolist() == pytest.approx([0.8])
    assert det.labels.tolist() == [1]


def test_yolo_wrong_width_names_expected_layout():
    card = make_card("yolo", (OutputSpec("output0", ("b", 6, 5)),), n_classes=3)
    with pytest.raises(ModelError, match=r"expected \[B, 7, N\] for 3 classes"):
        decode({"output0": np.zeros((1, 6, 5), np.float32)}, card)


def test_missing_output_is_a_model_error_naming_it():
    card = make_card("centernet", CENTERNET_OUTPUTS)
    out = centernet_outputs()
    del out["scores"]
    with pytest.raises(ModelError, match="'scores' missing"):
        decode(out, card)


def test_mismatched_shapes_are_refused():
    card = make_card("centernet", CENTERNET_OUTPUTS)
    out = centernet_outputs()
    out["scores"] = out["scores"][:, :3]
    with pytest.raises(ModelError, match="expected boxes"):
        decode(out, card)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"nms": 0.5}, "unknown key"),
        ({"score_threshold": "high"}, "expected int or float"),
        ({"score_threshold": 1.5}, r"in \[0, 1\]"),
        ({"boxes": "nope"}, "expected one of the outputs"),
    ],
)
def test_bad_decoder_params_are_config_errors(params, message):
    card = make_card("centernet", CENTERNET_OUTPUTS, **params)
    with pytest.raises(ModelError, match=message):
        validate_decoder_params(card)


def test_empty_tile_detections():
    empty = TileDetections.empty()
    assert len(empty) == 0 and empty.boxes.shape == (0, 4) and empty.labels.dtype == np.int64


def _reference_ranked(boxes, scores, labels, valid, iou=None, limit=None):
    """Slow reference: each tile on its own, as a per-tile decoder would do it."""
    from wsi_pipeline.inference.decoders import nms_per_class

    out = []
    for i in range(boxes.shape[0]):
        keep = np.flatnonzero(valid[i])
        keep = keep[np.argsort(-scores[i][keep], kind="stable")]
        if iou is not None and keep.size > 1:
            keep = keep[nms_per_class(boxes[i][keep], scores[i][keep], labels[i][keep], iou)]
        if limit is not None:
            keep = keep[:limit]
        out.append((boxes[i][keep], scores[i][keep], labels[i][keep]))
    return out


@pytest.mark.parametrize("iou, limit", [(None, None), (None, 3), (0.3, None), (0.3, 2)])
def test_batched_centernet_equals_a_per_tile_reference(iou, limit):
    from wsi_pipeline.inference.decoders import decode_batch

    rng = np.random.default_rng(7)
    n, k = 9, 40
    xy = rng.uniform(0, 50, (n, k, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + rng.uniform(2, 14, (n, k, 2)).astype(np.float32)], axis=2)
    scores = rng.choice([0.2, 0.35, 0.5, 0.8, np.nan], (n, k)).astype(np.float32)  # ties, NaN
    scores[3] = 0.1  # a tile with nothing kept
    labels = rng.integers(0, 2, (n, k)).astype(np.int32)
    params = {"score_threshold": 0.3, "iou_threshold": iou, "max_detections": limit}
    card = make_card("centernet", CENTERNET_OUTPUTS[:3], **params)
    outputs = {"boxes": boxes, "scores": scores, "labels": labels}
    want = _reference_ranked(boxes, scores, labels, scores >= 0.3, iou, limit)
    got = decode(outputs, card)
    batch = decode_batch(outputs, card)
    assert batch.counts.tolist() == [len(w[0]) for w in want] and batch.counts[3] == 0
    for g, (b, s, lab) in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.boxes, b)
        np.testing.assert_array_equal(g.scores, s)
        np.testing.assert_array_equal(g.labels, lab)
        assert g.boxes.dtype == np.float32 and g.scores.dtype == np.float32 and g.labels.dtype == np.int64


def test_batched_boxes_scores_labels_equals_a_per_tile_reference():
    rng = np.random.default_rng(8)
    n, k = 6, 30
    boxes = rng.uniform(0, 60, (n, k, 4)).astype(np.float32)
    boxes[0, 2, 1] = np.nan
    scores = rng.choice([0.0, 0.4, 0.6, 0.9], (n, k)).astype(np.float32)
    labels = rng.integers(0, 3, (n, k)).astype(np.int64)  # label_offset -1: 0 becomes padding
    num = rng.integers(0, k + 1, n).astype(np.int64)
    outputs = {"boxes": boxes, "scores": scores, "labels": labels, "num": num}
    card = make_card(
        "boxes_scores_labels",
        (
            OutputSpec("boxes", ("b", k, 4)),
            OutputSpec("scores", ("b", k)),
            OutputSpec("labels", ("b", k), "int64"),
            OutputSpec("num", ("b",), "int64"),
        ),
        num_detections="num",
        score_threshold=0.4,
        label_offset=-1,
    )
    lab = labels - 1
    valid = (scores >= 0.4) & (lab >= 0) & np.isfinite(boxes).all(axis=2) & (np.arange(k)[None] < num[:, None])
    want = _reference_ranked(boxes, scores, lab, valid)
    for g, (b, s, lb) in zip(decode(outputs, card), want, strict=True):
        np.testing.assert_array_equal(g.boxes, b)
        np.testing.assert_array_equal(g.scores, s)
        np.testing.assert_array_equal(g.labels, lb)


def test_every_decoder_drops_negative_labels_and_non_finite_boxes_by_one_rule():
    """A row of label -3 (or with a NaN box) is no detection, whichever decoder reads it."""
    boxes = np.array([[[1, 1, 9, 9], [2, 2, 8, 8], [3, np.nan, 7, 7], [4, 4, 6, 6]]], np.float32)
    scores = np.array([[0.9, 0.8, 0.7, 0.6]], np.float32)
    labels = np.array([[0, -3, 1, 1]], np.int64)
    outputs = {"boxes": boxes, "scores": scores, "labels": labels}
    centernet = make_card("centernet", CENTERNET_OUTPUTS[:3], score_threshold=0.5)
    bsl = make_card(
        "boxes_scores_labels",
        (OutputSpec("boxes", ("b", 4, 4)), OutputSpec("scores", ("b", 4)), OutputSpec("labels", ("b", 4), "int64")),
        score_threshold=0.5,
    )
    for card in (centernet, bsl):
        (det,) = decode(outputs, card)
        assert det.labels.tolist() == [0, 1] and det.scores.tolist() == pytest.approx([0.9, 0.6]), card.decoder
    yolo = make_card("yolo", (OutputSpec("output0", ("b", 6, 2)),), score_threshold=0.25, iou_threshold=0.5)
    rows = np.array([[10, 10, 4, 4, 0.9, 0.1], [np.nan, 30, 4, 4, 0.8, 0.1]], np.float32)
    (det,) = decode({"output0": rows.T[None]}, yolo)
    assert det.scores.tolist() == pytest.approx([0.9])


def test_first_by_key_equals_a_stable_sort_cut_short():
    from wsi_pipeline.inference.decoders import first_by_key

    rng = np.random.default_rng(3)
    key = rng.choice([-0.9, -0.5, -0.5, -0.2, np.inf], (5, 400))  # ties everywhere, invalid rows (inf)
    for k in (0, 1, 7, 30, 49, 400):
        np.testing.assert_array_equal(first_by_key(key, k), np.argsort(key, axis=1, kind="stable")[:, :k])


@pytest.mark.parametrize("decoder", ["centernet", "boxes_scores_labels", "yolo"])
def test_a_million_boxes_a_tile_are_cut_to_the_cards_cap_and_counted(decoder):
    import dataclasses

    from wsi_pipeline.inference.decoders import decode_batch

    n = 1_000_000
    rng = np.random.default_rng(5)
    scores = rng.random((1, n), dtype=np.float32)
    xy = rng.uniform(0, 50, (1, n, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + 4], axis=2)
    if decoder == "yolo":
        rows = np.concatenate([xy + 2, np.full((1, n, 2), 4, np.float32), scores[..., None]], axis=2)
        outs = (OutputSpec("out", ("b", n, 5)),)
        card = make_card("yolo", outs, n_classes=1, output="out", channels_last=True, score_threshold=0.0)
        outputs = {"out": rows}
    else:
        outs = (OutputSpec("boxes", ("b", n, 4)), OutputSpec("scores", ("b", n)), OutputSpec("labels", ("b", n)))
        card = make_card(decoder, outs, score_threshold=0.0)
        outputs = {"boxes": boxes, "scores": scores, "labels": np.zeros((1, n), np.int64)}
    batch = decode_batch(outputs, dataclasses.replace(card, max_detections_per_tile=500))
    assert batch.over_cap_total == n - 500
    assert len(batch.scores) <= 500  # yolo's NMS and its max_detections (300) come after the cap
    if decoder != "yolo":
        np.testing.assert_array_equal(batch.scores, np.sort(scores[0])[::-1][:500])


@pytest.mark.parametrize("seed", range(4))
def test_per_tile_nms_is_the_slide_nms_and_keeps_what_opencv_kept(seed):
    """One NMS: a tile's class-aware NMS is the stitcher's global_nms, and keeps what OpenCV's
    NMSBoxesBatched (the per-tile NMS before) kept, in the same order (ties in row order)."""
    import cv2

    from wsi_pipeline.boxes import global_nms
    from wsi_pipeline.inference.decoders import nms_per_class

    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 60, (80, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(4, 20, (80, 2))], axis=1).astype(np.float32)
    scores = rng.choice([0.3, 0.5, 0.7, 0.9], 80) + rng.uniform(0, 1e-3, 80) * (seed % 2)  # ties when even
    labels = rng.integers(0, 3, 80)
    got = nms_per_class(boxes, scores, labels, 0.4)
    np.testing.assert_array_equal(got, global_nms(boxes, scores, labels, iou_threshold=0.4))
    rects = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1).astype(np.float64)
    kept = np.asarray(cv2.dnn.NMSBoxesBatched(rects.tolist(), scores.tolist(), labels.tolist(), -1.0, 0.4), np.int64)
    np.testing.assert_array_equal(got, kept[np.argsort(-scores[kept], kind="stable")])


def test_per_tile_nms_of_boxes_that_are_not_numbers_is_a_model_error():
    from wsi_pipeline.inference.decoders import nms_per_class

    boxes = np.array([[0, 0, 10, 10], [np.nan, 0, 10, 10]], np.float32)
    with pytest.raises(ModelError, match="NaN or infinity"):
        nms_per_class(boxes, np.array([0.9, 0.8]), np.array([0, 0]), 0.5)
