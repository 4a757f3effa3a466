"""Streaming weighted blending of tile heatmaps into one slide heatmap.

The output canvas is in heatmap pixels: canvas pixel (i, j) covers the level-0
square of side ``downsample * stride`` whose top-left corner is
(j * downsample * stride, i * downsample * stride). Tile (row, col) covers
canvas rows ``[row * step_out, row * step_out + tile_size_out)`` and the same
for columns, except the last row and column, moved back by ``last_row_shift_out``
and ``last_col_shift_out`` to end at the slide's border (the grid's edge
policy). Each output pixel is ``sum(w * p) / sum(w)`` over the tiles that
cover it, with ``w`` the tile's position weights (:mod:`.weights`); a tile
the tissue mask skipped counts as p = 0 with its weights.

Every grid tile counts with its weights, added or skipped, so the weight
sum depends on the grid alone: it is built from one tile row's weights
(``tile_size_out x canvas_width``, made once) when rows are emitted, and a
skipped tile costs no array work.

Memory: only a band of tile rows is held, ``window_rows`` tile rows deep, in
an accumulator twice its height (C x 2 band_height x canvas_width float32).
The accumulator is a numpy array, or a torch tensor on a device (``device=``):
the same operations then run there on heatmaps that never leave it, and only
finished rows are copied to the host for the sink.
Once every tile of rows <= r has arrived, canvas rows above
``(r + 1) * step_out`` are touched by no later tile: they are normalised,
handed to the sink top to bottom, and the band moves down. Peak memory
depends on the canvas width and the window, not on the slide height.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.geometry import TilingGeometry

Sink = Callable[[int, np.ndarray], None]


class HostCopy:
    """Rows on their way to the host: read them as :meth:`wait` returns them.

    The blender on a CUDA device starts each band's copy to pinned host memory
    and hands this over at once; a sink that takes it (``sink.put_copy(y0,
    copy)``, as :class:`~.sinks.BackgroundSink` does) waits for the copy on its
    own thread, so the stitching thread never waits for the device.
    """

    def __init__(self, rows: np.ndarray, event: Any = None):
        self._rows = rows
        self._event = event

    def wait(self) -> np.ndarray:
        """The rows (C x h x W float32), once the copy has finished (any thread, any number of times)."""
        if self._event is not None:
            self._event.synchronize()
        return self._rows


@dataclass(frozen=True)
class BlendGeometry:
    """Where tiles land on the heatmap canvas, all in heatmap pixels.

    Attributes:
        n_rows, n_cols: the tile grid's size.
        tile_size_out: a tile's heatmap side (tile_size_px / stride).
        step_out: distance between tile origins (step_px / stride).
        out_height, out_width: the slide's heatmap size; the canvas
            (the last tile's origin + tile_size_out per axis) is cropped to it.
        last_row_shift_out, last_col_shift_out: how far the last row and
            column are moved back from the lattice (the grid's edge policy).
    """

    n_rows: int
    n_cols: int
    tile_size_out: int
    step_out: int
    out_height: int
    out_width: int
    last_row_shift_out: int = 0
    last_col_shift_out: int = 0

    def __post_init__(self) -> None:
        if min(self.n_rows, self.n_cols, self.tile_size_out, self.step_out) <= 0:
            msg = f"blend geometry: expected positive grid size, tile size and step, found {self}"
            raise ValueError(msg)
        if self.step_out > self.tile_size_out:
            msg = f"blend geometry: step_out {self.step_out} > tile_size_out {self.tile_size_out} leaves gaps"
            raise ValueError(msg)
        if not (0 < self.out_height <= self.canvas_height and 0 < self.out_width <= self.canvas_width):
            msg = (
                f"blend geometry: output {self.out_height} x {self.out_width} must be positive and "
                f"within the tiles' canvas {self.canvas_height} x {self.canvas_width}"
            )
            raise ValueError(msg)

    @property
    def canvas_height(self) -> int:
        return self.row_y0(self.n_rows - 1) + self.tile_size_out

    @property
    def canvas_width(self) -> int:
        return self.col_x0(self.n_cols - 1) + self.tile_size_out

    def row_y0(self, row: int) -> int:
        """Canvas row of tile row ``row``'s top edge."""
        return row * self.step_out - (self.last_row_shift_out if row == self.n_rows - 1 else 0)

    def col_x0(self, col: int) -> int:
        """Canvas column of tile column ``col``'s left edge."""
        return col * self.step_out - (self.last_col_shift_out if col == self.n_cols - 1 else 0)

    @classmethod
    def from_tiling(cls, geometry: TilingGeometry) -> BlendGeometry:
        """The heatmap plane of a tiling (which must have a heatmap stride)."""
        g = geometry
        shift_x, shift_y = g.last_shift_grid
        return cls(
            n_rows=g.n_rows,
            n_cols=g.n_cols,
            tile_size_out=g.heatmap_tile,
            step_out=g.heatmap_step,
            out_height=g.heatmap_height,
            out_width=g.heatmap_width,
            last_row_shift_out=shift_y // g._stride(),
            last_col_shift_out=shift_x // g._stride(),
        )


class _HostArrays:
    """The blender's few array operations that differ between numpy and torch: numpy, on the host."""

    device = None

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    @staticmethod
    def put(a: Any) -> np.ndarray:
        """``a`` (numpy, or a torch tensor anywhere) as a float32 numpy array."""
        if not isinstance(a, np.ndarray) and hasattr(a, "detach"):
            a = a.detach().float().cpu().numpy()
        return np.asarray(a, dtype=np.float32)

    @staticmethod
    def to_host(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def to_host_later(a: np.ndarray) -> HostCopy:
        return HostCopy(a)

    @staticmethod
    def permute(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return a.transpose(axes)

    @staticmethod
    def every_other_tile(band: np.ndarray, x0: int, shape: tuple[int, ...], step: int) -> np.ndarray:
        """A view of ``band`` (C x t x W) as C x t x n x t: n tiles of width t, ``step`` columns apart, from x0."""
        sub = band[:, :, x0:]
        st = sub.strides
        return np.lib.stride_tricks.as_strided(sub, shape=shape, strides=(st[0], st[1], step * st[2], st[2]))


class _TorchArrays:
    """The same operations on torch tensors on ``device`` (e.g. the CUDA device the model ran on)."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return self.torch.zeros(shape, dtype=self.torch.float32, device=self.device)

    def put(self, a: Any) -> Any:
        """``a`` (numpy or torch) as a float32 tensor on the device.

        A CUDA tensor made on another stream (an executor's) must be complete
        when given; it is marked as used on this thread's stream, so its memory
        is not reused before the blending queued here has read it.
        """
        torch = self.torch
        if not isinstance(a, torch.Tensor):
            a = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        a = a.to(self.device, torch.float32, non_blocking=False)
        if self._cuda:
            a.record_stream(torch.cuda.current_stream(self.device))
        return a

    @staticmethod
    def to_host(a: Any) -> np.ndarray:
        return a.cpu().numpy()

    def to_host_later(self, a: Any) -> HostCopy:
        """``a``'s copy to the host, started on this thread's stream (into pinned memory on CUDA)."""
        if not self._cuda:
            return HostCopy(self.to_host(a))
        torch = self.torch
        # Pinned blocks come from torch's caching host allocator: one is reused once the copy
        # recorded on it has finished and nothing holds it.
        host = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
        host.copy_(a, non_blocking=True)
        # A blocking event: the sinks' threads sleep while they wait instead of spinning on a core
        # the JPEG helpers and the loader need.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return HostCopy(host.numpy(), event)

    @staticmethod
    def permute(a: Any, axes: tuple[int, ...]) -> Any:
        return a.permute(axes)

    @staticmethod
    def every_other_tile(band: Any, x0: int, shape: tuple[int, ...], step: int) -> Any:
        sub = band[:, :, x0:]
        st = sub.stride()
        return sub.as_strided(shape, (st[0], st[1], step * st[2], st[2]), sub.storage_offset())


# The blender's accumulator and weight sum together may take at most this: they span the slide's width,
# so a slide of extreme aspect ratio (1 x 10,000,000 px) is refused rather than allocated (see band_bytes).
MAX_BAND_BYTES = 512 << 20


# The heatmap's pixels a class may hold: its rows are blended, handed to every sink and spooled for
# its files whether tiles ran there or not, so its cost follows the size a slide claims. A 75 x 50 mm
# whole-mount slide at 0.25 um/px and stride 8 gives 0.94 G px; a level claiming more than 2 G px of
# heatmap (400,000 px square at stride 8: 2.5 G px, minutes and 5 GB of spool a class) is larger than
# any glass slide holds at stride 8: a sparse or forged matrix, refused before its tiles run
# (slide_plan.py). A model of a finer stride meets the limit on a smaller level (--mpp reads it coarser).
MAX_HEATMAP_PIXELS = 2 << 30


def band_bytes(geometry: BlendGeometry, channels: int, window_rows: int = 3) -> int:
    """Bytes of a :class:`HeatmapBlender`'s accumulator and one tile row's weight sum for ``geometry``.

    The rows handed to the sinks are a band of the same width: a run's heatmap memory is a few times this.
    """
    g = geometry
    band_height = (min(window_rows, g.n_rows) - 1) * g.step_out + g.tile_size_out
    return 4 * g.canvas_width * (channels * 2 * band_height + g.tile_size_out)


class HeatmapBlender:
    """Blend tile heatmaps into a slide heatmap, streaming finished rows to a sink.

    Args:
        geometry: where tiles land (:class:`BlendGeometry`).
        channels: C, the heatmap's channel count.
        weights: tile_size_out x tile_size_out float weights, all > 0
            (:func:`wsi_pipeline.stitch.weights.tile_weights`).
        sink: called as ``sink(y0_out, rows)`` with rows a C x h x out_width
            float32 array of final output rows starting at output row
            ``y0_out``; calls come top to bottom, contiguous, and together
            cover rows 0..out_height-1 exactly once. A sink with a
            ``put_copy(y0_out, copy)`` method gets a :class:`HostCopy` that way
            instead, the rows' copy from the device maybe still under way.
        window_rows: how many tile rows may be open at once. A tile of row r
            is accepted while r < (first incomplete row) + window_rows;
            larger windows tolerate more out-of-order arrival and hold a
            deeper band.
        device: None to blend in numpy on the host; a torch device (``"cuda:0"``,
            ``"cpu"``) to blend there, on the calling thread's current stream:
            heatmaps may then be torch tensors on that device (numpy ones are
            copied there), and the sink still gets numpy rows.

    Use: ``add(row, col, heatmap)`` or ``skip(row, col)`` once for every tile
    of the grid, in any order within the window, then ``close()``.
    """

    def __init__(
        self,
        geometry: BlendGeometry,
        channels: int,
        weights: np.ndarray,
        sink: Sink,
        window_rows: int = 3,
        device: Any = None,
    ) -> None:
        g = geometry
        if channels <= 0:
            msg = f"channels: expected > 0, found {channels}"
            raise ValueError(msg)
        weights = np.asarray(weights, dtype=np.float32)
        if weights.shape != (g.tile_size_out, g.tile_size_out):
            msg = f"weights: expected shape {(g.tile_size_out, g.tile_size_out)}, found {weights.shape}"
            raise ValueError(msg)
        if not (weights > 0).all():
            msg = "weights: expected all weights > 0"
            raise ValueError(msg)
        if window_rows < 1:
            msg = f"window_rows: expected >= 1, found {window_rows}"
            raise ValueError(msg)
        self.geometry = g
        self.channels = channels
        self.weights = weights
        self.sink = sink
        # A sink that takes rows still being copied (HostCopy) gets them so.
        self._put_copy: Callable[[int, HostCopy], None] | None = getattr(sink, "put_copy", None)
        self._xp: Any = _HostArrays() if device is None else _TorchArrays(device)
        self.device = self._xp.device
        self._w = self._xp.put(weights)
        self.window_rows = min(window_rows, g.n_rows)
        self.band_height = (self.window_rows - 1) * g.step_out + g.tile_size_out
        # The band slides down a buffer twice its height and is copied back to the top only when it
        # reaches the bottom: one copy per band height of output, not one per tile row.
        buf_rows = 2 * self.band_height
        self._num = self._xp.zeros((channels, buf_rows, g.canvas_width))
        # One tile row's weight sum, canvas_width wide: every tile row adds exactly this.
        self._row_weights = np.zeros((g.tile_size_out, g.canvas_width), dtype=np.float32)
        for c in range(g.n_cols):
            self._row_weights[:, g.col_x0(c) : g.col_x0(c) + g.tile_size_out] += weights
        self._weight_sums: dict[tuple, Any] = {}  # band layout -> its weight sum (read only, where _num is)
        self._off = 0  # buffer row of band row 0
        self._band_y0 = 0  # canvas row held at band row 0
        self._first_open_row = 0  # lowest tile row with tiles still to come
        self._done = np.zeros((g.n_rows, g.n_cols), dtype=bool)
        self._done_per_row = np.zeros(g.n_rows, dtype=np.int64)
        self._emitted = 0  # output rows handed to the sink so far
        self._closed = False

    @property
    def buffer_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the weighted-sum accumulator and of the one tile row's weight sum."""
        return tuple(self._num.shape), self._row_weights.shape

    def add(self, row: int, col: int, heatmap: np.ndarray) -> None:
        """Add tile (row, col)'s heatmap, C x tile_size_out x tile_size_out float."""
        g = self.geometry
        heatmap = self._xp.put(heatmap)
        expected = (self.channels, g.tile_size_out, g.tile_size_out)
        if tuple(heatmap.shape) != expected:
            msg = f"tile (row {row}, col {col}): expected a heatmap of shape {expected}, found {tuple(heatmap.shape)}"
            raise WSIPipelineError(msg)
        y, x = self._claim(row, col)
        t = g.tile_size_out
        self._num[:, y : y + t, x : x + t] += heatmap * self._w
        self._advance(row)

    def add_run(self, row: int, cols: np.ndarray, heatmaps: Any) -> None:
        """Add tiles (row, cols[i])'s heatmaps ``heatmaps[i]`` (``k x C x t x t``), cols increasing.

        The same as :meth:`add` for each; tiles two columns apart do not
        overlap when ``2 * step_out >= tile_size_out``, so in each run of
        consecutive columns the even and the odd tiles are each added in one
        operation (fewer, larger array operations than one per tile).
        """
        g = self.geometry
        cols = np.asarray(cols, np.int64)
        heatmaps = self._xp.put(heatmaps)
        t, s = g.tile_size_out, g.step_out
        if tuple(heatmaps.shape) != (len(cols), self.channels, t, t):
            msg = (
                f"tiles (row {row}, cols {cols.tolist()}): expected heatmaps of shape "
                f"{(len(cols), self.channels, t, t)}, found {tuple(heatmaps.shape)}"
            )
            raise WSIPipelineError(msg)
        if len(cols) == 0:
            return
        if g.last_col_shift_out and cols[-1] == g.n_cols - 1 and len(cols) > 1:
            # The shifted last column is off the even/odd stride: added on its own.
            self.add_run(row, cols[:-1], heatmaps[:-1])
            self.add(row, int(cols[-1]), heatmaps[-1])
            return
        if len(cols) < 4 or 2 * s < t or np.any(np.diff(cols) <= 0):
            for i, c in enumerate(cols):
                self.add(row, int(c), heatmaps[i])
            return
        for c in cols:  # checks each tile, marks it done
            y, _ = self._claim(row, int(c))
        weighted = heatmaps * self._w
        band = self._num[:, y : y + t]
        breaks = (np.flatnonzero(np.diff(cols) != 1) + 1).tolist()
        for a, b in zip([0, *breaks], [*breaks, len(cols)], strict=True):
            for first in range(a, min(a + 2, b)):
                c = int(cols[first])
                parity = c % 2
                # The row's columns of this parity on the lattice (a shifted last one is added alone).
                n = (g.n_cols - (1 if g.last_col_shift_out else 0) - parity + 1) // 2
                view = self._xp.every_other_tile(band, parity * s, (self.channels, t, n, t), 2 * s)
                k = (b - first + 1) // 2  # tiles first, first + 2, ... < b
                dst = view[:, :, c // 2 : c // 2 + k]
                dst += self._xp.permute(weighted[first:b:2], (1, 2, 0, 3))
        self._advance(row)

    def skip(self, row: int, col: int, stop_col: int | None = None) -> None:
        """Record tile (row, col) as background (p = 0 with its weights), e.g. no tissue.

        With ``stop_col``: tiles ``col .. stop_col - 1`` of the row.
        """
        stop_col = col + 1 if stop_col is None else stop_col
        if stop_col <= col:
            return
        self._claim(row, col, stop_col)
        self._advance(row)

    def close(self) -> None:
        """Flush the last rows. Every tile must have been added or skipped."""
        if self._closed:
            return
        missing = np.argwhere(~self._done)
        if len(missing):
            r, c = (int(v) for v in missing[0])
            msg = (
                f"heatmap blending closed with {len(missing)} tiles neither added nor skipped, first (row {r}, col {c})"
            )
            raise WSIPipelineError(msg)
        self._closed = True

    def _claim(self, row: int, col: int, stop_col: int | None = None) -> tuple[int, int]:
        """Mark tiles (row, col .. stop_col - 1) done; return the first one's top-left in band coordinates."""
        g = self.geometry
        stop_col = col + 1 if stop_col is None else stop_col
        if self._closed:
            msg = f"tile (row {row}, col {col}) arrived after the blender was closed"
            raise WSIPipelineError(msg)
        if not (0 <= row < g.n_rows and 0 <= col < stop_col <= g.n_cols):
            last = f"col {col}" if stop_col == col + 1 else f"cols {col}..{stop_col - 1}"
            msg = f"tile (row {row}, {last}): outside the grid of {g.n_rows} x {g.n_cols} tiles"
            raise WSIPipelineError(msg)
        if self._done[row, col:stop_col].any():
            twice = col + int(np.argmax(self._done[row, col:stop_col]))
            msg = f"tile (row {row}, col {twice}) arrived twice"
            raise WSIPipelineError(msg)
        if row < self._first_open_row:
            msg = f"tile (row {row}, col {col}) arrived after its rows were flushed"
            raise WSIPipelineError(msg)
        if row >= self._first_open_row + self.window_rows:
            msg = (
                f"tile (row {row}, col {col}) arrived before row {self._first_open_row} was complete, "
                f"outside the window of {self.window_rows} tile rows; raise window_rows"
            )
            raise WSIPipelineError(msg)
        self._done[row, col:stop_col] = True
        self._done_per_row[row] += stop_col - col
        return g.row_y0(row) - self._band_y0 + self._off, g.col_x0(col)

    def _advance(self, row: int) -> None:
        g = self.geometry
        if row != self._first_open_row or self._done_per_row[row] != g.n_cols:
            return  # only completing the first open row moves the band
        r = self._first_open_row
        while r < g.n_rows and self._done_per_row[r] == g.n_cols:
            r += 1
        if r == self._first_open_row:
            return
        self._first_open_row = r
        final_y = g.canvas_height if r == g.n_rows else g.row_y0(r)
        k = final_y - self._band_y0
        self._emit(k)
        if r < g.n_rows:
            # Move the band down by k rows: the rows below it in the buffer are still zero.
            self._off += k
            self._band_y0 = final_y
            off, end = self._off, self._num.shape[1]
            if off + self.band_height > end:  # past the buffer's end: back to its top
                n = end - off  # the band's rows that exist; the rest are zero
                self._num[:, :n] = self._num[:, off:]
                self._num[:, n:] = 0.0
                self._off = 0

    def _emit(self, k: int) -> None:
        g = self.geometry
        y0 = self._band_y0
        y1 = min(y0 + k, g.out_height)
        if y1 <= y0:
            return
        h = y1 - y0
        off = self._off
        num = self._num[:, off : off + h, : g.out_width]
        # Every finished canvas pixel lies under some tile, and every tile adds weights > 0.
        rows = num / self._weight_sum(y0, y1)[None]
        if self._put_copy is not None:
            self._put_copy(y0, self._xp.to_host_later(rows))
        else:
            self.sink(y0, self._xp.to_host(rows))
        self._emitted = y1

    def _weight_sum(self, y0: int, y1: int) -> Any:
        """The weight sum of output rows [y0, y1): every tile row's weights that reach them.

        Bands inside the slide repeat the same few layouts, so each is built once.
        """
        g = self.geometry
        t, s = g.tile_size_out, g.step_out
        rows = {*range(max(0, (y0 - t) // s), min(g.n_rows, (y1 - 1) // s + 1)), g.n_rows - 1}  # + the shifted last
        parts = tuple(
            (max(y0, top) - y0, max(y0, top) - top, min(y1, top + t) - max(y0, top))
            for top in (g.row_y0(r) for r in sorted(rows))
            if max(y0, top) < min(y1, top + t)
        )
        key = (y1 - y0, parts)
        den = self._weight_sums.get(key)
        if den is None:
            den = np.zeros((y1 - y0, g.out_width), dtype=np.float32)
            for at, src, h in parts:
                den[at : at + h] += self._row_weights[src : src + h, : g.out_width]
            den = self._xp.put(den)
            if len(self._weight_sums) < 8:
                self._weight_sums[key] = den
        return den
