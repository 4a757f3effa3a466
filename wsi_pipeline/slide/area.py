"""OpenCV's ``INTER_AREA`` shrink as weights, applied a part of the source at a time.

``cv2.resize(src, dsize, interpolation=cv2.INTER_AREA)`` needs the whole
source in memory: a 512 px tile read at 64 times a level's pixel size is a
32,768 px square (3.2 GB) for 0.8 MB of output. The same pixels come from here
with the source read a band of rows at a time (:func:`shrink_banded`: a
tile read far coarser than any stored level), or from the few stored tiles
of a level that hold data (:func:`shrink_sparse`: the thumbnail of a sparse
DICOM level), in memory bounded by :data:`BAND_BYTES` and the output.

The weights are OpenCV's (``computeResizeAreaTab``; :func:`axis_weights`).
Where both factors are integers OpenCV sums ``kx x ky`` cells and rounds
them as its ``resizeAreaFast`` does (``(sum + 2) >> 2`` for 2 x 2, else
``sum * (1.f / area)`` rounded to even); the sums here are exact, so the
pixels are identical. Otherwise OpenCV sums weighted pixels in float32 and
these sums are float64: a pixel may differ by one grey level where a sum lies
within float32 rounding of a half (a few pixels in a million).
OpenCV itself is not used because it takes its source whole, and a hand-made
weighted sum is the only way to give it a band at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

# Work memory of one shrink (its bands, their float sums), besides the output.
BAND_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class AxisWeights:
    """OpenCV's area weights along one axis: entry ``i`` adds ``weight[i]`` of source pixel
    ``src[i]`` to output pixel ``dst[i]``; entries sorted by ``dst`` (and ``src``, which follows it).
    ``factor``: the integer factor, where the shrink is one (each weight ``1 / factor``)."""

    dst: np.ndarray
    src: np.ndarray
    weight: np.ndarray
    factor: int | None

    def starts(self) -> np.ndarray:
        """The first entry of each output pixel (every output pixel has one)."""
        return np.flatnonzero(np.r_[True, self.dst[1:] != self.dst[:-1]])


def axis_weights(src: int, dst: int) -> AxisWeights:
    """OpenCV's ``INTER_AREA`` weights shrinking ``src`` pixels to ``dst`` along one axis."""
    if not 0 < dst <= src:
        raise ValueError(f"area weights shrink: expected 0 < dst <= src, found src={src}, dst={dst}")
    k, rest = divmod(src, dst)
    if rest == 0:
        i = np.arange(src, dtype=np.int64)
        return AxisWeights(i // k, i, np.full(src, 1.0 / k), k)
    scale = src / dst
    d: list[int] = []
    s: list[int] = []
    w: list[float] = []
    for dx in range(dst):  # OpenCV's computeResizeAreaTab, entry by entry
        fsx1 = dx * scale
        fsx2 = fsx1 + scale
        cell = min(scale, src - fsx1)
        sx1, sx2 = math.ceil(fsx1), math.floor(fsx2)
        sx2 = min(sx2, src - 1)
        sx1 = min(sx1, sx2)
        if sx1 - fsx1 > 1e-3:
            d.append(dx), s.append(sx1 - 1), w.append((sx1 - fsx1) / cell)
        d.extend([dx] * (sx2 - sx1)), s.extend(range(sx1, sx2)), w.extend([1.0 / cell] * (sx2 - sx1))
        if fsx2 - sx2 > 1e-3:
            d.append(dx), s.append(sx2), w.append(min(fsx2 - sx2, 1.0, cell) / cell)
    return AxisWeights(np.array(d, np.int64), np.array(s, np.int64), np.array(w, np.float64), None)


def area_weights(src: int, dst: int) -> np.ndarray:
    """``dst x src`` float64 matrix of :func:`axis_weights` (each row sums to 1)."""
    a = axis_weights(src, dst)
    m = np.zeros((dst, src), np.float64)
    np.add.at(m, (a.dst, a.src), a.weight)
    return m


class _Sums:
    """What :func:`shrink_banded` and :func:`shrink_sparse` share: both axes' weights, in the
    exact form (counts, integer sums) where both factors are integers, and the final rounding."""

    def __init__(self, src_w: int, src_h: int, dst_w: int, dst_h: int):
        self.x, self.y = axis_weights(src_w, dst_w), axis_weights(src_h, dst_h)
        self.exact = self.x.factor is not None and self.y.factor is not None
        self.wx = np.ones(len(self.x.src)) if self.exact else self.x.weight
        self.wy = np.ones(len(self.y.src)) if self.exact else self.y.weight

    def to_uint8(self, sums: np.ndarray) -> np.ndarray:
        """Summed output pixels rounded as OpenCV rounds them."""
        if self.exact:
            kx, ky = self.x.factor, self.y.factor
            if kx == ky == 2:
                sums = np.floor((sums + 2) / 4)
            else:
                sums = np.rint(sums.astype(np.float32) * np.float32(1.0 / (kx * ky)))
        else:
            sums = np.rint(sums)
        return np.clip(sums, 0, 255).astype(np.uint8)


def shrink_banded(
    read_rows: Callable[[int, int, int, int], np.ndarray],
    xmap: np.ndarray,
    ymap: np.ndarray,
    dst_w: int,
    dst_h: int,
    background: tuple[int, int, int],
    band_bytes: int = BAND_BYTES,
) -> np.ndarray:
    """``cv2.resize(region, (dst_w, dst_h), interpolation=cv2.INTER_AREA)`` of a region never held whole.

    The region's pixel ``(i, j)`` is source pixel ``(ymap[i], xmap[j])``, or ``background`` where
    either is -1 (a map may repeat source pixels: an edge reflected). ``read_rows(y0, y1, x0, x1)``
    gives source pixels ``[y0, y1) x [x0, x1)`` as ``HxWx3`` uint8; it is asked for bands of rows
    between the smallest and largest of ``xmap``, each source row about once where its rows fit
    the work memory (``band_bytes``), so the work follows the source pixels, not the region's.
    """
    xmap, ymap = np.asarray(xmap, np.int64), np.asarray(ymap, np.int64)
    sums = _Sums(len(xmap), len(ymap), dst_w, dst_h)
    bg = np.asarray(background, np.float64)
    xs = xmap[sums.x.src]
    in_x = xs >= 0
    cx0 = int(xs[in_x].min()) if in_x.any() else 0
    cx1 = int(xs[in_x].max()) + 1 if in_x.any() else 0
    x_idx = np.where(in_x, xs - cx0, 0)
    x_starts = sums.x.starts()
    # A row of background, its columns summed.
    bg_row = np.add.reduceat(sums.wx, x_starts)[:, None] * bg
    row_cost = len(xs) * 3 * 8 + (cx1 - cx0) * 3

    def columns_summed(y0: int, y1: int) -> np.ndarray:
        """Source rows ``[y0, y1)`` with their columns summed: ``(y1 - y0) x dst_w x 3`` float64."""
        out = np.empty((y1 - y0, dst_w, 3), np.float64)
        step = max(1, band_bytes // max(1, row_cost))
        for r0 in range(y0, y1, step):
            r1 = min(y1, r0 + step)
            rows = read_rows(r0, r1, cx0, cx1) if cx1 > cx0 else np.zeros((r1 - r0, 1, 3), np.uint8)
            g = rows[:, x_idx].astype(np.float64)
            if not in_x.all():
                g[:, ~in_x] = bg
            if not sums.exact:
                g *= sums.wx[None, :, None]
            out[r0 - y0 : r1 - y0] = np.add.reduceat(g, x_starts, axis=1)
        return out

    ys = ymap[sums.y.src]
    in_y = ys >= 0
    chunk = max(1, band_bytes // (dst_w * 3 * 8))
    whole = None  # every source row's column sums, where they fit the work memory: each row read once
    if in_y.any():
        y_lo, y_hi = int(ys[in_y].min()), int(ys[in_y].max()) + 1
        if y_hi - y_lo <= chunk:
            whole = (y_lo, columns_summed(y_lo, y_hi))
    out = np.empty((dst_h, dst_w, 3), np.uint8)
    carry: tuple[int, np.ndarray] | None = None
    n = len(ys)
    for e0 in range(0, n, chunk):
        e1 = min(n, e0 + chunk)
        d, s, v = sums.y.dst[e0:e1], ys[e0:e1], in_y[e0:e1]
        part = np.empty((e1 - e0, dst_w, 3), np.float64)
        part[~v] = bg_row
        if v.any():
            base, cols = whole if whole is not None else (int(s[v].min()), None)
            if cols is None:
                cols = columns_summed(base, int(s[v].max()) + 1)
            part[v] = cols[s[v] - base]
        if not sums.exact:
            part *= sums.wy[e0:e1, None, None]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        rows, partial = d[starts], np.add.reduceat(part, starts, axis=0)
        if carry is not None and carry[0] == rows[0]:
            partial[0] += carry[1]
        elif carry is not None:
            out[carry[0]] = sums.to_uint8(carry[1])
        out[rows[:-1]] = sums.to_uint8(partial[:-1])
        carry = (int(rows[-1]), partial[-1])
    if carry is not None:
        out[carry[0]] = sums.to_uint8(carry[1])
    return out


def shrink_sparse(
    src_w: int,
    src_h: int,
    dst_w: int,
    dst_h: int,
    parts: Iterable[tuple[int, int, np.ndarray]],
    background: tuple[int, int, int],
) -> np.ndarray:
    """``cv2.resize(source, (dst_w, dst_h), interpolation=cv2.INTER_AREA)`` of a ``src_w x src_h``
    source that is ``background`` but for ``parts``: ``(x0, y0, pixels)``, non-overlapping ``HxWx3``
    uint8 blocks at source pixel ``(x0, y0)`` (clipped to the source). Work and memory follow the
    parts and the output, not the source: a part adds its difference from the background to the
    output pixels it covers."""
    sums = _Sums(src_w, src_h, dst_w, dst_h)
    bg = np.asarray(background, np.float64)
    full = 1.0 if not sums.exact else float(sums.x.factor * sums.y.factor)
    # Differences from the background, summed where a part touches (np.zeros: pages never touched
    # are never allocated); the rest of the output is the background as it is.
    acc = np.zeros((dst_h, dst_w, 3), np.float64)
    touched = np.zeros((dst_h, dst_w), bool)

    def block(axis: AxisWeights, w: np.ndarray, lo: int, hi: int) -> tuple[int, np.ndarray]:
        """(first output pixel, ``outputs x (hi - lo)`` weights) of source pixels ``[lo, hi)``."""
        a, b = np.searchsorted(axis.src, lo), np.searchsorted(axis.src, hi)
        d0 = int(axis.dst[a])
        m = np.zeros((int(axis.dst[b - 1]) - d0 + 1, hi - lo), np.float64)
        np.add.at(m, (axis.dst[a:b] - d0, axis.src[a:b] - lo), w[a:b])
        return d0, m

    for x0, y0, pixels in parts:
        x1, y1 = min(src_w, x0 + pixels.shape[1]), min(src_h, y0 + pixels.shape[0])
        if x1 <= x0 or y1 <= y0:
            continue
        diff = pixels[: y1 - y0, : x1 - x0].astype(np.float64) - bg
        dy, my = block(sums.y, sums.wy, y0, y1)
        dx, mx = block(sums.x, sums.wx, x0, x1)
        added = np.einsum("ij,jkc,lk->ilc", my, diff, mx, optimize=True)
        acc[dy : dy + added.shape[0], dx : dx + added.shape[1]] += added
        touched[dy : dy + added.shape[0], dx : dx + added.shape[1]] = True
    out = np.empty((dst_h, dst_w, 3), np.uint8)
    out[...] = sums.to_uint8(bg * full)
    out[touched] = sums.to_uint8(acc[touched] + bg * full)
    return out


__all__ = ["BAND_BYTES", "AxisWeights", "area_weights", "axis_weights", "shrink_banded", "shrink_sparse"]
