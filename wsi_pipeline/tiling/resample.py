"""Patches resampled on the device as the CPU reader resamples them (OpenCV's ``INTER_AREA``).

A grid whose resolution is no stored level's (a 20x model on a 40x scan) reads ``read_size`` px of
the nearest finer level and shrinks them to the model's ``size`` (:func:`..tiling.grid.read_tile`:
``cv2.resize(..., interpolation=cv2.INTER_AREA)``). On the GPU the same pixels come from here:

- an integer factor ``k`` with patch origins on multiples of ``k`` (the usual 2x or 4x): the
  canvas the patches lie in is averaged over ``k x k`` cells once, then the patches are cut from
  it, so the overlap of neighbouring patches is averaged once. The rounding is OpenCV's: half up
  for ``k = 2`` (its ``(sum + 2) >> 2``), half to even otherwise.
- any other factor: each patch as ``Wy @ patch @ Wx^T`` with OpenCV's area weights
  (:func:`~..slide.area.area_weights`, which the CPU's banded reads use too), in float32, rounded
  half to even.

``tests/test_storage_kinds.py`` holds both against the CPU reader's tiles (``cv2.resize``).

OpenCV is not used on the device and torch's ``interpolate(mode="area")`` (adaptive average
pooling) bins pixels differently for factors that are not integers, hence the weights here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..slide.area import area_weights

# Patches resampled at once by the weighted path (float32 work memory: n x read_size^2 x 3 x 4 bytes).
_CHUNK = 16


def _integer_factor(read_size: int, size: int, offsets: Sequence[int]) -> int | None:
    k, rest = divmod(read_size, size)
    if rest or k < 1 or any(o % k for o in offsets):
        return None
    return k


def resample_patches(
    canvas: torch.Tensor, offsets_x: Sequence[int], offsets_y: Sequence[int], read_size: int, size: int
) -> torch.Tensor:
    """Patches of ``canvas`` (``H x W x 3`` uint8) at ``(offsets_x[i], offsets_y[i])``, ``read_size``
    px square, each shrunk to ``size`` px as ``cv2.resize(patch, (size, size), INTER_AREA)``.

    Returns ``n x size x size x 3`` uint8 on the canvas's device.
    """
    device = canvas.device
    n = len(offsets_x)
    k = _integer_factor(read_size, size, [*offsets_x, *offsets_y])
    if k is not None:
        h, w = canvas.shape[0] // k * k, canvas.shape[1] // k * k
        cells = canvas[:h, :w].permute(2, 0, 1).reshape(3, h // k, k, w // k, k).to(torch.int32).sum(dim=(2, 4))
        if k == 2:
            small = torch.div(cells + 2, 4, rounding_mode="floor")
        else:
            small = torch.round(cells.to(torch.float64) / (k * k))
        small = small.to(torch.uint8).permute(1, 2, 0)
        ar = torch.arange(size, device=device)
        yy = torch.tensor([o // k for o in offsets_y], device=device)[:, None] + ar[None, :]
        xx = torch.tensor([o // k for o in offsets_x], device=device)[:, None] + ar[None, :]
        return small[yy[:, :, None], xx[:, None, :]]
    weights = torch.from_numpy(area_weights(read_size, size)).to(device=device, dtype=torch.float32)
    out = torch.empty((n, size, size, 3), dtype=torch.uint8, device=device)
    ar = torch.arange(read_size, device=device)
    for start in range(0, n, _CHUNK):
        ox = torch.tensor(offsets_x[start : start + _CHUNK], device=device)
        oy = torch.tensor(offsets_y[start : start + _CHUNK], device=device)
        yy = oy[:, None] + ar[None, :]
        xx = ox[:, None] + ar[None, :]
        patches = canvas[yy[:, :, None], xx[:, None, :]].permute(0, 3, 1, 2).to(torch.float32)  # m x 3 x R x R
        shrunk = weights @ patches @ weights.T  # m x 3 x size x size
        out[start : start + len(ox)] = torch.round(shrunk).clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return out


__all__ = ["resample_patches"]
