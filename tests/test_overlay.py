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


def _he_picture() -> tuple[np.ndarray, np.ndarray]:
    """A small H&E-like picture: pink stroma with purple nuclei; the nuclei's boxes (picture px)."""
    img = np.empty((120, 400, 3), np.uint8)
    img[:] = (225, 160, 205)  # stroma
    boxes = []
    for y in range(10, 110, 25):
        for x in range(10, 150, 25):
            cv2.circle(img, (x + 6, y + 6), 6, (95, 40, 140), -1)  # nucleus
            boxes.append([x - 1, y - 1, x + 14, y + 14])
    return img, np.array(boxes, np.float32)


def test_boxes_of_a_colour_like_what_they_surround_are_drawn_in_a_contrasting_one():
    """A purple class on purple nuclei is drawn in a colour far from the nuclei and the stroma; a
    yellow class keeps its colour."""
    from wsi_pipeline.io.overlay import MIN_CONTRAST_DELTA_E, delta_e

    img, boxes = _he_picture()
    purple, yellow = (123, 44, 191), (255, 255, 0)
    labels = np.arange(len(boxes)) % 2
    out = render_overlay(img, 1.0, boxes=boxes, labels=labels, class_colors=[purple, yellow])
    x0, y0 = boxes[0, :2].astype(int)
    drawn_0 = tuple(int(v) for v in out[y0, x0 + 3])  # top edge of a class-0 box
    drawn_1 = tuple(int(v) for v in out[int(boxes[1, 1]), int(boxes[1, 0]) + 3])
    assert drawn_1 == yellow
    assert drawn_0 not in (purple, yellow)
    assert delta_e(np.array([drawn_0]), np.array([(95, 40, 140), (225, 160, 205)])).min() >= MIN_CONTRAST_DELTA_E
    kept = render_overlay(img, 1.0, boxes=boxes, labels=labels, class_colors=[purple, yellow], contrast=False)
    assert tuple(int(v) for v in kept[y0, x0 + 3]) == purple


def test_the_legend_strip_names_the_classes_in_the_colours_drawn_and_shows_the_heatmap_scale(tmp_path):
    img, boxes = _he_picture()
    heat = np.zeros((1, 30, 100), np.float32)
    heat[0, :10, :10] = 0.8
    labels = np.zeros(len(boxes), np.int64)
    out = render_overlay(
        img,
        1.0,
        heat,
        4.0,
        boxes,
        labels,
        [(123, 44, 191)],
        legend=True,
        class_names=["nucleus"],
        heatmap_names=["tumour"],
    )
    assert out.shape == (img.shape[0] + 24, img.shape[1], 3)
    strip = out[img.shape[0] :]
    drawn = tuple(int(v) for v in out[int(boxes[0, 1]), int(boxes[0, 0]) + 3])
    assert tuple(int(v) for v in strip[12, 10]) == drawn  # the swatch: the colour the boxes have
    jet = cv2.cvtColor(cv2.applyColorMap(np.array([[255]], np.uint8), cv2.COLORMAP_JET), cv2.COLOR_BGR2RGB)[0, 0]
    assert (np.abs(strip[12].astype(int) - jet).sum(1) < 10).any()  # the scale reaches the colour of 1
    np.testing.assert_array_equal(
        render_overlay(img, 1.0, heat, 4.0, boxes, labels, [(123, 44, 191)])[:, :5], out[:120, :5]
    )


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
