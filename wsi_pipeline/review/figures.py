"""Review figures drawn with matplotlib; data coordinates are level-0 pixels of the slide.

Every image is placed with an ``extent`` in level-0 pixels (x to the right,
y down), so a box (x0, y0, x1, y1) from the detections is drawn at exactly
those axis values, and the axis ticks read as level-0 pixel positions. When
the slide's resolution is known, a second pair of axes (top, right) reads in
micrometres. Each function returns its :class:`matplotlib.figure.Figure`
(made with pyplot; close it with ``plt.close(fig)`` outside a notebook).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import cv2
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..errors import WSIPipelineError
from ..io.ome_tiff import HeatmapFile
from .filters import filter_detections
from .results import ReviewRun

# Heatmap channel colours, in order of the channels shown (matplotlib named colours).
HEATMAP_COLORS = ("red", "blue", "green", "orange", "magenta", "cyan")
SKIP_CHANNELS = ("tissue", "background")
MAX_REGION_PIXELS = 4096 * 4096
DETECTION_GID = "detection"
REFERENCE_GID = "reference"


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


def _label_axes(ax: Axes, mpp: tuple[float, float] | None) -> None:
    """Level-0 pixel labels on the bottom and left; micrometres on the top and right when ``mpp`` is known."""
    ax.set_xlabel("x (level-0 px)")
    ax.set_ylabel("y (level-0 px)")
    if mpp:
        mx, my = float(mpp[0]), float(mpp[1])
        top = ax.secondary_xaxis("top", functions=(lambda v: v * mx, lambda v: v / mx))
        top.set_xlabel("x (µm)")
        right = ax.secondary_yaxis("right", functions=(lambda v: v * my, lambda v: v / my))
        right.set_ylabel("y (µm)")


def _box_vertices(dets: np.ndarray) -> np.ndarray:
    """(N, 4, 2) float64 corners (level-0 px) of the detection boxes, clockwise from top-left."""
    x0, y0, x1, y1 = (dets[k].astype(np.float64) for k in ("x0", "y0", "x1", "y1"))
    return np.stack(
        [np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1), np.stack([x0, y1], 1)], axis=1
    )


def _heatmap_channels(run: ReviewRun, channels: Sequence[str] | None, skip: Sequence[str]) -> list[int]:
    names = run.heatmap_classes
    if channels is not None:
        missing = [c for c in channels if c not in names]
        if missing:
            raise WSIPipelineError(
                f"heatmap channel(s) {', '.join(missing)} not in this run's heatmap ({', '.join(names) or 'none'})"
            )
        return [names.index(c) for c in channels]
    lowered = {s.lower() for s in skip}
    shown = [i for i, n in enumerate(names) if n.lower() not in lowered]
    return shown if shown else list(range(len(names)))


def heatmap_for_display(run: ReviewRun, target_width: int) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """The heatmap (C x h x w float32) at about ``target_width`` px wide, and its level-0 extent.

    The extent (left, right, bottom, top) = (0, W * s, H * s, 0) with W x H
    the heatmap's full-size shape and s = ``run.heatmap_scale_level0``: the
    area the heatmap covers in level-0 pixels, whatever level is read.
    """
    heat = run.heatmap
    if heat is None:
        raise WSIPipelineError("this run has no heatmap")
    if isinstance(heat, HeatmapFile):
        shapes = heat.level_shapes
        level = 0
        for k, shp in enumerate(shapes):  # the coarsest level still as wide as the target
            if shp[2] >= target_width:
                level = k
        data = heat.read(level)
        full = shapes[0]
    else:
        data = np.asarray(heat, np.float32)
        full = data.shape
    if data.shape[2] > 2 * target_width:
        f = data.shape[2] / target_width
        size = (max(1, round(data.shape[2] / f)), max(1, round(data.shape[1] / f)))
        data = np.stack([cv2.resize(c, size, interpolation=cv2.INTER_AREA) for c in data])
    s = float(run.heatmap_scale_level0)
    return data, (0.0, full[2] * s, full[1] * s, 0.0)


def _channel_cmap(color: str, alpha: float) -> LinearSegmentedColormap:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return LinearSegmentedColormap.from_list(f"heat_{color}", [(r, g, b, 0.0), (r, g, b, alpha)])


def draw_boxes(ax: Axes, run: ReviewRun, dets: np.ndarray, linewidth: float = 0.8) -> list[PolyCollection]:
    """Add the boxes of ``dets`` to ``ax`` as one outline collection per class (level-0 px data coordinates)."""
    out = []
    for label in np.unique(dets["label"]):
        sel = dets[dets["label"] == label]
        coll = PolyCollection(
            _box_vertices(sel),
            closed=True,
            facecolors="none",
            edgecolors=[run.color_of(int(label))],
            linewidths=linewidth,
            label=f"{run.name_of(int(label))} ({len(sel)})",
        )
        coll.set_gid(DETECTION_GID)
        ax.add_collection(coll)
        out.append(coll)
    return out


def plot_overview(
    run: ReviewRun,
    channels: Sequence[str] | None = None,
    skip: Sequence[str] = SKIP_CHANNELS,
    boxes: bool = True,
    max_boxes: int = 50_000,
    thumb_size: int = 1024,
    alpha: float = 0.55,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (9, 8),
) -> Figure:
    """The slide thumbnail, the heatmap of the classes of interest over it, and the detection boxes.

    ``channels``: heatmap channels to show (default: all but those named in
    ``skip``, case-insensitive; "tissue" covers all tissue and hides the
    rest). Each shown channel goes from transparent (0) to its colour at
    ``alpha`` (probability 1). The thumbnail spans extent (0, W, H, 0) in
    level-0 pixels (W x H = ``run.dimensions``); boxes are drawn at their
    level-0 coordinates; with more than ``max_boxes`` only the highest
    scoring are drawn (the title says so).
    """
    slide = run.open_slide()
    w0, h0 = run.dimensions if run.dimensions[0] else slide.dimensions
    fig, ax = _new_axes(ax, figsize)
    thumb = slide.get_thumbnail(thumb_size)
    ax.imshow(thumb, extent=(0, w0, h0, 0), interpolation="antialiased")
    if run.heatmap is not None and run.heatmap_classes:
        data, extent = heatmap_for_display(run, thumb.shape[1])
        for k, ci in enumerate(_heatmap_channels(run, channels, skip)):
            im = ax.imshow(
                data[ci],
                extent=extent,
                cmap=_channel_cmap(HEATMAP_COLORS[k % len(HEATMAP_COLORS)], alpha),
                vmin=0.0,
                vmax=1.0,
                interpolation="nearest",
            )
            im.set_label(run.heatmap_classes[ci])
            fig.colorbar(im, ax=ax, shrink=0.6, pad=0.01, label=f"{run.heatmap_classes[ci]} probability")
    title = f"{Path(str(run.slide_path or slide.path)).name}: {len(run.detections)} detections"
    if boxes and len(run.detections):
        dets = run.detections
        if len(dets) > max_boxes:
            dets = dets[np.argsort(-dets["score"], kind="stable")[:max_boxes]]
            title += f" (highest {max_boxes} drawn)"
        draw_boxes(ax, run, dets, linewidth=0.6 if len(dets) > 2000 else 0.9)
        ax.legend(loc="upper right", fontsize="small", framealpha=0.8)
    ax.set_xlim(0, w0)
    ax.set_ylim(h0, 0)
    _label_axes(ax, run.mpp)
    ax.set_title(title)
    return fig


def plot_region(
    run: ReviewRun,
    x0: int,
    y0: int,
    width: int,
    height: int,
    show_scores: bool = False,
    reference: np.ndarray | None = None,
    linewidth: float = 1.5,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (8, 8),
) -> Figure:
    """A level-0 region at full resolution with the detections that overlap it.

    The region (``x0``, ``y0``, ``width``, ``height``; level-0 pixels) is
    read at level 0 and placed at extent (x0, x0 + width, y0 + height, y0),
    so pixel (i, j) of the read covers level-0 [x0 + j, x0 + j + 1) x
    [y0 + i, y0 + i + 1). Each detection is a :class:`Rectangle` patch at
    (x0, y0) of its box with gid ``"detection"``; ``reference`` (N x 4
    level-0 boxes, e.g. the truth) is drawn dashed in white with gid
    ``"reference"``. ``show_scores`` writes each score above its box.
    """
    x0, y0, width, height = int(x0), int(y0), int(width), int(height)
    if width <= 0 or height <= 0:
        raise WSIPipelineError(f"region size must be positive, got {width} x {height}")
    if width * height > MAX_REGION_PIXELS:
        raise WSIPipelineError(
            f"region {width} x {height} px is too large to show at full resolution "
            f"(at most {MAX_REGION_PIXELS} pixels); use plot_overview or a smaller region"
        )
    slide = run.open_slide()
    fig, ax = _new_axes(ax, figsize)
    img = slide.read_region((x0, y0), 0, (width, height))
    ax.imshow(img, extent=(x0, x0 + width, y0 + height, y0), interpolation="nearest")
    if reference is not None:
        for b in np.asarray(reference, np.float64).reshape(-1, 4):
            r = Rectangle(
                (b[0], b[1]),
                b[2] - b[0],
                b[3] - b[1],
                fill=False,
                edgecolor="white",
                linestyle="--",
                linewidth=max(0.8, linewidth * 0.7),
            )
            r.set_gid(REFERENCE_GID)
            ax.add_patch(r)
    dets = filter_detections(run.detections, region=(x0, y0, width, height), region_mode="overlap")
    for d in dets:
        color = run.color_of(int(d["label"]))
        r = Rectangle(
            (float(d["x0"]), float(d["y0"])),
            float(d["x1"] - d["x0"]),
            float(d["y1"] - d["y0"]),
            fill=False,
            edgecolor=color,
            linewidth=linewidth,
        )
        r.set_gid(DETECTION_GID)
        ax.add_patch(r)
        if show_scores:
            ax.text(
                float(d["x0"]),
                float(d["y0"]) - 1,
                f"{float(d['score']):.2f}",
                color=color,
                fontsize="x-small",
                va="bottom",
                clip_on=True,
            )
    ax.set_xlim(x0, x0 + width)
    ax.set_ylim(y0 + height, y0)
    _label_axes(ax, run.mpp)
    counts = ", ".join(f"{run.name_of(int(k))} {int((dets['label'] == k).sum())}" for k in np.unique(dets["label"]))
    ax.set_title(
        f"region x {x0}..{x0 + width}, y {y0}..{y0 + height}: {len(dets)} detections"
        + (f" ({counts})" if counts else "")
    )
    return fig


def crop_window(det: np.void, margin: int, dimensions: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """A square level-0 window (x0, y0, side) around one detection with ``margin`` px on its longer side."""
    w = float(det["x1"] - det["x0"])
    h = float(det["y1"] - det["y0"])
    side = int(math.ceil(max(w, h))) + 2 * int(margin)
    cx, cy = float(det["x0"] + det["x1"]) / 2, float(det["y0"] + det["y1"]) / 2
    x0, y0 = int(round(cx - side / 2)), int(round(cy - side / 2))
    return x0, y0, max(1, side)


def gallery_order(dets: np.ndarray, n: int, which: str) -> dict[str, np.ndarray]:
    """Indices into ``dets``: ``{"highest": ..., "lowest": ...}`` (as ``which`` asks), each up to ``n``.

    ``highest`` runs from the top score down, ``lowest`` from the bottom score up.
    """
    if which not in ("both", "highest", "lowest"):
        raise WSIPipelineError(f"which must be 'both', 'highest' or 'lowest', got {which!r}")
    order = np.argsort(-dets["score"], kind="stable")
    out = {}
    if which in ("both", "highest"):
        out["highest"] = order[:n]
    if which in ("both", "lowest"):
        out["lowest"] = order[::-1][:n]
    return out


def plot_gallery(
    run: ReviewRun,
    n: int = 8,
    which: str = "both",
    margin: int = 8,
    cols: int = 8,
    classes: Sequence[str | int] | None = None,
    tile_inches: float = 1.4,
) -> Figure:
    """Crops of the ``n`` highest- and/or lowest-scoring detections, each titled with its score.

    Each crop is a square level-0 window around the box (``margin`` px
    added), read at level 0 and shown with its level-0 extent; the box is
    drawn on it. ``classes``: only these classes. Rows: one block per
    ``which`` set, ``cols`` crops a row. Crop axes carry ``score`` and
    ``index`` (into ``run.detections``) as attributes ``review_score`` and
    ``review_index``.
    """
    dets = run.detections
    idx_all = np.arange(len(dets))
    if classes is not None:
        keep = np.isin(dets["label"], [run.class_names.index(c) if isinstance(c, str) else int(c) for c in classes])
        dets, idx_all = dets[keep], idx_all[keep]
    sets = gallery_order(dets, n, which)
    slide = run.open_slide()
    ncols = max(1, min(cols, max((len(v) for v in sets.values()), default=1)))
    rows_per = {k: max(1, math.ceil(len(v) / ncols)) for k, v in sets.items()}
    total_rows = sum(rows_per.values())
    fig = plt.figure(
        figsize=(ncols * tile_inches, total_rows * (tile_inches + 0.35) + 0.4 * len(sets)), layout="constrained"
    )
    subfigs = fig.subfigures(len(sets), 1, height_ratios=[rows_per[k] for k in sets], squeeze=False)[:, 0]
    for sub, (name, order) in zip(subfigs, sets.items(), strict=True):
        sub.suptitle(f"{name} scores" + ("" if len(order) else ": no detections"), fontsize="medium")
        axes = sub.subplots(rows_per[name], ncols, squeeze=False)
        for a in axes.ravel():
            a.set_axis_off()
        for k, i in enumerate(order):
            d = dets[i]
            a = axes.ravel()[k]
            cx0, cy0, side = crop_window(d, margin)
            a.imshow(
                slide.read_region((cx0, cy0), 0, (side, side)),
                extent=(cx0, cx0 + side, cy0 + side, cy0),
                interpolation="nearest",
            )
            r = Rectangle(
                (float(d["x0"]), float(d["y0"])),
                float(d["x1"] - d["x0"]),
                float(d["y1"] - d["y0"]),
                fill=False,
                edgecolor=run.color_of(int(d["label"])),
                linewidth=1.2,
            )
            r.set_gid(DETECTION_GID)
            a.add_patch(r)
            a.set_xlim(cx0, cx0 + side)
            a.set_ylim(cy0 + side, cy0)
            label = f"{float(d['score']):.3f}"
            if len(run.class_names) > 1:
                label += f" {run.name_of(int(d['label']))}"
            a.set_title(label, fontsize="small")
            a.review_score = float(d["score"])
            a.review_index = int(idx_all[i])
    return fig


def plot_counts(
    run: ReviewRun, bins: int = 20, threshold: float | None = None, figsize: tuple[float, float] = (10, 3.6)
) -> Figure:
    """Detections per class (bars, class colours) and the score histogram per class (stacked, 0..1).

    ``threshold``: a score drawn as a dashed line on the histogram.
    """
    fig, (ax_bar, ax_hist) = plt.subplots(1, 2, figsize=figsize, layout="constrained")
    labels = run.detections["label"]
    counts = [int((labels == i).sum()) for i in range(len(run.class_names))]
    colors = [run.color_of(i) for i in range(len(run.class_names))]
    bars = ax_bar.bar(run.class_names, counts, color=colors)
    ax_bar.bar_label(bars, labels=[str(c) for c in counts])
    ax_bar.margins(y=0.12)
    ax_bar.set_ylabel("detections")
    ax_bar.set_title(f"counts per class ({len(run.detections)} in all)")
    scores = [run.detections["score"][labels == i] for i in range(len(run.class_names))]
    ax_hist.hist(scores, bins=bins, range=(0.0, 1.0), stacked=True, color=colors, label=run.class_names)
    if threshold is not None:
        ax_hist.axvline(threshold, color="black", linestyle="--", label=f"threshold {threshold:g}")
    ax_hist.set_xlabel("score")
    ax_hist.set_ylabel("detections")
    ax_hist.set_title("score histogram")
    ax_hist.legend(fontsize="small")
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Write ``fig`` as an image (format from the suffix); the folder is made if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


__all__ = [
    "DETECTION_GID",
    "HEATMAP_COLORS",
    "REFERENCE_GID",
    "SKIP_CHANNELS",
    "crop_window",
    "draw_boxes",
    "gallery_order",
    "heatmap_for_display",
    "plot_counts",
    "plot_gallery",
    "plot_overview",
    "plot_region",
    "save_figure",
]
