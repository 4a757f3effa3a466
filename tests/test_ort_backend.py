"""ONNX Runtime backend: batching, input checks, and a user's own ONNX + card running end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.toy_models import TOY_BOXES, TOY_LABELS, TOY_SCORES, build_toy_model

from wsi_pipeline.errors import ConfigError
from wsi_pipeline.inference import create_backend, decode
from wsi_pipeline.inference.backend import Backend
from wsi_pipeline.inference.ort_backend import OrtBackend

pytest.importorskip("onnx")

ENGINES = Path(__file__).resolve().parents[1] / "engines"


def tiles(n: int, tile_px: int = 32) -> np.ndarray:
    """Tile i has brightest pixel 255 * (i + 1) / n."""
    out = np.zeros((n, tile_px, tile_px, 3), np.uint8)
    for i in range(n):
        out[i, 0, 0, 0] = round(255 * (i + 1) / n)
    return out


def test_user_boxes_scores_labels_model_runs_through_factory(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels", score_threshold=0.25)
    backend = create_backend(card.card_path, "ort", max_batch=4)
    assert isinstance(backend, Backend)
    batch = tiles(2)
    dets = decode(backend.infer(batch), card)
    assert len(dets) == 2
    # tile 0: brightness 0.5 -> scores 0.45, 0.3 pass 0.25, 0.1 does not
    np.testing.assert_allclose(dets[0].scores, TOY_SCORES[:2] * (128 / 255), rtol=1e-5)
    np.testing.assert_array_equal(dets[0].boxes, TOY_BOXES[:2])
    np.testing.assert_array_equal(dets[0].labels, TOY_LABELS[:2])
    np.testing.assert_allclose(dets[1].scores, TOY_SCORES[:2], rtol=1e-5)
    assert dets[1].heatmap.shape == (1, 4, 4)
    np.testing.assert_allclose(dets[1].heatmap, 1.0)


def test_user_yolo_model_runs_with_nms(tmp_path):
    card = build_toy_model(tmp_path, "yolo", score_threshold=0.25, iou_threshold=0.5)
    backend = OrtBackend(card, max_batch=2)
    (det,) = decode(backend.infer(tiles(1)), card)
    assert det.scores.tolist() == pytest.approx([0.9, 0.7, 0.3])
    assert det.labels.tolist() == [0, 1, 0]


def test_batches_larger_than_max_batch_are_split_and_reassembled(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels")
    batch = tiles(7)
    one = OrtBackend(card, max_batch=7).infer(batch)
    split = OrtBackend(card, max_batch=3).infer(batch)
    for name in one:
        assert split[name].shape[0] == 7
        np.testing.assert_array_equal(split[name], one[name])
    # each tile's result is its own: scores follow the tile brightness
    np.testing.assert_allclose(split["scores"][:, 0], 0.9 * np.round(255 * np.arange(1, 8) / 7) / 255, rtol=1e-5)


def test_empty_batch_returns_empty_outputs(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels")
    out = OrtBackend(card).infer(np.zeros((0, 32, 32, 3), np.uint8))
    assert out["boxes"].shape == (0, 3, 4) and out["heatmap"].shape == (0, 1, 4, 4)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 32, 32, 3), np.float32),
        np.zeros((2, 64, 64, 3), np.uint8),
        np.zeros((32, 32, 3), np.uint8),
    ],
)
def test_wrong_tiles_are_refused_with_expected_shape(tmp_path, bad):
    card = build_toy_model(tmp_path, "boxes_scores_labels")
    with pytest.raises(ConfigError, match="expected a N x 32 x 32 x 3 uint8 array"):
        OrtBackend(card).infer(bad)


def test_unknown_backend_name_is_a_config_error(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels")
    with pytest.raises(ConfigError, match="backend: expected one of"):
        create_backend(card, "cuda-magic")


def test_session_is_configured_for_throughput(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels")
    backend = OrtBackend(card, max_batch=2, intra_op_threads=1)
    assert backend.providers == ["CPUExecutionProvider"]
    assert backend.max_batch == 2


def test_shipped_pathology_model_outputs_fixed_size_results():
    backend = create_backend(ENGINES / "nuclei_pathology.card.json", max_batch=2, intra_op_threads=2)
    out = backend.infer(np.full((3, 512, 512, 3), 240, np.uint8))
    k = backend.card.output("boxes").shape[1]
    assert out["boxes"].shape == (3, k, 4) and out["boxes"].dtype == np.float32
    assert out["scores"].shape == (3, k) and out["labels"].dtype == np.int32
    assert out["heatmap"].shape == (3, 2, 64, 64)
    assert np.all(np.diff(out["scores"], axis=1) <= 0)  # TopK: sorted
    assert np.all((out["boxes"] >= 0) & (out["boxes"] <= 512))
    # a blank white tile is background: no nuclei, no tissue
    dets = decode(out, backend.card)
    assert all(len(d) == 0 for d in dets)
    assert float(dets[0].heatmap.max()) < 0.5
