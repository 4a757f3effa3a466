"""Slides of extreme aspect ratio: a band as wide as a very wide slide is refused up front, saying why;
a very tall one runs in a band a tile wide."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.toy_models import build_toy_model

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import SlideError
from wsi_pipeline.stitch import blend
from wsi_pipeline.stitch.blend import BlendGeometry, HeatmapBlender, band_bytes

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def toy_card(tmp_path_factory):
    return build_toy_model(tmp_path_factory.mktemp("toy"), "boxes_scores_labels")


def test_band_bytes_are_those_the_blender_allocates():
    g = BlendGeometry(n_rows=5, n_cols=7, tile_size_out=8, step_out=6, out_height=30, out_width=40)
    blender = HeatmapBlender(g, 3, np.ones((8, 8), np.float32), lambda y0, rows: None)
    acc, weights = blender.buffer_shapes
    assert band_bytes(g, 3) == 4 * (np.prod(acc) + np.prod(weights))


def test_a_slide_too_wide_for_its_band_is_refused_before_any_allocation(toy_card, monkeypatch):
    monkeypatch.setattr(blend, "MAX_BAND_BYTES", 1 << 20)
    wide = np.full((1, 400_000, 3), 200, np.uint8)  # 1 x 400,000 px: 2.3 MiB of band
    with Pipeline.from_card(toy_card.card_path, backend="ort", tissue="all", overlap=8) as p:
        with pytest.raises(SlideError, match=r"400000 x 1 px: the heatmap is blended in bands as wide as the slide"):
            p.run(wide)


def test_a_tall_slide_one_pixel_wide_runs_in_a_band_one_tile_wide(toy_card, monkeypatch):
    monkeypatch.setattr(blend, "MAX_BAND_BYTES", 1 << 20)
    tall = np.full((20_000, 1, 3), 200, np.uint8)
    with Pipeline.from_card(toy_card.card_path, backend="ort", tissue="all", overlap=8) as p:
        result = p.run(tall, keep_heatmap=True)
    assert result.heatmap.shape[1:] == (20_000 // 8, 1)
    assert result.summary["tiles"]["grid"][1] == 1
