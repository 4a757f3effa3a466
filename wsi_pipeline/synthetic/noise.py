"""Deterministic noise for synthetic scenes, evaluable on any region without global state.

Two building blocks:

* :class:`LatticeField`: smooth multi-octave value noise. Node values are hashed from
  (seed, salt, node index), so any window of the field can be evaluated on its own and
  gives bit-identical values wherever the window starts.
* :class:`PeriodicTexture`: a small periodic texture (grain, fibres, brushing) with an
  area-averaged copy per power-of-two downsample, so a render at downsample ``d``
  shows what downsampling a render at 1 would.

All coordinates are level-0 pixels (origin top-left, x right, y down). Arithmetic on
sample positions is elementwise and in a fixed order (no BLAS, no resampling whose result
depends on the window origin): that is what makes region renders tile exactly.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

_MASK64 = (1 << 64) - 1


def mix_int(*values: int) -> int:
    """Hash integers to one 64-bit integer (splitmix64 chained); pure Python, deterministic."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (v & _MASK64)) & _MASK64
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z


def hash_uniform(key: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Uniform values in [-1, 1) hashed from integer lattice indices.

    ``i`` and ``j`` are int64 arrays that broadcast together; returns float32 of their
    broadcast shape. Negative indices are fine (they wrap as unsigned 64-bit integers).
    """
    iu = np.asarray(i, dtype=np.int64).astype(np.uint64)
    ju = np.asarray(j, dtype=np.int64).astype(np.uint64)
    z = iu * np.uint64(0xD1B54A32D192ED03) + ju * np.uint64(0xABC98388FB8FAC03)
    z = z ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float64) * (2.0 / (1 << 24)) - 1.0
    return u.astype(np.float32)


def _smoothstep(t: np.ndarray) -> np.ndarray:
    return t * t * (3.0 - 2.0 * t)


class LatticeField:
    """Value noise summed over ``octaves`` lattices of spacing ``spacing_level0 / 2**o``.

    The octaves are folded into node values on the finest lattice (each coarser octave is
    sampled at the fine nodes), and the field between fine nodes is the smoothstep-bilinear
    interpolation of those values. Evaluating a window therefore costs one interpolation
    whatever the number of octaves. Values lie in about [-sum(w), sum(w)] with weights
    ``w_o = persistence**o``.
    """

    def __init__(self, key: int, spacing_level0: float, octaves: int = 3, persistence: float = 0.5):
        if octaves < 1:
            raise ValueError("octaves must be >= 1")
        self.key = key
        self.octaves = octaves
        self.fine_spacing = float(spacing_level0) / (1 << (octaves - 1))
        self.weights = [persistence**o for o in range(octaves)]
        self._octave_keys = [mix_int(key, o) for o in range(octaves)]

    def _node_values(self, ii: np.ndarray, jj: np.ndarray) -> np.ndarray:
        """Field values at fine nodes (ii, jj) (int64 arrays that broadcast): float32.

        Elementwise only, so a node gets the same value whichever window asks for it.
        """
        total = np.zeros(np.broadcast_shapes(ii.shape, jj.shape), np.float32)
        for o in range(self.octaves):
            f = 1 << (self.octaves - 1 - o)  # fine nodes per node of octave o
            ci, cj = ii // f, jj // f
            tx = _smoothstep(((ii - ci * f) / f).astype(np.float32))
            ty = _smoothstep(((jj - cj * f) / f).astype(np.float32))
            key = self._octave_keys[o]
            v00 = hash_uniform(key, ci, cj)
            v10 = hash_uniform(key, ci + 1, cj)
            v01 = hash_uniform(key, ci, cj + 1)
            v11 = hash_uniform(key, ci + 1, cj + 1)
            top = v00 + tx * (v10 - v00)
            bottom = v01 + tx * (v11 - v01)
            total += np.float32(self.weights[o]) * (top + ty * (bottom - top))
        return total

    def _split(self, coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f = np.asarray(coords, dtype=np.float64) / self.fine_spacing
        idx = np.floor(f)
        t = _smoothstep((f - idx).astype(np.float32))
        return idx.astype(np.int64), t

    def grid(self, xs_level0: np.ndarray, ys_level0: np.ndarray) -> np.ndarray:
        """Field on the grid ``ys x xs`` (1-D level-0 positions): (len(ys), len(xs)) float32."""
        ix, tx = self._split(xs_level0)
        iy, ty = self._split(ys_level0)
        i0, i1 = int(ix.min()), int(ix.max()) + 1
        j0, j1 = int(iy.min()), int(iy.max()) + 1
        ii = np.arange(i0, i1 + 1, dtype=np.int64)[None, :]
        jj = np.arange(j0, j1 + 1, dtype=np.int64)[:, None]
        nodes = self._node_values(ii, jj)  # (nj, ni)
        left = nodes[:, ix - i0]
        rows = left + tx[None, :] * (nodes[:, ix - i0 + 1] - left)  # (nj, W)
        a = rows[iy - j0]
        b = rows[iy - j0 + 1]
        return a + ty[:, None] * (b - a)

    def points(self, x_level0: np.ndarray, y_level0: np.ndarray) -> np.ndarray:
        """Field at points (x[k], y[k]): (N,) float32, bit-identical to :meth:`grid` there."""
        ix, tx = self._split(np.ravel(x_level0))
        iy, ty = self._split(np.ravel(y_level0))
        v00 = self._node_values(ix, iy)
        v10 = self._node_values(ix + 1, iy)
        v01 = self._node_values(ix, iy + 1)
        v11 = self._node_values(ix + 1, iy + 1)
        a = v00 + tx * (v10 - v00)
        b = v01 + tx * (v11 - v01)
        return a + ty * (b - a)


class PeriodicTexture:
    """A periodic float32 texture of period ``size`` level-0 pixels, with area-averaged
    copies for downsamples 2, 4, ... so that sampling at downsample ``d`` equals the
    average of the level-0 texture over each ``d x d`` block (exactly, for powers of two).
    """

    def __init__(self, base: np.ndarray):
        size = base.shape[0]
        if base.shape != (size, size) or size & (size - 1):
            raise ValueError("texture must be square with a power-of-two side")
        self.size = size
        self.levels = [np.ascontiguousarray(base, dtype=np.float32)]
        while self.levels[-1].shape[0] > 1:
            t = self.levels[-1]
            self.levels.append(0.25 * (t[0::2, 0::2] + t[1::2, 0::2] + t[0::2, 1::2] + t[1::2, 1::2]))

    def sample(self, xs_level0: np.ndarray, ys_level0: np.ndarray, downsample: float) -> np.ndarray:
        """Texture on the grid ``ys x xs`` of pixel centres at ``downsample``: (H, W) float32."""
        k = min(max(round(math.log2(max(downsample, 1.0))), 0), len(self.levels) - 1)
        tex = self.levels[k]
        step = float(1 << k)
        n = tex.shape[0]
        gx = np.floor(np.asarray(xs_level0) / step).astype(np.int64) % n
        gy = np.floor(np.asarray(ys_level0) / step).astype(np.int64) % n
        return tex[gy[:, None], gx[None, :]]


def make_texture(key: int, size: int, sigma_x: float, sigma_y: float) -> np.ndarray:
    """Zero-mean, unit-std periodic noise texture (size x size float32) blurred by
    ``sigma_x``/``sigma_y`` level-0 pixels with wrap-around borders (so it tiles)."""
    rng = np.random.default_rng(key)
    t = rng.standard_normal((size, size)).astype(np.float32)
    if sigma_x > 0 or sigma_y > 0:
        # Blur with wrap-around padding and crop: the texture stays periodic.
        px = min(int(math.ceil(4 * sigma_x)) + 1, size)
        py = min(int(math.ceil(4 * sigma_y)) + 1, size)
        big = cv2.GaussianBlur(
            np.pad(t, ((py, py), (px, px)), mode="wrap"), (0, 0), sigmaX=max(sigma_x, 1e-3), sigmaY=max(sigma_y, 1e-3)
        )
        t = np.ascontiguousarray(big[py : py + size, px : px + size])
    t -= t.mean()
    t /= max(float(t.std()), 1e-6)
    return t
