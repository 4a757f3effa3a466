"""The stitcher: one slide's tile results, in grid order, become level-0 detections and heatmap rows.

This is where tile pixels become level-0 pixels
(:meth:`~wsi_pipeline.geometry.TilingGeometry.tile_to_level0`) and where the
merge policy (:mod:`.policies`) sees the boxes. Heatmaps go to a
:class:`~.blend.HeatmapBlender` whose finished rows go to the sink the
caller gives (a file writer, statistics, an in-memory array: the stitcher
does not know which).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from wsi_pipeline.boxes.nms import reading_order
from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.stitch.blend import BlendGeometry, HeatmapBlender, Sink
from wsi_pipeline.stitch.merge_runner import PolicyRun, ThreadedMerge
from wsi_pipeline.stitch.policies import MergePolicy

if TYPE_CHECKING:  # types only: the stitcher reads a tile's row, col and index, a result's boxes and heatmap
    from wsi_pipeline.inference.tile_detections import BatchDetections, TileDetections
    from wsi_pipeline.tiling.grid import Tile


# Calls (a row's run of mapped boxes, a row's start) that may wait for the box merge before the
# stitching thread blocks (benchmarks/probes/sweep_merge_queue.py).
MERGE_QUEUE = 8


class Stitcher:
    """Collect one slide's tile results: boxes merged in level 0, heatmaps blended into ``heatmap_sink``.

    Args:
        geometry: the slide's tiling (its heatmap plane too, when there is a heatmap).
        policy: how boxes of overlapping tiles merge (:func:`~.policies.merge_policy`).
        score_threshold: boxes scoring below it are dropped before merging (None: none).
        heatmap_sink: called as ``sink(y0_heatmap, rows)`` with C x h x W float32
            rows of the blended heatmap, top to bottom (None: the model has no heatmap).
        heatmap_weights: the tiles' blending weights (``heatmap_tile`` square,
            :func:`~.weights.tile_weights`), with ``heatmap_sink``.
        heatmap_channels: C, with ``heatmap_sink``.
        heatmap_device: blend on this torch device (the CUDA device the model ran
            on: its heatmaps need not leave it), None on the host
            (:class:`~.blend.HeatmapBlender`'s ``device``).
        source: names the model in errors.
        merge: where ``policy``'s calls run (:mod:`.merge_runner`; it runs that same
            policy); None: on a thread of this process.

    Use: :meth:`add_batch` with the results of tiles in grid order (tiles
    not given are skipped: no tissue), then :meth:`finish`.
    """

    def __init__(
        self,
        geometry: TilingGeometry,
        policy: MergePolicy,
        score_threshold: float | None = None,
        heatmap_sink: Sink | None = None,
        heatmap_weights: np.ndarray | None = None,
        heatmap_channels: int = 0,
        heatmap_device: Any = None,
        source: str = "the model",
        merge: PolicyRun | None = None,
    ):
        self.geometry, self.policy, self.score_threshold = geometry, policy, score_threshold
        self.source = source
        # The merge policy sees the mapped boxes elsewhere (a thread, a process), in order.
        self._merge = merge if merge is not None else ThreadedMerge(policy, MERGE_QUEUE)
        self._next = 0  # next grid index expected
        self.over_cap = 0  # detections the decoder dropped past the card's cap a tile
        self._row = -1  # grid row of the last tile added
        self.blender: HeatmapBlender | None = None
        if heatmap_sink is not None:
            if heatmap_weights is None:
                raise ValueError("heatmap_sink needs heatmap_weights")
            self.blender = HeatmapBlender(
                BlendGeometry.from_tiling(geometry),
                heatmap_channels,
                heatmap_weights,
                heatmap_sink,
                window_rows=3,
                device=heatmap_device,
            )

    @property
    def heatmap_device(self) -> Any:
        """Where heatmaps are blended: a torch device, or None for the host (or no heatmap)."""
        return None if self.blender is None else self.blender.device

    def _skip_to(self, index: int) -> None:
        """Skip grid tiles ``_next .. index - 1`` (no tissue), a row's run at a time."""
        n_cols = self.geometry.n_cols
        while self._next < index:
            row, col = divmod(self._next, n_cols)
            stop = min(index, (row + 1) * n_cols)
            if self.blender is not None:
                self.blender.skip(row, col, stop - row * n_cols)
            self._next = stop

    def add_batch(self, tiles: Sequence[Tile], dets: BatchDetections | Sequence[TileDetections]) -> None:
        """A batch's detections (tile pixels), tiles in grid order: heatmaps and boxes a grid row's run at a time.

        ``dets``: a :class:`~wsi_pipeline.inference.tile_detections.BatchDetections`
        (as the executor gives it), or one TileDetections per tile.
        """
        from wsi_pipeline.inference.tile_detections import BatchDetections

        batch = dets if isinstance(dets, BatchDetections) else BatchDetections.from_tiles(dets)
        if len(batch) != len(tiles):
            raise WSIPipelineError(f"{len(batch)} results for {len(tiles)} tiles")
        if self.blender is not None and batch.heatmaps is None and len(tiles):
            raise WSIPipelineError(f"{self.source}: the card names a heatmap, the model gave none")
        self.over_cap += batch.over_cap_total
        off = batch.offsets
        start = 0
        while start < len(tiles):
            stop = start + 1
            while stop < len(tiles) and tiles[stop].row == tiles[start].row:
                stop += 1
            self._add_row_run(tiles[start:stop], batch, start, stop, off)
            start = stop

    def _add_row_run(
        self, tiles: Sequence[Tile], batch: BatchDetections, start: int, stop: int, off: np.ndarray
    ) -> None:
        """Tiles ``start:stop`` of ``batch``, of one grid row, in order: blend their heatmaps, then map
        and merge their boxes at once."""
        row = tiles[0].row
        for tile in tiles:  # the gaps between them (no tissue) are skipped; the tiles are claimed below
            if tile.index < self._next:
                raise WSIPipelineError(f"tile {tile.index} arrived out of grid order (expected >= {self._next})")
            self._skip_to(tile.index)
            self._next = tile.index + 1
        cols = np.fromiter((t.col for t in tiles), np.int64, len(tiles))
        if self.blender is not None:
            self.blender.add_run(row, cols, batch.heatmaps[start:stop])
        if row != self._row:
            self._merge.row_started(self.geometry.row_y0_level0(row))
        self._row = row
        counts = batch.counts[start:stop]
        if not counts.any():
            return
        boxes = batch.boxes[off[start] : off[stop]]
        scores = batch.scores[off[start] : off[stop]]
        labels = batch.labels[off[start] : off[stop]]
        owner = np.repeat(np.arange(len(tiles)), counts)  # each box's tile in ``tiles``
        rows = np.full(len(boxes), row)
        cols = cols[owner]
        keep = self.policy.keep_in_tile(boxes, rows, cols, self.geometry)
        if self.score_threshold is not None:
            keep &= scores >= self.score_threshold
        if not keep.any():
            return
        b = self.geometry.tile_to_level0(boxes[keep], rows[keep], cols[keep])
        # Edge tiles are padded past the slide; boxes centred there are the padding's edge, not objects.
        w0, h0 = self.geometry.width_level0, self.geometry.height_level0
        cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
        inside = (cx >= 0) & (cx < w0) & (cy >= 0) & (cy < h0)
        b = b[inside]
        b[:, [0, 2]] = b[:, [0, 2]].clip(0, w0)
        b[:, [1, 3]] = b[:, [1, 3]].clip(0, h0)
        self._merge.add(b, scores[keep][inside], labels[keep][inside])

    def close(self) -> None:
        """End the box merge without finishing (a failed run); :meth:`finish` does it too."""
        self._merge.abandon()

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Skip the tiles after the last one read, close the heatmap; the merged boxes.

        Returns (boxes N x 4 float32 level-0 x0, y0, x1, y1; scores N float32;
        labels N int) in reading order: top to bottom, then left to right.
        """
        self._skip_to(self.geometry.n_rows * self.geometry.n_cols)
        self._merge.end()  # the last merge step runs while the heatmap is closed
        if self.blender is not None:
            self.blender.close()
        boxes, scores, labels = self._merge.finish()
        order = reading_order(boxes)
        return boxes[order], scores[order], labels[order]


__all__ = ["Stitcher"]
