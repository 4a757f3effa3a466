"""A synthetic scene's objects: generated per cell from the cell's own random generator, drawn as
coverage on an output grid.

Coordinates are level-0 pixels, quantised to 1/16 pixel (cv2's drawing shift), so an object is
drawn the same wherever a render's window starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

SUBPIXEL_BITS = 4  # cv2 drawing shift: coordinates in 1/16 pixel
SUBPIXEL = 1 << SUBPIXEL_BITS
# Nuclei per level-0 pixel at mpp 0.25 (candidates, before overlap rejection): 90 and 340 a
# 512 x 512 cell.
_RHO_TISSUE = 90.0 / 512**2
_RHO_TUMOUR = 340.0 / 512**2
# Industrial defects per cell.
_SPOTS_PER_CELL = 0.25
_SCRATCHES_PER_CELL = 0.12


@dataclass
class CellObjects:
    """Objects whose centre lies in one cell.

    boxes (N, 4) float32 x0, y0, x1, y1 level-0; labels (N,) int64; geom (N, 5) float64:
    ellipse (cx, cy, semi-axis a, semi-axis b, angle degrees) or, where ``is_line``,
    segment (xa, ya, xb, yb, thickness); value (N,) float32 in (0, 1] is the drawing
    strength; bright (N,) bool picks the bright defect colour (industrial).
    """

    boxes: np.ndarray
    labels: np.ndarray
    geom: np.ndarray
    value: np.ndarray
    is_line: np.ndarray
    bright: np.ndarray

    @staticmethod
    def empty() -> CellObjects:
        return CellObjects(
            np.zeros((0, 4), np.float32),
            np.zeros(0, np.int64),
            np.zeros((0, 5), np.float64),
            np.zeros(0, np.float32),
            np.zeros(0, bool),
            np.zeros(0, bool),
        )

    @staticmethod
    def concat(parts: list[CellObjects]) -> CellObjects:
        if not parts:
            return CellObjects.empty()
        return CellObjects(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("boxes", "labels", "geom", "value", "is_line", "bright")
            )
        )

    def select(self, keep: np.ndarray) -> CellObjects:
        return CellObjects(
            self.boxes[keep],
            self.labels[keep],
            self.geom[keep],
            self.value[keep],
            self.is_line[keep],
            self.bright[keep],
        )


def quantise_down(v: np.ndarray) -> np.ndarray:
    return np.floor(v * SUBPIXEL) / SUBPIXEL


def quantise_up(v: np.ndarray) -> np.ndarray:
    return np.ceil(v * SUBPIXEL) / SUBPIXEL


def inside(x: np.ndarray, y: np.ndarray, hx: np.ndarray, hy: np.ndarray, width: int, height: int) -> np.ndarray:
    """Whether each object's box (centre ``x``, ``y``, half extents ``hx``, ``hy``) lies in the scene."""
    return (x - hx >= 0) & (y - hy >= 0) & (x + hx <= width) & (y + hy <= height)


def pathology_objects(
    rng: np.random.Generator,
    cx: int,
    cy: int,
    c: int,
    k: float,
    labels_at: Callable[[np.ndarray, np.ndarray], np.ndarray],
    width: int,
    height: int,
) -> CellObjects:
    """The nuclei of cell (``cx``, ``cy``) of side ``c``: denser, larger and darker in tumour
    (``labels_at``'s label 2), sizes scaled by ``k``; heavy overlaps rejected in generation order."""
    n = int(rng.poisson(_RHO_TUMOUR * c * c / (k * k)))
    px = quantise_down(cx * c + rng.random(n) * c)
    py = quantise_down(cy * c + rng.random(n) * c)
    u = rng.random((5, n))
    lab = labels_at(px, py)
    tumour = lab == 2
    keep = u[0] < np.where(tumour, 1.0, np.where(lab == 1, _RHO_TISSUE / _RHO_TUMOUR, 0.0))
    a = np.where(tumour, 6.0 + 4.0 * u[1], 4.0 + 3.0 * u[1]) * k
    b = a * np.where(tumour, 0.7 + 0.25 * u[2], 0.55 + 0.35 * u[2])
    angle = 180.0 * u[3]
    value = np.where(tumour, 0.86 + 0.14 * u[4], 0.6 + 0.25 * u[4]).astype(np.float32)
    th = np.deg2rad(angle)
    hx = quantise_up(np.sqrt((a * np.cos(th)) ** 2 + (b * np.sin(th)) ** 2))
    hy = quantise_up(np.sqrt((a * np.sin(th)) ** 2 + (b * np.cos(th)) ** 2))
    keep &= inside(px, py, hx, hy, width, height)
    idx = np.flatnonzero(keep)
    if idx.size > 1:
        # Greedy rejection of heavy overlaps, in generation order.
        r = 0.5 * (a[idx] + b[idx])
        d2 = (px[idx, None] - px[None, idx]) ** 2 + (py[idx, None] - py[None, idx]) ** 2
        conflict = d2 < (0.9 * (r[:, None] + r[None, :])) ** 2
        np.fill_diagonal(conflict, False)
        blocked = np.zeros(idx.size, bool)
        chosen = np.zeros(idx.size, bool)
        for i in range(idx.size):
            if not blocked[i]:
                chosen[i] = True
                blocked |= conflict[i]
        idx = idx[chosen]
    boxes = np.stack([px - hx, py - hy, px + hx, py + hy], axis=1)[idx].astype(np.float32)
    geom = np.stack([px, py, a, b, angle], axis=1)[idx]
    m = idx.size
    return CellObjects(boxes, np.zeros(m, np.int64), geom, value[idx], np.zeros(m, bool), np.zeros(m, bool))


