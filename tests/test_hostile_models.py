"""Hostile model outputs (NaN or infinite heatmaps, more boxes a tile than the card allows) and a slide
file replaced while its run was queued."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers.toy_models import build_toy_model

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ModelError
from wsi_pipeline.io.atomic import write_json

pytest.importorskip("onnx")


def _image(size: int = 96) -> np.ndarray:
    return np.full((size, size, 3), 200, np.uint8)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_heatmap_with_nan_or_infinity_fails_the_slide_and_writes_no_summary(tmp_path, value):
    card = build_toy_model(tmp_path, "boxes_scores_labels", heatmap_value=value)
    out = tmp_path / "out"
    with (
        Pipeline.from_card(card.card_path, backend="ort", tissue="all", overlap=8) as p,
        pytest.raises(ModelError) as info,
    ):
        p.run(_image(), out_dir=out)
    assert "NaN or infinite" in str(info.value) and "'bright'" in str(info.value)
    assert not (out / "summary.json").exists()


def test_summary_json_is_strict_json_even_with_non_finite_numbers(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"a": math.nan, "b": [1.5, math.inf, np.float32(-np.inf)], "c": {"d": np.float64(2.0)}})
    text = path.read_text()
    doc = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))
    assert doc == {"a": None, "b": [1.5, None, None], "c": {"d": 2.0}}


def _capped_card(tmp_path, cap):
    card = build_toy_model(tmp_path, "boxes_scores_labels")  # 3 boxes a tile, all kept (threshold 0)
    doc = json.loads(card.card_path.read_text())
    doc["max_detections_per_tile"] = cap
    card.card_path.write_text(json.dumps(doc))
    return card.card_path


def test_detections_past_the_cards_cap_a_tile_are_dropped_and_counted_in_the_summary(tmp_path, caplog):
    card_path = _capped_card(tmp_path, 2)
    caplog.set_level("WARNING", "wsi_pipeline")
    with Pipeline.from_card(card_path, backend="ort", tissue="all", overlap=8) as p:
        result = p.run(_image())
    n_tiles = result.summary["tiles"]["read"]
    assert n_tiles > 1 and result.summary["detections_over_cap"] == n_tiles
    assert f"{n_tiles} detections dropped" in caplog.text and "max_detections_per_tile" in caplog.text


@pytest.mark.parametrize("cap", [0, -1, 10**7, 2.5, True, "10"])
def test_an_impossible_cap_is_refused_naming_the_field(tmp_path, cap):
    from wsi_pipeline.inference.card import load_card

    with pytest.raises(ModelError, match="max_detections_per_tile"):
        load_card(_capped_card(tmp_path, cap))


def test_a_slide_replaced_after_it_was_planned_is_opened_again(tmp_path, caplog):
    import cv2

    card = build_toy_model(tmp_path, "boxes_scores_labels")
    path = tmp_path / "queued.png"
    cv2.imwrite(str(path), _image(96))
    caplog.set_level("INFO", "wsi_pipeline")
    with Pipeline.from_card(card.card_path, backend="ort", tissue="all", overlap=8) as p:
        plan = p.plan(path)  # opened ahead, as a batch does for the slides queued after the running one
        cv2.imwrite(str(path), np.full((128, 160, 3), 90, np.uint8))  # replaced in place meanwhile
        result = p.run(plan)
    assert result.summary["dimensions_level0"] == [160, 128]
    assert "changed since it was opened ahead: opened again" in caplog.text


@pytest.mark.parametrize("shape", [(200_000, 200_000, 3), (20_000_000, 20_000_000, 3)])
def test_an_array_too_large_to_copy_is_the_projects_error_not_numpys(tmp_path, shape):
    """A broadcast view claims terabytes it does not hold: the copy a slide needs is refused, naming
    the size, before anything is allocated."""
    from wsi_pipeline.errors import SlideOpenError

    card = build_toy_model(tmp_path, "boxes_scores_labels")
    huge = np.broadcast_to(np.uint8(128), shape)
    with Pipeline.from_card(card.card_path, backend="ort", tissue="all", overlap=8) as p:
        with pytest.raises(SlideOpenError, match=rf"<array>: a {shape[1]}x{shape[0]} image needs [\d.]+ GiB"):
            p.run(huge, out_dir=tmp_path / "out")
        small = np.broadcast_to(np.uint8(128), (96, 96, 3))  # a view that fits is copied and run
        assert set(p.run(small, out_dir=tmp_path / "small").summary["counts"]) == {"a", "b"}
