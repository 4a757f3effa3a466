"""Sinks for the blended heatmap's rows: in memory, statistics, a reduced copy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cv2
import numpy as np

from wsi_pipeline.errors import ModelError
from wsi_pipeline.stitch.background import BackgroundCalls
from wsi_pipeline.stitch.blend import HostCopy, Sink

if TYPE_CHECKING:  # statistics read the mask's array and downsample only
    from wsi_pipeline.tiling.tissue import TissueMask


class ArraySink:
    """Collects all rows into one ``C x H x W`` float32 array (``.array``)."""

    def __init__(self, channels: int, height: int, width: int):
        self.array = np.zeros((channels, height, width), np.float32)

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        self.array[:, y0 : y0 + rows.shape[1]] = rows


class FiniteCheck:
    """Fails the run on the first band with a NaN or infinite value (a model's heatmap must be finite).

    Without it such a heatmap is stored as all-0 or all-255 bytes and its statistics are NaN.
    ``class_names``: the heatmap's channels; ``scale_level0``: level-0 pixels per heatmap pixel.
    """

    def __init__(self, class_names: Sequence[str], scale_level0: float):
        self.class_names = list(class_names)
        self.scale = scale_level0

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        # A float64 sum of finite float32 values cannot overflow: it is finite exactly when they all are.
        if np.isfinite(rows.sum(dtype=np.float64)):
            return
        bad = [n for n, ch in zip(self.class_names, rows, strict=False) if not np.isfinite(ch).all()]
        y1 = y0 + rows.shape[1]
        msg = (
            f"the model's heatmap has NaN or infinite values (class {', '.join(map(repr, bad))}, "
            f"level-0 y {int(y0 * self.scale)}-{int(y1 * self.scale)}); a heatmap must be finite"
        )
        raise ModelError(msg)


class HeatmapStats:
    """Per-class statistics over the tissue, computed as rows stream by.

    ``scale_level0``: level-0 pixels per heatmap pixel. Tissue membership of
    each heatmap pixel is looked up in the (coarser) tissue mask.
    """

    def __init__(
        self, channels: int, width: int, scale_level0: float, tissue: TissueMask | None, threshold: float = 0.5
    ):
        self.channels = channels
        self.threshold = threshold
        self.scale = scale_level0
        self.tissue = tissue
        self.above = np.zeros(channels, np.int64)
        self.sum = np.zeros(channels, np.float64)
        self.max = np.zeros(channels, np.float64)
        self.tissue_px = 0
        if tissue is not None:
            mh, mw = tissue.mask.shape
            xs = ((np.arange(width) + 0.5) * scale_level0 / tissue.downsample[0]).astype(np.int64)
            # The mask's columns at each heatmap column, gathered once: a band then gathers rows only.
            self._mask_cols = tissue.mask[:, np.clip(xs, 0, mw - 1)] & (xs < mw)[None, :]

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        c, h = rows.shape[:2]
        if self.tissue is not None:
            mh = self.tissue.mask.shape[0]
            ys = ((np.arange(y0, y0 + h) + 0.5) * self.scale / self.tissue.downsample[1]).astype(np.int64)
            sel = self._mask_cols[np.clip(ys, 0, mh - 1)]
            sel[ys >= mh] = False
        else:
            sel = np.ones(rows.shape[1:], bool)
        n = int(np.count_nonzero(sel))
        self.tissue_px += n
        if n == 0:
            return
        # Whole-band reductions over the rows with the pixels outside the tissue set to 0: contiguous
        # passes, several times faster than numpy's masked (``where=``) reductions.
        inside = np.where(sel, rows, np.float32(0)).reshape(c, -1)
        self.above += np.count_nonzero(((rows > self.threshold) & sel).reshape(c, -1), axis=1)
        self.sum += inside.sum(axis=1, dtype=np.float64)
        self.max = np.maximum(self.max, inside.max(axis=1, initial=0.0))

    def summary(self, class_names: Sequence[str], mm2_per_px: float | None) -> dict:
        out = {}
        for c, name in enumerate(class_names):
            out[name] = {
                f"area_above_{self.threshold:g}_mm2": (self.above[c] * mm2_per_px) if mm2_per_px else None,
                f"fraction_of_tissue_above_{self.threshold:g}": (self.above[c] / self.tissue_px)
                if self.tissue_px
                else 0.0,
                "mean_probability": (self.sum[c] / self.tissue_px) if self.tissue_px else 0.0,
                "max_probability": float(self.max[c]),
            }
        return out


class ReducedCopy:
    """A block-averaged copy of the heatmap, ``factor`` x smaller per axis (for overlays)."""

    def __init__(self, channels: int, height: int, width: int, factor: int):
        self.factor = max(1, int(factor))
        self.width = width
        self.array = np.zeros((channels, math.ceil(height / self.factor), math.ceil(width / self.factor)), np.float32)
        self._pending: list[np.ndarray] = []
        self._pending_y0 = 0
        self._next_out = 0

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        self._pending.append(rows)
        buf = np.concatenate(self._pending, axis=1) if len(self._pending) > 1 else rows
        n_full = buf.shape[1] // self.factor
        if n_full:
            self._emit(buf[:, : n_full * self.factor])
            rest = buf[:, n_full * self.factor :]
            self._pending = [rest] if rest.shape[1] else []
        else:
            self._pending = [buf]

    def _emit(self, block: np.ndarray) -> None:
        c, h, w = block.shape
        f = self.factor
        wpad = math.ceil(w / f) * f
        if wpad != w:
            block = np.concatenate([block, np.repeat(block[:, :, -1:], wpad - w, axis=2)], axis=2)
        if f == 1:
            red = block
        else:
            # Block means: OpenCV's area interpolation at an integer factor is exactly that, and
            # several times faster than numpy's mean over two axes of a 5-D view.
            red = np.stack(
                [
                    cv2.resize(np.ascontiguousarray(ch), (wpad // f, h // f), interpolation=cv2.INTER_AREA)
                    for ch in block
                ]
            )
        self.array[:, self._next_out : self._next_out + red.shape[1]] = red
        self._next_out += red.shape[1]

    def close(self) -> None:
        if self._pending:
            buf = np.concatenate(self._pending, axis=1)
            f = self.factor
            pad = f - buf.shape[1]
            buf = np.concatenate([buf, np.repeat(buf[:, -1:], pad, axis=1)], axis=1)
            self._emit(buf)
            self._pending = []


class BackgroundSink:
    """Calls each of ``sinks`` from a thread of its own (:class:`~.background.BackgroundCalls`).

    The statistics, reduced copy and file writers work on whole bands of
    rows: large numpy operations that mostly run without the interpreter
    lock, in parallel with the stitching and with each other. At most
    ``max_pending`` bands wait per thread (each a fresh array the blender
    gave away; the sinks only read it). Rows still being copied from the
    device (:meth:`put_copy`) are waited for on those threads. A failure in a
    sink is raised by the next call and by :meth:`close`.
    """

    def __init__(self, *sinks: Sink, max_pending: int = 8, name: str = "heatmap-sink"):
        if not sinks:
            raise ValueError("BackgroundSink: expected at least one sink")
        self._sinks = sinks
        self._calls = [
            BackgroundCalls(max_pending, name if len(sinks) == 1 else f"{name}-{i}") for i in range(len(sinks))
        ]

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        for calls, sink in zip(self._calls, self._sinks, strict=True):
            calls.call(sink, y0, rows)

    def put_copy(self, y0: int, copy: HostCopy) -> None:
        """Rows whose copy to the host may be under way: each sink's thread waits for it, then calls it."""
        for calls, sink in zip(self._calls, self._sinks, strict=True):
            calls.call(_after_copy, sink, y0, copy)

    def close(self) -> None:
        """Wait until every band handed over is through the sinks; raise the first failure. Idempotent."""
        errors = []
        for calls in self._calls:
            try:
                calls.close()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def abandon(self) -> None:
        """End the threads after a failed run, raising nothing."""
        for calls in self._calls:
            calls.abandon()


def _after_copy(sink: Sink, y0: int, copy: HostCopy) -> None:
    sink(y0, copy.wait())


def fan_out(*sinks: Sink | None) -> Sink:
    """One sink that calls each of ``sinks`` in turn."""
    active = [s for s in sinks if s is not None]

    def sink(y0: int, rows: np.ndarray) -> None:
        for s in active:
            s(y0, rows)

    return sink
