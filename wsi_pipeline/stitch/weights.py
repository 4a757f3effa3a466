"""Position weights of a tile's heatmap for blending overlapping tiles.

Every function returns an H x W float32 array of strictly positive weights in
the tile's heatmap pixels, so that the blended value sum(w * p) / sum(w) is
defined wherever a tile lies.
"""

from __future__ import annotations

import numpy as np

KINDS = ("gaussian", "hann", "linear", "constant")
# MONAI's compute_importance_map clamps its map to at least this value.
_GAUSSIAN_MIN = 1e-3


def _size2(size_px: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(size_px, int | np.integer):
        h = w = int(size_px)
    else:
        h, w = (int(v) for v in size_px)
    if h <= 0 or w <= 0:
        msg = f"size_px: expected positive sizes, found {size_px}"
        raise ValueError(msg)
    return h, w


def gaussian_1d(n: int, sigma_scale: float) -> np.ndarray:
    """MONAI's 1-D Gaussian: centred on (n - 1) / 2 with sigma = sigma_scale * n, float32."""
    x = np.arange(-(n - 1) / 2.0, (n - 1) / 2.0 + 1, dtype=np.float32)
    sigma = n * sigma_scale
    return np.exp(x**2 / (-2 * sigma**2)).astype(np.float32)


def hann_1d(n: int) -> np.ndarray:
    """Hann window sampled at pixel centres: never exactly zero, symmetric, float64."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * (np.arange(n) + 0.5) / n)


def linear_1d(n: int, overlap_px: int) -> np.ndarray:
    """1 in the core, a ramp over the ``overlap_px`` pixels at each end, float64.

    Sampled at pixel centres ((i + 0.5) / overlap), so the ramps of two tiles
    overlapping by exactly ``overlap_px`` add up to 1 pixel by pixel.
    """
    if overlap_px <= 0:
        return np.ones(n)
    i = np.arange(n) + 0.5
    return np.minimum(1.0, np.minimum(i, n - i) / overlap_px)


def tile_weights(
    size_px: int | tuple[int, int],
    kind: str = "gaussian",
    sigma_scale: float = 0.125,
    overlap_px: int | None = None,
) -> np.ndarray:
    """Blending weights of one tile.

    Args:
        size_px: the tile's heatmap size, H = W or (H, W), in heatmap pixels.
        kind: ``"gaussian"`` (equal to MONAI's
            ``compute_importance_map(mode="gaussian", sigma_scale=...)``:
            sigma = sigma_scale * size per axis, product of 1-D Gaussians,
            clamped below at 1e-3, peak 1, not normalised), ``"hann"`` (2-D Hann
            window at pixel centres), ``"linear"`` (1 in the core, linear ramps
            over ``overlap_px`` at each border: a partition of unity across
            overlaps of exactly ``overlap_px``), ``"constant"`` (ones).
        sigma_scale: for ``"gaussian"`` only.
        overlap_px: for ``"linear"`` only (required there), in heatmap pixels.

    Returns:
        H x W float32, all values > 0.
    """
    h, w = _size2(size_px)
    if kind == "gaussian":
        if sigma_scale <= 0:
            msg = f"sigma_scale: expected > 0, found {sigma_scale}"
            raise ValueError(msg)
        wy = gaussian_1d(h, sigma_scale)
        wx = gaussian_1d(w, sigma_scale)
        out = wy[:, None] * wx[None, :]
        return np.maximum(out, max(float(out.min()), _GAUSSIAN_MIN)).astype(np.float32)
    if kind == "hann":
        return (hann_1d(h)[:, None] * hann_1d(w)[None, :]).astype(np.float32)
    if kind == "linear":
        if overlap_px is None or overlap_px < 0:
            msg = f"overlap_px: expected a non-negative overlap in heatmap pixels for kind='linear', found {overlap_px}"
            raise ValueError(msg)
        return (linear_1d(h, overlap_px)[:, None] * linear_1d(w, overlap_px)[None, :]).astype(np.float32)
    if kind == "constant":
        return np.ones((h, w), dtype=np.float32)
    msg = f"kind: expected one of {KINDS}, found {kind!r}"
    raise ValueError(msg)