def industrial_objects(rng: np.random.Generator, cx: int, cy: int, c: int, width: int, height: int) -> CellObjects:
    """The defects of cell (``cx``, ``cy``) of side ``c``: spots (class 0) and scratches (class 1)."""
    parts = []
    n = int(rng.poisson(_SPOTS_PER_CELL))
    px = quantise_down(cx * c + rng.random(n) * c)
    py = quantise_down(cy * c + rng.random(n) * c)
    r = quantise_up(3.0 + 17.0 * rng.random(n))
    bright = rng.random(n) < 0.5
    value = (0.55 + 0.45 * rng.random(n)).astype(np.float32)
    keep = inside(px, py, r, r, width, height)
    parts.append(
        CellObjects(
            np.stack([px - r, py - r, px + r, py + r], axis=1).astype(np.float32),
            np.zeros(n, np.int64),
            np.stack([px, py, r, r, np.zeros(n)], axis=1),
            value,
            np.zeros(n, bool),
            bright,
        ).select(keep)
    )
    n = int(rng.poisson(_SCRATCHES_PER_CELL))
    px = quantise_down(cx * c + rng.random(n) * c)
    py = quantise_down(cy * c + rng.random(n) * c)
    half = 0.5 * (30.0 + 170.0 * rng.random(n))
    th = np.pi * rng.random(n)
    thickness = 1.0 + 2.0 * rng.random(n)
    bright = rng.random(n) < 0.6
    value = (0.5 + 0.5 * rng.random(n)).astype(np.float32)
    xa, xb = quantise_down(px - half * np.cos(th)), quantise_down(px + half * np.cos(th))
    ya, yb = quantise_down(py - half * np.sin(th)), quantise_down(py + half * np.sin(th))
    t2 = quantise_up(thickness / 2)
    boxes = np.stack(
        [np.minimum(xa, xb) - t2, np.minimum(ya, yb) - t2, np.maximum(xa, xb) + t2, np.maximum(ya, yb) + t2], axis=1
    )
    keep = (boxes[:, 0] >= 0) & (boxes[:, 1] >= 0) & (boxes[:, 2] <= width) & (boxes[:, 3] <= height)
    parts.append(
        CellObjects(
            boxes.astype(np.float32),
            np.ones(n, np.int64),
            np.stack([xa, ya, xb, yb, thickness], axis=1),
            value,
            np.ones(n, bool),
            bright,
        ).select(keep)
    )
    return CellObjects.concat(parts)


def coverage(
    objs: CellObjects,
    select: np.ndarray,
    x0: float,
    y0: float,
    shape: tuple[int, int],
    d: float,
    max_half_extent: float,
) -> np.ndarray:
    """Coverage in [0, 1] of the selected objects on the output grid: (H, W) float32.

    Objects at least ~1.5 output px across are drawn anti-aliased on a canvas padded
    by the largest object (``max_half_extent``, level-0 pixels), so none is clipped
    (clipping changes cv2's rasterisation, and renders must not depend on where the
    window starts). Smaller ones add their area to the pixel holding their centre.
    """
    h, w = shape
    pad = int(math.ceil(max_half_extent / d)) + 3
    canvas = np.zeros((h + 2 * pad, w + 2 * pad), np.uint8)
    splat = np.zeros((h, w), np.float32)
    g = objs.geom
    s = float(SUBPIXEL)
    for i in np.flatnonzero(select):
        v = float(objs.value[i])
        if objs.is_line[i]:
            xa, ya, xb, yb, t = g[i]
            t_out = t / d
            length_out = math.hypot(xb - xa, yb - ya) / d
            if length_out < 1.0:
                _splat_into(splat, 0.5 * (xa + xb), 0.5 * (ya + yb), x0, y0, d, v * t_out * length_out)
                continue
            thick = max(round(t_out), 1)
            strength = v * min(t_out / thick, 1.0)
            pa = (round(((xa - x0) / d - 0.5 + pad) * s), round(((ya - y0) / d - 0.5 + pad) * s))
            pb = (round(((xb - x0) / d - 0.5 + pad) * s), round(((yb - y0) / d - 0.5 + pad) * s))
            cv2.line(canvas, pa, pb, round(255 * strength), thick, cv2.LINE_AA, SUBPIXEL_BITS)
        else:
            cx, cy, a, b, angle = g[i]
            if (a + b) / (2 * d) < 0.75:
                _splat_into(splat, cx, cy, x0, y0, d, v * math.pi * a * b / (d * d))
                continue
            centre = (round(((cx - x0) / d - 0.5 + pad) * s), round(((cy - y0) / d - 0.5 + pad) * s))
            axes = (round(a / d * s), round(b / d * s))
            cv2.ellipse(canvas, centre, axes, float(angle), 0, 360, round(255 * v), -1, cv2.LINE_AA, SUBPIXEL_BITS)
    cov = canvas[pad : pad + h, pad : pad + w].astype(np.float32)
    cov *= 1.0 / 255.0
    cov += splat
    return np.minimum(cov, 1.0, out=cov)


def _splat_into(out: np.ndarray, x: float, y: float, x0: float, y0: float, d: float, amount: float) -> None:
    c = math.floor((x - x0) / d)
    r = math.floor((y - y0) / d)
    if 0 <= r < out.shape[0] and 0 <= c < out.shape[1]:
        out[r, c] += amount
