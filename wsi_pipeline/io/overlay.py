"""Overlay pictures: a slide thumbnail with the heatmap and the boxes drawn on it.

Each class's boxes are drawn in its colour where that stands out against what the boxes
surround (the picture under their centres, and its tissue), else in the colour of
:data:`CONTRAST_COLORS` that stands out most (:func:`contrasting_colors`): a purple class is
not drawn purple on purple nuclei. A legend strip below the picture (optional) names the
classes in the colours drawn and shows the heatmap's colour scale.
"""

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
# Box colours that stand out on stained tissue and on the heatmap's colours, in order of preference.
CONTRAST_COLORS: tuple[Color, ...] = (
    (255, 255, 0),
    (0, 255, 0),
    (0, 255, 255),
    (255, 128, 0),
    (255, 255, 255),
    (0, 0, 0),
)
# CIELAB distance (ΔE 1976) below which a box colour is too close to what it is drawn on.
MIN_CONTRAST_DELTA_E = 60.0
_SAMPLED_BOXES = 4096  # box centres sampled per class for the colour under the boxes
_LEGEND_BACKGROUND: Color = (40, 40, 40)


def _lab(colors: np.ndarray) -> np.ndarray:
    """N x 3 uint8 RGB -> N x 3 CIELAB (L 0-100)."""
    rgb = np.asarray(colors, np.float32).reshape(1, -1, 3) / 255.0
    return cv2.cvtColor(rgb, cv2.COLOR_RGB2Lab).reshape(-1, 3)


