"""Overlay pictures: a slide thumbnail with the heatmap and the boxes drawn on it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import cv2
import numpy as np

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.atomic import atomic_write

Color = tuple[int, int, int]
_DEFAULT_COLOR: Color = (255, 255, 0)


def _class_color(class_colors: Mapping[int, Color] | Sequence[Color] | None, label: int) -> Color:
    if class_colors is None:
        return _DEFAULT_COLOR
    if isinstance(class_colors, Mapping):
        return tuple(int(v) for v in class_colors.get(label, _DEFAULT_COLOR))  # type: ignore[return-value]
    if 0 <= label < len(class_colors):
        return tuple(int(v) for v in class_colors[label])  # type: ignore[return-value]
    return _DEFAULT_COLOR


# Boxes drawn at a time: memory of the outlines of this many, whatever the slide's count.
BOX_CHUNK = 1 << 16


def render_overlay(
    thumbnail: np.ndarray,
    thumb_downsample: float,
    heatmap: np.ndarray | None = None,
    heatmap_scale_level0: float = 1.0,
    boxes: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    class_colors: Mapping[int, Color] | Sequence[Color] | None = None,
    alpha: float = 0.45,
    threshold: float = 0.05,
    colormap: int = cv2.COLORMAP_JET,
    line_thickness: int = 1,
) -> np.ndarray:
    """Draw a heatmap and boxes over a thumbnail.

    Args:
        thumbnail: H x W x 3 uint8 RGB.
        thumb_downsample: level-0 pixels per thumbnail pixel.
        heatmap: C x h x w float in [0, 1] (values outside are clipped), or
            None; the channels' maximum is shown.
        heatmap_scale_level0: level-0 pixels per heatmap pixel
            (downsample x stride).
        boxes: N x 4 (x0, y0, x1, y1) level-0 pixels, or None.
        labels: N int class ids for the box colours, or None.
        class_colors: RGB colour per class id (a sequence indexed by id or a
            mapping); unknown ids are drawn yellow.
        alpha: heatmap opacity where it is shown.
        threshold: heatmap values at or below this are not drawn.
        colormap: an OpenCV colormap id.
        line_thickness: box outline in thumbnail pixels.

    Returns:
        H x W x 3 uint8 RGB, a new array.
    """
    thumbnail = np.asarray(thumbnail)
    if thumbnail.ndim != 3 or thumbnail.shape[2] != 3 or thumbnail.dtype != np.uint8:
        msg = f"thumbnail: expected an H x W x 3 uint8 array, found {thumbnail.shape} {thumbnail.dtype}"
        raise ValueError(msg)
    if thumb_downsample <= 0 or heatmap_scale_level0 <= 0:
        msg = "thumb_downsample and heatmap_scale_level0: expected > 0"
        raise ValueError(msg)
    out = thumbnail.copy()
    th, tw = out.shape[:2]

    if heatmap is not None:
        heatmap = np.asarray(heatmap, dtype=np.float32)
        if heatmap.ndim == 2:
            heatmap = heatmap[None]
        if heatmap.ndim != 3:
            msg = f"heatmap: expected C x H x W, found shape {heatmap.shape}"
            raise ValueError(msg)
        value = np.clip(heatmap.max(axis=0), 0.0, 1.0)
        # Thumbnail pixel (x, y) centre is level-0 (x + 0.5) * thumb_downsample,
        # i.e. heatmap pixel (x + 0.5) * thumb_downsample / heatmap_scale - 0.5.
        s = thumb_downsample / heatmap_scale_level0
        m = np.array([[s, 0, 0.5 * s - 0.5], [0, s, 0.5 * s - 0.5]], dtype=np.float64)
        value = cv2.warpAffine(
            value,
            m,
            (tw, th),
            flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
            borderMode=cv2.BORDER_CONSTANT,
            borderValue=0.0,
        )
        colored = cv2.applyColorMap(np.rint(value * 255).astype(np.uint8), colormap)
        colored = cv2.cvtColor(colored, cv2.COLOR_BGR2RGB)
        shown = value > threshold
        # Whole-image blend (OpenCV rounds and saturates), kept where the heatmap is shown.
        blended = cv2.addWeighted(out, 1 - alpha, colored, alpha, 0.0)
        np.copyto(out, blended, where=shown[:, :, None])

    if boxes is not None and len(boxes):
        boxes = np.asarray(boxes)
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            msg = f"boxes: expected an N x 4 array (x0, y0, x1, y1), found shape {boxes.shape}"
            raise ValueError(msg)
        label_ids = np.zeros(len(boxes), np.int64) if labels is None else np.asarray(labels, np.int64)
        colors = np.array(
            [_class_color(class_colors, int(v)) for v in range(int(label_ids.max(initial=0)) + 1)] + [_DEFAULT_COLOR],
            np.uint8,
        )
        # A chunk of boxes at a time, in order (later boxes still drawn over earlier ones): the outline
        # arrays of millions of boxes at once took gigabytes.
        for a in range(0, len(boxes), BOX_CHUNK):
            corners = np.rint(boxes[a : a + BOX_CHUNK].astype(np.float64) / thumb_downsample).astype(np.int64)
            part_labels = label_ids[a : a + BOX_CHUNK]
            box_colors = colors[np.where(part_labels >= 0, part_labels, len(colors) - 1)]
            if line_thickness == 1:
                draw_box_outlines(out, corners, box_colors)
                continue
            for (x0, y0, x1, y1), color in zip(corners.tolist(), box_colors.tolist(), strict=True):
                # cv2 draws the closing corner inclusive: stop one pixel short.
                cv2.rectangle(out, (x0, y0), (max(x0, x1 - 1), max(y0, y1 - 1)), tuple(color), line_thickness)
    return out


def draw_box_outlines(image: np.ndarray, corners: np.ndarray, colors: np.ndarray) -> None:
    """Draw 1-px box outlines into ``image`` in place, as ``cv2.rectangle`` does, for all boxes at once.

    ``image``: H x W x 3 uint8; ``corners``: N x 4 int (x0, y0, x1, y1) image
    pixels, the far corner exclusive (the outline's last column is
    ``max(x0, x1 - 1)``); ``colors``: N x 3 uint8. Pixels outside the image
    are clipped; where outlines cross, the later box's colour wins. One pass
    over every outline pixel instead of one OpenCV call per box: a slide's
    10^5-10^6 boxes take milliseconds.
    """
    if not len(corners):
        return
    h, w = image.shape[:2]
    x0, y0 = corners[:, 0], corners[:, 1]
    x1, y1 = np.maximum(x0, corners[:, 2] - 1), np.maximum(y0, corners[:, 3] - 1)
    # Visible spans only, so a huge box costs its visible outline, not its claimed size.
    cx0, cx1 = np.clip(x0, 0, w - 1), np.clip(x1, 0, w - 1)
    cy0, cy1 = np.clip(y0, 0, h - 1), np.clip(y1, 0, h - 1)
    n = len(corners)
    order = np.arange(n)
    parts_y, parts_x, parts_box = [], [], []
    for fixed, lo, hi, vertical, visible in (
        (y0, cx0, cx1, False, (y0 >= 0) & (y0 < h) & (x1 >= 0) & (x0 < w)),
        (y1, cx0, cx1, False, (y1 >= 0) & (y1 < h) & (x1 >= 0) & (x0 < w)),
        (x0, cy0, cy1, True, (x0 >= 0) & (x0 < w) & (y1 >= 0) & (y0 < h)),
        (x1, cy0, cy1, True, (x1 >= 0) & (x1 < w) & (y1 >= 0) & (y0 < h)),
    ):
        lengths = np.where(visible, hi - lo + 1, 0)
        total = int(lengths.sum())
        if not total:
            continue
        box = np.repeat(order, lengths)
        starts = np.cumsum(lengths) - lengths
        run = np.arange(total) - np.repeat(starts, lengths) + lo[box]
        along, fix = run, fixed[box]
        parts_y.append(along if vertical else fix)
        parts_x.append(fix if vertical else along)
        parts_box.append(box)
    if not parts_box:
        return
    box = np.concatenate(parts_box)
    last_first = np.argsort(box, kind="stable")  # later boxes written last
    ys, xs = np.concatenate(parts_y)[last_first], np.concatenate(parts_x)[last_first]
    image[ys, xs] = colors[box[last_first]]


def write_overlay(
    path: str | os.PathLike[str],
    thumbnail: np.ndarray,
    thumb_downsample: float,
    heatmap: np.ndarray | None,
    heatmap_scale_level0: float,
    boxes: np.ndarray | None,
    labels: np.ndarray | None,
    class_colors: Sequence[Color] | None,
) -> Path:
    """:func:`render_overlay` with its defaults, written as PNG (:func:`write_png`)."""
    img = render_overlay(thumbnail, thumb_downsample, heatmap, heatmap_scale_level0, boxes, labels, class_colors)
    return write_png(path, img)


def write_png(path: str | os.PathLike[str], image: np.ndarray) -> Path:
    """Write an H x W x 3 uint8 RGB (or H x W gray) image as PNG, atomically."""
    path = Path(path)
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        msg = f"{path}: expected an H x W x 3 or H x W uint8 image, found {image.shape} {image.dtype}"
        raise ValueError(msg)
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR) if image.ndim == 3 else image
    ok, encoded = cv2.imencode(".png", bgr)
    if not ok:
        msg = f"{path}: PNG encoding failed"
        raise WSIPipelineError(msg)
    with atomic_write(path, "wb") as f:
        f.write(encoded.tobytes())
    return path
