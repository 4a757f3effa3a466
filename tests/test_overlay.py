"""Overlay rendering and PNG writing."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from wsi_pipeline.io.overlay import render_overlay, write_png


def test_heatmap_and_boxes_land_where_their_level0_coordinates_say(tmp_path):
    # Slide 1600 x 1200 level-0 px; thumbnail at downsample 8 (200 x 150);
    # heatmap at 32 level-0 px per pixel (50 x 37), hot over level-0 x 640..960, y 320..640.
    thumb = np.full((150, 200, 3), 200, dtype=np.uint8)
    heat = np.zeros((2, 38, 50), dtype=np.float32)
    heat[1, 10:20, 20:30] = 0.9
    boxes = np.array([[80, 800, 400, 1040], [1200, 80, 1440, 240]], dtype=np.float32)
    colors = [(255, 0, 0), (0, 0, 255)]
    out = render_overlay(thumb, 8.0, heat, 32.0, boxes, np.array([0, 1]), colors, alpha=0.5)

    assert out.shape == thumb.shape and out.dtype == np.uint8
    assert (thumb == 200).all(), "the input is left untouched"
    hot = out[45:75, 85:115]  # thumbnail px of level-0 (680..920, 360..600), inside the hot area
    assert (hot != 200).any(axis=2).all()
    colormapped = cv2.cvtColor(cv2.applyColorMap(np.array([[230]], np.uint8), cv2.COLORMAP_JET), cv2.COLOR_BGR2RGB)
    np.testing.assert_allclose(hot[10, 10], 0.5 * 200 + 0.5 * colormapped[0, 0].astype(float), atol=2)
    assert (out[:30, :60] == 200).all()  # cold and no box: unchanged
    # Box outlines in the class colours, at level-0 / 8.
    assert tuple(out[100, 10]) == (255, 0, 0) and tuple(out[129, 30]) == (255, 0, 0)
    assert tuple(out[10, 150]) == (0, 0, 255) and tuple(out[20, 179]) == (0, 0, 255)
    assert tuple(out[115, 30]) == (200, 200, 200)  # inside the box, not on its outline

    path = write_png(tmp_path / "overlay.png", out)
    back = cv2.cvtColor(cv2.imread(str(path), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    np.testing.assert_array_equal(back, out)
    assert [p.name for p in tmp_path.iterdir()] == ["overlay.png"]


def test_overlay_without_heatmap_or_boxes_is_the_thumbnail():
    thumb = np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    np.testing.assert_array_equal(render_overlay(thumb, 4.0), thumb)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="thumbnail"):
        render_overlay(np.zeros((10, 10), dtype=np.uint8), 1.0)
    with pytest.raises(ValueError, match="uint8"):
        write_png("/tmp/never.png", np.zeros((4, 4, 3), dtype=np.float32))


def test_box_outlines_equal_cv2_rectangle_per_box():
    """The vectorised outline drawing against OpenCV drawing one box at a time (the reference)."""
    from wsi_pipeline.io.overlay import draw_box_outlines

    rng = np.random.default_rng(5)
    n = 400
    x0 = rng.integers(-30, 140, n)
    y0 = rng.integers(-30, 110, n)
    corners = np.stack([x0, y0, x0 + rng.integers(0, 40, n), y0 + rng.integers(0, 40, n)], 1)
    corners[:5] = [[-100, -100, 500, 500], [10, 10, 10, 10], [50, 20, 51, 21], [119, 89, 130, 95], [0, 0, 1, 200]]
    colors = rng.integers(0, 255, (n, 3), dtype=np.uint8)
    want = np.zeros((90, 120, 3), np.uint8)
    for (a, b, c, d), col in zip(corners.tolist(), colors.tolist(), strict=True):
        cv2.rectangle(want, (a, b), (max(a, c - 1), max(b, d - 1)), tuple(col), 1)
    got = np.zeros_like(want)
    draw_box_outlines(got, corners, colors)
    np.testing.assert_array_equal(got, want)


def _many_boxes(n: int, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xy = rng.uniform(-50, 4000, (n, 2))
    return np.concatenate([xy, xy + rng.uniform(1, 120, (n, 2))], axis=1), rng.integers(-1, 3, n)


def test_boxes_drawn_a_chunk_at_a_time_equal_all_at_once(monkeypatch):
    from wsi_pipeline.io import overlay

    boxes, labels = _many_boxes(3000)
    thumb = np.zeros((500, 500, 3), np.uint8)
    whole = overlay.render_overlay(thumb, 8.0, boxes=boxes, labels=labels, class_colors=[(255, 0, 0), (0, 255, 0)])
    monkeypatch.setattr(overlay, "BOX_CHUNK", 7)  # later chunks over earlier ones, as later boxes over earlier
    chunked = overlay.render_overlay(thumb, 8.0, boxes=boxes, labels=labels, class_colors=[(255, 0, 0), (0, 255, 0)])
    np.testing.assert_array_equal(chunked, whole)


def _drawing_peak(n: int) -> int:
    import tracemalloc

    from wsi_pipeline.io.overlay import render_overlay

    boxes, labels = _many_boxes(n)
    thumb = np.zeros((500, 500, 3), np.uint8)
    tracemalloc.start()
    try:
        render_overlay(thumb, 8.0, boxes=boxes, labels=labels)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_memory_of_drawing_boxes_does_not_grow_with_their_number():
    from wsi_pipeline.io.overlay import BOX_CHUNK

    few, many = _drawing_peak(2 * BOX_CHUNK), _drawing_peak(8 * BOX_CHUNK)
    assert many < 1.3 * few, f"{few / 1e6:.0f} MB for {2 * BOX_CHUNK} boxes, {many / 1e6:.0f} MB for 4x as many"
