"""Heatmaps streamed as rows, whatever file they go to: the row writer every heatmap file's writer
builds on, and the values, reductions and pyramid sizes they share.

:class:`HeatmapRowWriter` holds a streamed heatmap's settings, checked (size,
channel names and colours, physical pixel size, tile, stored dtype and
``value_scale``), and takes its rows top to bottom; :func:`quantise` makes
the stored values (``value = stored * value_scale``), :func:`halve` each
reduced level from the one before, and :func:`pyramid_shapes` the levels'
sizes. The OME-TIFF (:mod:`.ome_tiff`) and OME-Zarr (:mod:`.ome_zarr`)
writers are made of them, so both files hold the same pyramid.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import numpy as np

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.detections import parse_color

_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "float32": np.float32}
# Heatmap channels' display colours (RRGGBB) where none are given: a reader shows each class in its own.
CHANNEL_PALETTE = ("FF0000", "00FF00", "0000FF", "FFFF00", "FF00FF", "00FFFF", "FF8000", "8000FF")


def quantise(values: np.ndarray, dtype: np.dtype, value_scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """Values (float) to stored values: ``values / value_scale``, rounded and clipped to an integer ``dtype``.

    ``out``: an array of ``dtype`` and ``values``' shape to write them into (returned).
    """
    # float32 arithmetic in one scratch array, rounded and clipped in place.
    scaled = np.multiply(values, np.float32(1.0 / value_scale), dtype=np.float32)
    if dtype.kind != "f":
        info = np.iinfo(dtype)
        np.rint(scaled, out=scaled)
        np.clip(scaled, info.min, info.max, out=scaled)
    if out is None:
        return scaled.astype(dtype)
    out[...] = scaled
    return out


def halve(band: np.ndarray) -> np.ndarray:
    """2x2 mean of a ``C x h x w`` band, ``C x ceil(h/2) x ceil(w/2)``, in the band's dtype.

    Odd sizes repeat the last row / column; integer results are rounded to
    nearest (ties to even). Each reduced level of the heatmap files is made by it.
    """
    _, h, w = band.shape
    h2, w2 = math.ceil(h / 2), math.ceil(w / 2)
    data = band.astype(np.float32)
    if (2 * h2, 2 * w2) != (h, w):
        data = np.pad(data, ((0, 0), (0, 2 * h2 - h), (0, 2 * w2 - w)), mode="edge")
    # The four pixels of each 2x2 block summed as strided views: several times faster than a mean over two
    # axes of a 5-D reshape, and exact for stored integers.
    mean = (data[:, 0::2, 0::2] + data[:, 1::2, 0::2] + data[:, 0::2, 1::2] + data[:, 1::2, 1::2]) * np.float32(0.25)
    return (mean if band.dtype.kind == "f" else np.rint(mean)).astype(band.dtype)


def pyramid_shapes(height: int, width: int, tile: int, levels: int | str = "auto") -> list[tuple[int, int]]:
    """(height, width) of each pyramid level, level 0 first, each half the previous (rounded up).

    ``levels="auto"`` halves until the level fits in one tile.
    """
    shapes = [(height, width)]
    if levels == "auto":
        while max(shapes[-1]) > tile:
            h, w = shapes[-1]
            shapes.append((math.ceil(h / 2), math.ceil(w / 2)))
        return shapes
    if not isinstance(levels, int) or levels < 1:
        msg = f"levels: expected 'auto' or an int >= 1, found {levels!r}"
        raise ValueError(msg)
    while len(shapes) < levels and max(shapes[-1]) > 1:
        h, w = shapes[-1]
        shapes.append((math.ceil(h / 2), math.ceil(w / 2)))
    return shapes


class HeatmapRowWriter:
    """What every streaming heatmap writer shares: its settings, checked, and the order of the rows it takes.

    Subclasses call :meth:`_init_heatmap` first in ``__init__`` and
    :meth:`_check_rows` first in ``write_rows``.
    """

    path: Path
    _next_row: int
    _finished: bool

    def _init_heatmap(
        self,
        path: str | os.PathLike[str],
        width: int,
        height: int,
        channels: int,
        channel_names: Sequence[str] | None,
        physical_size_um: tuple[float, float] | None,
        tile: int,
        dtype: str | np.dtype,
        value_scale: float | None,
        channel_colors: Sequence[str | Sequence[int]] | None = None,
    ) -> None:
        self.path = Path(path)
        dtype_name = np.dtype(dtype).name
        if dtype_name not in _DTYPES:
            msg = f"{self.path}: dtype expected one of {sorted(_DTYPES)}, found {dtype_name}"
            raise ValueError(msg)
        if width <= 0 or height <= 0 or channels <= 0:
            msg = f"{self.path}: expected positive width, height and channels, found {width}, {height}, {channels}"
            raise ValueError(msg)
        if tile <= 0 or tile % 16:
            msg = f"{self.path}: tile expected a positive multiple of 16, found {tile}"
            raise ValueError(msg)
        if channel_names is None:
            channel_names = [f"channel_{k}" for k in range(channels)]
        channel_names = [str(n) for n in channel_names]
        if len(channel_names) != channels:
            msg = f"{self.path}: expected {channels} channel names, found {len(channel_names)}"
            raise ValueError(msg)
        if physical_size_um is not None and not all(float(v) > 0 for v in physical_size_um):
            msg = f"{self.path}: physical_size_um expected two sizes > 0, found {physical_size_um}"
            raise ValueError(msg)
        self.width, self.height, self.channels = int(width), int(height), int(channels)
        self.channel_names = channel_names
        colors = (
            [CHANNEL_PALETTE[k % len(CHANNEL_PALETTE)] for k in range(channels)]
            if channel_colors is None
            else ["{:02X}{:02X}{:02X}".format(*parse_color(c)) for c in channel_colors]
        )
        if len(colors) != channels:
            raise ValueError(f"{self.path}: expected {channels} channel colours, found {len(colors)}")
        self.channel_colors = colors  # "RRGGBB", the same in the OME-TIFF's OME-XML and the OME-Zarr
        self.physical_size_um = physical_size_um
        self.tile = int(tile)
        self.dtype = np.dtype(_DTYPES[dtype_name])
        if value_scale is None:
            value_scale = {"uint8": 1 / 255, "uint16": 1 / 65535, "float32": 1.0}[dtype_name]
        if not value_scale > 0:
            msg = f"{self.path}: value_scale expected > 0, found {value_scale}"
            raise ValueError(msg)
        self.value_scale = float(value_scale)
        self._next_row = 0
        self._finished = False

    def _check_rows(self, y0_out: int, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """``rows`` as an array and the row after them, once they are the next rows of the right shape."""
        if self._finished:
            msg = f"{self.path}: rows written after the heatmap was closed"
            raise WSIPipelineError(msg)
        rows = np.asarray(rows)
        if rows.ndim != 3 or rows.shape[0] != self.channels or rows.shape[2] != self.width:
            msg = f"{self.path}: expected rows of shape ({self.channels}, h, {self.width}), found {rows.shape}"
            raise WSIPipelineError(msg)
        if y0_out != self._next_row:
            msg = f"{self.path}: expected rows from {self._next_row} (top to bottom), found rows from {y0_out}"
            raise WSIPipelineError(msg)
        y1 = y0_out + rows.shape[1]
        if y1 > self.height:
            msg = f"{self.path}: rows {y0_out}..{y1} pass the heatmap height {self.height}"
            raise WSIPipelineError(msg)
        return rows, y1

    def write_rows(self, y0_out: int, rows: np.ndarray) -> None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def close(self) -> Path:  # pragma: no cover
        raise NotImplementedError

    def _must_finish(self) -> bool:
        """Whether ``close()`` has work to do: False once closed; after ``abort()``, an error when rows are missing."""
        if self._finished:
            return False
        if self._next_row != self.height:
            self.abort()
            msg = f"{self.path}: closed after {self._next_row} of {self.height} heatmap rows"
            raise WSIPipelineError(msg)
        return True

    def abort(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def __call__(self, y0_out: int, rows: np.ndarray) -> None:
        """Store output rows ``y0_out .. y0_out + h`` (rows: C x h x width float)."""
        self.write_rows(y0_out, rows)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
