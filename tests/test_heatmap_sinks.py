"""The heatmap sinks' arithmetic against slow references: tissue statistics, stored values."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_pipeline.io.heatmap_rows import quantise
from wsi_pipeline.stitch.sinks import HeatmapStats
from wsi_pipeline.tiling.tissue import TissueMask


def reference_stats(heatmap: np.ndarray, scale: float, tissue: TissueMask | None, threshold: float):
    """Per pixel: its tissue membership looked up in the mask, then plain reductions over the selection."""
    c, h, w = heatmap.shape
    sel = np.zeros((h, w), bool)
    for y in range(h):
        for x in range(w):
            if tissue is None:
                sel[y, x] = True
                continue
            my = int((y + 0.5) * scale / tissue.downsample[1])
            mx = int((x + 0.5) * scale / tissue.downsample[0])
            mh, mw = tissue.mask.shape
            sel[y, x] = my < mh and mx < mw and bool(tissue.mask[my, mx])
    picked = heatmap[:, sel].astype(np.float64)
    above = (picked > threshold).sum(axis=1)
    total = picked.sum(axis=1)
    peak = np.maximum(picked.max(axis=1), 0.0) if picked.shape[1] else np.zeros(c)
    return int(sel.sum()), above, total, peak


@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("threshold", [0.5, -0.1])
def test_heatmap_stats_equal_the_per_pixel_reference(with_mask, threshold):
    rng = np.random.default_rng(11)
    c, h, w, scale = 2, 57, 45, 8.0
    heatmap = rng.uniform(-0.2, 1.0, (c, h, w)).astype(np.float32)
    heatmap[1, 3, 4] = np.nan  # outside the tissue below: must not reach the statistics
    # The mask covers less than the heatmap in both directions (the edge tiles' padding).
    mask = rng.random((30, 25)) < 0.6  # 360 x 300 level-0 px against the heatmap's 456 x 360
    mask[int(3.5 * 8 / 12), int(4.5 * 8 / 12)] = False
    tissue = TissueMask(mask, (12.0, 12.0)) if with_mask else None
    if not with_mask:
        heatmap[1, 3, 4] = 0.25
    stats = HeatmapStats(c, w, scale, tissue, threshold=threshold)
    y0 = 0
    for rows in (5, 1, 17, 30, 4):  # bands of uneven heights
        stats(y0, heatmap[:, y0 : y0 + rows])
        y0 += rows
    assert y0 == h
    n, above, total, peak = reference_stats(heatmap, scale, tissue, threshold)
    assert stats.tissue_px == n
    np.testing.assert_array_equal(stats.above, above)
    np.testing.assert_allclose(stats.sum, total, rtol=1e-12)
    np.testing.assert_array_equal(stats.max, peak)


def reference_quantise(values: np.ndarray, dtype: np.dtype, value_scale: float) -> np.ndarray:
    scaled = np.asarray(values).astype(np.float32) * np.float32(1.0 / value_scale)
    if dtype.kind == "f":
        return scaled.astype(dtype)
    info = np.iinfo(dtype)
    return np.clip(np.rint(scaled), info.min, info.max).astype(dtype)


@pytest.mark.parametrize(
    ("dtype", "value_scale"),
    [(np.dtype(np.uint8), 1 / 255), (np.dtype(np.uint16), 1 / 65535), (np.dtype(np.float16), 1.0)],
)
@pytest.mark.parametrize("source", [np.float32, np.float64])
def test_quantise_equals_the_reference(dtype, value_scale, source):
    rng = np.random.default_rng(2)
    values = rng.uniform(-0.1, 1.1, (2, 33, 17)).astype(source)
    # Exact ties: k + 0.5 stored steps round to even.
    values[0, 0, :6] = (np.arange(6) + 0.5) * value_scale
    values[1, 0, :3] = [0.0, 1.0, -1.0]
    expected = reference_quantise(values, dtype, value_scale)
    got = quantise(values, dtype, value_scale)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    out = np.full(values.shape, 7, dtype)
    assert quantise(values, dtype, value_scale, out=out) is out
    np.testing.assert_array_equal(out, expected)