def delta_e(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ΔE 1976 between each colour of ``a`` (N x 3 RGB) and each of ``b`` (M x 3): N x M."""
    return np.linalg.norm(_lab(a)[:, None, :] - _lab(b)[None, :, :], axis=2)


def tissue_color(thumbnail: np.ndarray) -> np.ndarray:
    """The median colour of a thumbnail's tissue: its pixels that are not near grey (all of them
    where none is)."""
    flat = thumbnail.reshape(-1, 3)
    spread = flat.max(1).astype(np.int16) - flat.min(1)
    tissue = flat[spread > 20] if (spread > 20).any() else flat
    return np.median(tissue[:: max(1, len(tissue) // 100_000)], axis=0)


def contrasting_colors(
    picture: np.ndarray,
    centers_px: np.ndarray,
    label_ids: np.ndarray,
    colors: Sequence[Color],
    tissue: np.ndarray | None = None,
) -> list[Color]:
    """Per class id, its colour, or the one of :data:`CONTRAST_COLORS` that stands out most, where
    its colour is closer than :data:`MIN_CONTRAST_DELTA_E` to what its boxes are drawn on.

    What they are drawn on: the median colour of ``picture`` (H x W x 3 RGB) under the class's box
    centres (``centers_px``: N x 2 x, y picture pixels), and the slide's ``tissue`` colour
    (default :func:`tissue_color` of ``picture``); a replacement also keeps apart from the other
    classes' colours.
    """
    h, w = picture.shape[:2]
    tissue_rgb = tissue_color(picture) if tissue is None else np.asarray(tissue, np.float64)
    out: list[Color] = [tuple(int(v) for v in c) for c in colors]  # type: ignore[misc]
    for k, color in enumerate(colors):
        centres = centers_px[label_ids == k]
        if not len(centres):
            continue
        centres = centres[:: max(1, len(centres) // _SAMPLED_BOXES)]
        xs = np.clip(centres[:, 0].astype(np.int64), 0, w - 1)
        ys = np.clip(centres[:, 1].astype(np.int64), 0, h - 1)
        under = np.stack([np.median(picture[ys, xs], axis=0), tissue_rgb])
        if delta_e(np.array([color]), under).min() >= MIN_CONTRAST_DELTA_E:
            continue
        others = np.array([c for j, c in enumerate(out) if j != k] or [tissue_rgb])
        candidates = np.array(CONTRAST_COLORS)
        score = delta_e(candidates, under).min(1) + np.where(delta_e(candidates, others).min(1) < 1, -1000, 0)
        out[k] = tuple(int(v) for v in candidates[int(np.argmax(score))])  # type: ignore[assignment]
    return out


def legend_strip(
    width: int,
    class_names: Sequence[str],
    class_colors: Sequence[Color],
    heatmap_names: Sequence[str] | None = None,
    colormap: int = cv2.COLORMAP_JET,
    threshold: float = 0.05,
) -> np.ndarray:
    """A legend ``width`` pixels wide: each class's name after a swatch of its box colour, then the
    heatmap's colour scale (``threshold``..1; its classes named, where given). H x W x 3 uint8 RGB."""
    font, scale, thick = cv2.FONT_HERSHEY_SIMPLEX, 0.45, 1
    height = 24
    strip = np.empty((height, width, 3), np.uint8)
    strip[:] = _LEGEND_BACKGROUND
    x = 6
    for name, color in zip(class_names, class_colors, strict=True):
        cv2.rectangle(strip, (x, 5), (x + 13, 18), tuple(int(v) for v in color), -1)
        cv2.putText(strip, str(name), (x + 18, 17), font, scale, (255, 255, 255), thick, cv2.LINE_AA)
        x += 18 + cv2.getTextSize(str(name), font, scale, thick)[0][0] + 14
    if heatmap_names is not None:
        label = "heatmap (" + ", ".join(heatmap_names) + ")" if heatmap_names else "heatmap"
        cv2.putText(strip, label + f" {threshold:g}", (x, 17), font, scale, (255, 255, 255), thick, cv2.LINE_AA)
        x += cv2.getTextSize(label + f" {threshold:g}", font, scale, thick)[0][0] + 4
        bar_width = 100
        values = np.linspace(threshold, 1.0, bar_width)
        bar = cv2.applyColorMap(np.rint(values * 255).astype(np.uint8).reshape(1, -1), colormap)
        bar = cv2.cvtColor(bar, cv2.COLOR_BGR2RGB)
        end = min(width, x + bar_width)
        if end > x:
            strip[5:19, x:end] = bar[:, : end - x]
        cv2.putText(strip, "1", (end + 4, 17), font, scale, (255, 255, 255), thick, cv2.LINE_AA)
    return strip


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
# Box centres sampled to choose the classes' drawing colours.
CONTRAST_SAMPLE = 200_000


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
    contrast: bool = True,
    legend: bool = False,
    class_names: Sequence[str] | None = None,
    heatmap_names: Sequence[str] | None = None,
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
        contrast: draw a class whose colour is too close to what its boxes lie on in a
            contrasting colour instead (:func:`contrasting_colors`).
        legend: add a :func:`legend_strip` below the picture (classes ``class_names``, default
            ``class_k``, in the colours drawn; the heatmap's scale, its channels
            ``heatmap_names``).

    Returns:
        H x W x 3 uint8 RGB, a new array (taller by the legend strip, with ``legend``).
    """
    thumbnail = np.asarray(thumbnail)
    if thumbnail.ndim != 3 or thumbnail.shape[2] != 3 or thumbnail.dtype != np.uint8:
        msg = f"thumbnail: expected an H x W x 3 uint8 array, found {thumbnail.shape} {thumbnail.dtype}"
        raise ValueError(msg)
    if thumb_downsample <= 0 or heatmap_scale_level0 <= 0:
        msg = "thumb_downsample and heatmap_scale_level0: expected > 0"
        raise ValueError(msg)
    out = thumbnail.copy()
    if heatmap is not None:
        _blend_heatmap(out, heatmap, thumb_downsample / heatmap_scale_level0, alpha, threshold, colormap)
    drawn: list[Color] = []
    if boxes is not None and len(boxes):
        drawn = _draw_boxes(out, thumbnail, thumb_downsample, boxes, labels, class_colors, line_thickness, contrast)
    if not legend:
        return out
    n_classes = max(len(drawn), len(class_names or ()))
    names = list(class_names or []) + [f"class_{k}" for k in range(len(class_names or ()), n_classes)]
    legend_colors = drawn + [_class_color(class_colors, k) for k in range(len(drawn), n_classes)]
    strip = legend_strip(
        out.shape[1], names, legend_colors, heatmap_names if heatmap is not None else None, colormap, threshold
    )
    return np.concatenate([out, strip], axis=0)


def _blend_heatmap(
    out: np.ndarray, heatmap: np.ndarray, scale: float, alpha: float, threshold: float, colormap: int
) -> None:
    """Blend the heatmap's channel maximum, coloured by ``colormap``, into the picture ``out`` in place
    where it is above ``threshold``; ``scale``: heatmap pixels per picture pixel."""
    th, tw = out.shape[:2]
    heatmap = np.asarray(heatmap, dtype=np.float32)
    if heatmap.ndim == 2:
        heatmap = heatmap[None]
    if heatmap.ndim != 3:
        msg = f"heatmap: expected C x H x W, found shape {heatmap.shape}"
        raise ValueError(msg)
    value = np.clip(heatmap.max(axis=0), 0.0, 1.0)
    # Thumbnail pixel (x, y) centre is level-0 (x + 0.5) * thumb_downsample,
    # i.e. heatmap pixel (x + 0.5) * thumb_downsample / heatmap_scale - 0.5.
    m = np.array([[scale, 0, 0.5 * scale - 0.5], [0, scale, 0.5 * scale - 0.5]], dtype=np.float64)
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


def _draw_boxes(
    out: np.ndarray,
    thumbnail: np.ndarray,
    thumb_downsample: float,
    boxes: np.ndarray,
    labels: np.ndarray | None,
    class_colors: Mapping[int, Color] | Sequence[Color] | None,
    line_thickness: int,
    contrast: bool,
) -> list[Color]:
    """Draw the boxes into the picture ``out`` in place, each in its class's colour (or, with
    ``contrast``, a colour that stands out where it does not); the colour drawn of each class id."""
    boxes = np.asarray(boxes)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        msg = f"boxes: expected an N x 4 array (x0, y0, x1, y1), found shape {boxes.shape}"
        raise ValueError(msg)
    label_ids = np.zeros(len(boxes), np.int64) if labels is None else np.asarray(labels, np.int64)
    drawn = [_class_color(class_colors, int(v)) for v in range(int(label_ids.max(initial=0)) + 1)]
    if contrast:
        # What the classes are drawn on, from at most CONTRAST_SAMPLE boxes' centres (memory
        # bounded whatever the number of boxes).
        step = max(1, -(-len(boxes) // CONTRAST_SAMPLE))
        sample = boxes[::step].astype(np.float64)
        centres = (sample[:, :2] + sample[:, 2:]) / 2 / thumb_downsample
        drawn = contrasting_colors(out, centres, label_ids[::step], drawn, tissue_color(thumbnail))
    colors = np.array(drawn + [_DEFAULT_COLOR], np.uint8)
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
    return drawn


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
    class_names: Sequence[str] | None = None,
    heatmap_names: Sequence[str] | None = None,
    legend: bool = True,
) -> Path:
    """:func:`render_overlay` with its defaults and, with ``legend``, its legend strip, written as
    PNG (:func:`write_png`)."""
    img = render_overlay(
        thumbnail,
        thumb_downsample,
        heatmap,
        heatmap_scale_level0,
        boxes,
        labels,
        class_colors,
        legend=legend,
        class_names=class_names,
        heatmap_names=heatmap_names,
    )
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
