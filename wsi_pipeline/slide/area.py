"""OpenCV's ``INTER_AREA`` shrink as weights, applied a part of the source at a time.

``cv2.resize(src, dsize, interpolation=cv2.INTER_AREA)`` needs the whole
source in memory: a 512 px tile read at 64 times a level's pixel size is a
32,768 px square (3.2 GB) for 0.8 MB of output. The same pixels come from here
with the source read a band of rows at a time (:func:`shrink_banded`: a
tile read far coarser than any stored level), or from the few stored tiles
of a level that hold data (:func:`shrink_sparse`: a sparse DICOM level's
thumbnail and coarse tiles), in memory bounded by :data:`BAND_BYTES` and the output.

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


@dataclass(frozen=True)
class _Runs:
    """An axis's weights over a map of source pixels as runs: entries of one output pixel and one
    weight whose source pixels step by +1 or -1 (a stretch of the source, or of its reflection), or
    stay (a one-pixel axis reflected: the same pixel again),
    each summed from prefix sums of the source: work per source line follows the source pixels and
    the runs, not the entries (a 1,024 px slide reflected over a 32,768 px region: 1,500 runs).

    ``dst``: each run's output pixel (sorted); ``lo``, ``hi``: its source pixels ``[lo, hi)``
    (unused for background runs); ``count``: its entries (``hi - lo``, or more where a pixel
    stays); ``weight``: each entry's weight;
    ``background``: runs of background pixels (map -1)."""

    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    count: np.ndarray
    weight: np.ndarray
    background: np.ndarray

    @classmethod
    def of(cls, axis: AxisWeights, weight: np.ndarray, source: np.ndarray, longest: int) -> _Runs:
        s = source[axis.src]
        bg = s < 0
        step = np.diff(s)
        cut = (np.diff(axis.dst) != 0) | (np.diff(weight) != 0) | (bg[1:] != bg[:-1])
        cut |= ~bg[1:] & (np.abs(step) > 1)
        cut[1:] |= ~bg[2:] & (step[1:] != step[:-1])  # a turn: a reflection's edge
        first = np.flatnonzero(np.r_[True, cut])
        last = np.r_[first[1:], len(s)] - 1
        # Runs longer than ``longest`` entries cut into pieces (each piece a band's worth).
        count = last - first + 1
        pieces = -(-count // longest)
        if (pieces > 1).any():
            first = np.repeat(first, pieces) + longest * (
                np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            )
            last = np.minimum(first + longest, np.repeat(last + 1, pieces)) - 1
        a, b = s[first], s[last]
        return cls(axis.dst[first], np.minimum(a, b), np.maximum(a, b) + 1, last - first + 1, weight[first], bg[first])

    def sums(self, prefix: np.ndarray, background: np.ndarray, base: int, axis: int) -> np.ndarray:
        """Each run's weighted sum along ``axis`` of ``prefix`` (prefix sums of source pixels from
        ``base``), background runs ``count x background``; then summed per output pixel."""
        lo, hi = np.where(self.background, base, self.lo) - base, np.where(self.background, base, self.hi) - base
        vals = np.take(prefix, hi, axis=axis) - np.take(prefix, lo, axis=axis)
        shape = [1, 1, 1]
        shape[axis] = -1
        if self.background.any():
            where = [slice(None)] * 3
            where[axis] = self.background
            vals[tuple(where)] = self.count[self.background].reshape(shape) * background
        # Entries per source pixel: 1 for a stretch, the count where one pixel stays (exact integers).
        repeats = np.where(self.background, 1, self.count // np.maximum(self.hi - self.lo, 1))
        vals *= (self.weight * repeats).reshape(shape)
        starts = np.flatnonzero(np.r_[True, self.dst[1:] != self.dst[:-1]])
        return np.add.reduceat(vals, starts, axis=axis)


def _prefix(pixels: np.ndarray, axis: int) -> np.ndarray:
    """Prefix sums of ``pixels`` along ``axis`` (float64, exact for these integers), a zero first."""
    shape = list(pixels.shape)
    shape[axis] += 1
    out = np.zeros(shape, np.float64)
    where = [slice(None)] * pixels.ndim
    where[axis] = slice(1, None)
    np.cumsum(pixels, axis=axis, dtype=np.float64, out=out[tuple(where)])
    return out


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
    gives source pixels ``[y0, y1) x [x0, x1)`` as ``HxWx3`` uint8; it is asked for bands of rows,
    or of columns where the source is narrower than it is tall (a band's lines then sum along the
    longer axis), each source line once where their sums fit the work memory (``band_bytes``, with
    the output's own): the work follows the source pixels read, not the region's.
    """
    xmap, ymap = np.asarray(xmap, np.int64), np.asarray(ymap, np.int64)

    def lines(m: np.ndarray) -> int:
        inside = m[m >= 0]
        return int(inside.max() - inside.min() + 1) if len(inside) else 0

    # Work of bands of rows: each row summed along its columns into dst_w sums; of columns, transposed.
    by_rows = lines(ymap) * (lines(xmap) + 3 * dst_w)
    by_columns = lines(xmap) * (lines(ymap) + 3 * dst_h)
    if by_columns >= by_rows:
        return _shrink_rows(read_rows, xmap, ymap, dst_w, dst_h, background, band_bytes)

    def read_columns(x0: int, x1: int, y0: int, y1: int) -> np.ndarray:
        return read_rows(y0, y1, x0, x1).transpose(1, 0, 2)

    out = _shrink_rows(read_columns, ymap, xmap, dst_h, dst_w, background, band_bytes)
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _shrink_rows(
    read_rows: Callable[[int, int, int, int], np.ndarray],
    xmap: np.ndarray,
    ymap: np.ndarray,
    dst_w: int,
    dst_h: int,
    background: tuple[int, int, int],
    band_bytes: int = BAND_BYTES,
) -> np.ndarray:
    """:func:`shrink_banded` by bands of rows, each row's columns summed first."""
    xmap, ymap = np.asarray(xmap, np.int64), np.asarray(ymap, np.int64)
    sums = _Sums(len(xmap), len(ymap), dst_w, dst_h)
    bg = np.asarray(background, np.float64)
    chunk = max(1, band_bytes // (dst_w * 3 * 8))  # source rows whose column sums fit the work memory
    xr = _Runs.of(sums.x, sums.wx, xmap, len(xmap))
    yr = _Runs.of(sums.y, sums.wy, ymap, chunk)
    in_x = ~xr.background
    cx0 = int(xr.lo[in_x].min()) if in_x.any() else 0
    cx1 = int(xr.hi[in_x].max()) if in_x.any() else 1
    bg_line = _background_line(xr, bg, dst_w)  # a row of background, its columns summed

    def columns_summed(y0: int, y1: int) -> np.ndarray:
        """Source rows ``[y0, y1)`` with their columns summed: ``(y1 - y0) x dst_w x 3`` float64."""
        if not in_x.any():  # no source column: every row is background
            return np.broadcast_to(bg_line, (y1 - y0, dst_w, 3))
        out = np.empty((y1 - y0, dst_w, 3), np.float64)
        step = max(1, band_bytes // ((cx1 - cx0 + len(xr.dst)) * 3 * 8 + (cx1 - cx0) * 3))
        for r0 in range(y0, y1, step):
            r1 = min(y1, r0 + step)
            prefix = _prefix(read_rows(r0, r1, cx0, cx1), axis=1)
            out[r0 - y0 : r1 - y0] = xr.sums(prefix, bg, cx0, axis=1)
        return out

    out = np.empty((dst_h, dst_w, 3), np.uint8)
    in_y = ~yr.background
    y_lo = int(yr.lo[in_y].min()) if in_y.any() else 0
    y_hi = int(yr.hi[in_y].max()) if in_y.any() else 0
    # Runs taken together: as many as read at most ``chunk`` source rows (all where they fit).
    if y_hi - y_lo <= chunk:
        bounds = [0, len(yr.dst)]
    else:
        bounds = [0, *np.flatnonzero(np.diff(np.cumsum(yr.count) // chunk)) + 1, len(yr.dst)]
    whole = _prefix(columns_summed(y_lo, y_hi), axis=0) if y_hi - y_lo <= chunk else None
    carry: tuple[int, np.ndarray] | None = None
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):
        part = _Runs(*(getattr(yr, f)[r0:r1] for f in ("dst", "lo", "hi", "count", "weight", "background")))
        inside = ~part.background
        if whole is not None:
            prefix, base = whole, y_lo
        elif inside.any():
            base = int(part.lo[inside].min())
            prefix = _prefix(columns_summed(base, int(part.hi[inside].max())), axis=0)
        else:
            prefix, base = np.zeros((1, dst_w, 3)), 0
        partial = part.sums(prefix, bg_line, base, axis=0)
        rows = part.dst[np.flatnonzero(np.r_[True, part.dst[1:] != part.dst[:-1]])]
        if carry is not None and carry[0] == rows[0]:
            partial[0] += carry[1]
        elif carry is not None:
            out[carry[0]] = sums.to_uint8(carry[1])
        out[rows[:-1]] = sums.to_uint8(partial[:-1])
        carry = (int(rows[-1]), partial[-1])
    if carry is not None:
        out[carry[0]] = sums.to_uint8(carry[1])
    return out


def _background_line(xr: _Runs, bg: np.ndarray, dst_w: int) -> np.ndarray:
    """A source row of background with its columns summed: ``dst_w x 3``."""
    per_dst = np.zeros(dst_w)
    np.add.at(per_dst, xr.dst, xr.count * xr.weight)
    return per_dst[:, None] * bg


def shrink_sparse(
    xmap: np.ndarray,
    ymap: np.ndarray,
    dst_w: int,
    dst_h: int,
    parts: Iterable[tuple[int, int, np.ndarray]],
    background: tuple[int, int, int],
) -> np.ndarray:
    """:func:`shrink_banded` of a source that is ``background`` but for ``parts``: ``(x0, y0,
    pixels)``, non-overlapping ``HxWx3`` uint8 blocks at source pixel ``(x0, y0)``, none read.

    Work and memory follow the parts and the output, not the source or the region: a part adds
    its difference from the background to the output pixels whose region pixels map into it.
    """
    xmap, ymap = np.asarray(xmap, np.int64), np.asarray(ymap, np.int64)
    sums = _Sums(len(xmap), len(ymap), dst_w, dst_h)
    bg = np.asarray(background, np.float64)
    full = 1.0 if not sums.exact else float(sums.x.factor * sums.y.factor)
    # Differences from the background, summed where a part touches (np.zeros: pages never touched
    # are never allocated); the rest of the output is the background as it is.
    acc = np.zeros((dst_h, dst_w, 3), np.float64)
    touched = np.zeros((dst_h, dst_w), bool)
    axes = []
    for axis, w, source in ((sums.x, sums.wx, xmap), (sums.y, sums.wy, ymap)):
        s = source[axis.src]
        order = np.argsort(s, kind="stable")  # the entries by the source pixel they take
        axes.append((s[order], axis.dst[order], w[order]))

    def block(axis: int, lo: int, hi: int) -> tuple[int, np.ndarray] | None:
        """(first output pixel, ``outputs x (hi - lo)`` weights) of source pixels ``[lo, hi)``."""
        s, d, w = axes[axis]
        a, b = np.searchsorted(s, lo), np.searchsorted(s, hi)
        if a == b:
            return None
        d0 = int(d[a:b].min())
        m = np.zeros((int(d[a:b].max()) - d0 + 1, hi - lo), np.float64)
        np.add.at(m, (d[a:b] - d0, s[a:b] - lo), w[a:b])
        return d0, m

    for x0, y0, pixels in parts:
        bx = block(0, x0, x0 + pixels.shape[1])
        by = block(1, y0, y0 + pixels.shape[0])
        if bx is None or by is None:
            continue
        (dx, mx), (dy, my) = bx, by
        diff = pixels.astype(np.float64) - bg
        added = np.einsum("ij,jkc,lk->ilc", my, diff, mx, optimize=True)
        acc[dy : dy + added.shape[0], dx : dx + added.shape[1]] += added
        touched[dy : dy + added.shape[0], dx : dx + added.shape[1]] = True
    out = np.empty((dst_h, dst_w, 3), np.uint8)
    out[...] = sums.to_uint8(bg * full)
    out[touched] = sums.to_uint8(acc[touched] + bg * full)
    return out


__all__ = ["BAND_BYTES", "AxisWeights", "area_weights", "axis_weights", "shrink_banded", "shrink_sparse"]
