"""Select detections by class, score or level-0 region, count them, and export them to QuPath.

Detections are the structured array of :mod:`wsi_pipeline.io.detections`
(x0, y0, x1, y1 float32 in level-0 pixels; score float32; label int32).
A region is ``(x0, y0, width, height)`` in level-0 pixels.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import WSIPipelineError
from ..io.detections import write_geojson
from ..validation import is_instance

Region = tuple[float, float, float, float]
REGION_MODES = ("centre", "inside", "overlap")


def _labels_for(classes: Iterable[str | int], class_names: Sequence[str] | None) -> list[int]:
    out = []
    for c in classes:
        if is_instance(c, (int, np.integer)):
            out.append(int(c))
        elif class_names is not None and c in class_names:
            out.append(list(class_names).index(c))
        else:
            known = ", ".join(class_names) if class_names else "none given"
            raise WSIPipelineError(f"class {c!r} is not one of the run's classes ({known})")
    return out


def region_mask(dets: np.ndarray, region: Region, mode: str = "centre") -> np.ndarray:
    """Boolean (N,) mask of the detections in ``region`` (x0, y0, width, height; level-0 px).

    ``mode``: ``centre`` (the box centre lies in the half-open region
    [x0, x0 + width) x [y0, y0 + height)), ``inside`` (the whole box lies
    within it) or ``overlap`` (the box and the region share area).
    """
    if mode not in REGION_MODES:
        raise WSIPipelineError(f"region mode must be one of {', '.join(REGION_MODES)}, got {mode!r}")
    rx0, ry0, w, h = (float(v) for v in region)
    if w <= 0 or h <= 0:
        raise WSIPipelineError(f"region width and height must be positive, got {w} x {h}")
    rx1, ry1 = rx0 + w, ry0 + h
    x0, y0, x1, y1 = (dets[k].astype(np.float64) for k in ("x0", "y0", "x1", "y1"))
    if mode == "centre":
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        return (cx >= rx0) & (cx < rx1) & (cy >= ry0) & (cy < ry1)
    if mode == "inside":
        return (x0 >= rx0) & (x1 <= rx1) & (y0 >= ry0) & (y1 <= ry1)
    return (x1 > rx0) & (x0 < rx1) & (y1 > ry0) & (y0 < ry1)


def filter_detections(
    dets: np.ndarray,
    classes: Iterable[str | int] | str | int | None = None,
    min_score: float | None = None,
    max_score: float | None = None,
    region: Region | None = None,
    region_mode: str = "centre",
    class_names: Sequence[str] | None = None,
) -> np.ndarray:
    """The detections that pass every given criterion, in their original order.

    ``classes``: class names (looked up in ``class_names``) or label ints;
    ``min_score`` <= score <= ``max_score`` (both inclusive); ``region``:
    (x0, y0, width, height) level-0 pixels, tested by ``region_mode``
    (see :func:`region_mask`). Returns a new structured array.
    """
    keep = np.ones(len(dets), bool)
    if classes is not None:
        if isinstance(classes, (str, int, np.integer)):
            classes = [classes]
        keep &= np.isin(dets["label"], _labels_for(classes, class_names))
    if min_score is not None:
        keep &= dets["score"] >= np.float32(min_score)
    if max_score is not None:
        keep &= dets["score"] <= np.float32(max_score)
    if region is not None:
        keep &= region_mask(dets, region, region_mode)
    return dets[keep].copy()


def count_by_class(dets: np.ndarray, class_names: Sequence[str]) -> dict[str, int]:
    """Number of detections per class name (every class listed, zeros included)."""
    labels = dets["label"]
    return {n: int((labels == i).sum()) for i, n in enumerate(class_names)}


def busiest_region(
    dets: np.ndarray, size: int | tuple[int, int], dimensions: tuple[int, int] | None = None
) -> tuple[int, int, int, int]:
    """The ``size`` (width, height; level-0 px) window holding the most box centres.

    Windows are searched on a lattice of a quarter of ``size``; the result
    (x0, y0, width, height) lies within ``dimensions`` (level-0 width,
    height) when given. With no detections: the top-left window.
    """
    w, h = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if not len(dets):
        return (0, 0, w, h)
    cx = (dets["x0"].astype(np.float64) + dets["x1"]) / 2
    cy = (dets["y0"].astype(np.float64) + dets["y1"]) / 2
    sx, sy = max(1, w // 4), max(1, h // 4)
    W = dimensions[0] if dimensions else int(np.ceil(cx.max())) + 1
    H = dimensions[1] if dimensions else int(np.ceil(cy.max())) + 1
    nx, ny = max(1, -(-W // sx)), max(1, -(-H // sy))
    hist = np.zeros((ny, nx), np.int64)
    np.add.at(hist, (np.clip(cy // sy, 0, ny - 1).astype(int), np.clip(cx // sx, 0, nx - 1).astype(int)), 1)
    # Sum of 4 x 4 lattice cells = one window; integral image over the cells.
    integ = np.pad(hist.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    k = 4
    wy, wx = max(1, ny - k + 1), max(1, nx - k + 1)
    ys, xs = np.arange(wy), np.arange(wx)
    y1, x1 = np.minimum(ys + k, ny), np.minimum(xs + k, nx)
    sums = integ[y1][:, x1] - integ[ys][:, x1] - integ[y1][:, xs] + integ[ys][:, xs]
    iy, ix = np.unravel_index(int(np.argmax(sums)), sums.shape)
    x0, y0 = int(ix * sx), int(iy * sy)
    if dimensions:
        x0 = max(0, min(x0, dimensions[0] - w))
        y0 = max(0, min(y0, dimensions[1] - h))
    return (x0, y0, w, h)


def export_geojson(path: str | os.PathLike[str], dets: Any, classes: Sequence[dict] | None = None) -> Path:
    """Write detections (an array, or a :class:`~.results.ReviewRun`) as QuPath GeoJSON.

    ``classes``: ``[{"name", "color"}]`` per label (default: the run's). The
    file holds level-0 pixel Polygon boxes that QuPath imports as detections
    (File > Import objects); it reads back with
    :func:`~wsi_pipeline.io.detections.read_geojson`.
    """
    if hasattr(dets, "detections"):
        classes = classes if classes is not None else dets.classes
        dets = dets.detections
    if classes is None:
        raise WSIPipelineError(f"{path}: give the classes ([{{'name', 'color'}}] per label) to export detections")
    path = Path(path)
    if not path.parent.is_dir():
        raise WSIPipelineError(f"{path}: folder {path.parent} does not exist")
    write_geojson(path, dets, classes)
    return path


__all__ = ["REGION_MODES", "busiest_region", "count_by_class", "export_geojson", "filter_detections", "region_mask"]
