"""How the boxes that overlapping tiles find become one set: merge policies, chosen by name.

A policy sees each box twice: first in its tile's pixels (:meth:`MergePolicy.keep_in_tile`,
where the tile's edges and core are known), then in level-0 pixels
(:meth:`MergePolicy.add`), a row of tiles at a time, told by
:meth:`MergePolicy.row_started` where each new row of tiles begins. :data:`MERGE_POLICIES`
lists them; :func:`merge_policy` makes one from the run's settings.

- ``nms``, ``nmm``, ``wbf``: boxes from every tile, merged across tiles by
  :class:`~.streaming.StreamingMerger` (greedy NMS, non-maximum merging,
  weighted box fusion); boxes cut by an inner tile edge are dropped first
  when ``drop_edge_boxes``.
- ``ownership``: each box is kept only by the tile whose core holds its
  centre (:func:`~.ownership.owned_by_tile`); no merging.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.stitch.ownership import owned_by_tile, touches_inner_edge
from wsi_pipeline.stitch.streaming import StreamingMerger

Boxes = tuple[np.ndarray, np.ndarray, np.ndarray]  # N x 4 float32 level-0 boxes, N float32 scores, N labels


class MergePolicy(ABC):
    """One slide's box merging; a fresh policy per slide."""

    def keep_in_tile(
        self, boxes_tile: np.ndarray, rows: np.ndarray, cols: np.ndarray, geometry: TilingGeometry
    ) -> np.ndarray:
        """N bool: which boxes (N x 4 float, each in its own tile's pixels; tiles ``rows``, ``cols``) go on."""
        return np.ones(len(boxes_tile), bool)

    def row_started(self, y0_level0: float) -> None:  # noqa: B027  (most policies need no notice)
        """A new row of tiles begins at level-0 ``y0_level0``: no later box reaches above it."""

    @abstractmethod
    def add(self, boxes_level0: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
        """Boxes (N x 4 float32 level-0 x0, y0, x1, y1), their scores and labels, a row at a time."""

    @abstractmethod
    def finish(self) -> Boxes:
        """Every kept box (level 0), score and label, in no particular order (but those taken)."""

    def take_decided(self) -> Boxes | None:
        """The kept boxes decided since the last take, or None: none (or a policy that decides
        only at :meth:`finish`). :meth:`finish` then gives the rest; the takes and the finish,
        concatenated in order, are what :meth:`finish` alone would give. The box-merging process
        sends them while the slide runs, so that less is left to send at its end."""
        return None


class CrossTileMerge(MergePolicy):
    """Merge boxes across tiles with ``method`` (``nms``, ``nmm`` or ``wbf``) as rows complete."""

    def __init__(
        self, method: str = "nms", iou_threshold: float = 0.5, metric: str = "iou", drop_edge_boxes: bool = True
    ):
        self.merger = StreamingMerger(method, iou_threshold, metric)
        self.drop_edge_boxes = drop_edge_boxes

    def keep_in_tile(self, boxes_tile, rows, cols, geometry):
        if not self.drop_edge_boxes:
            return super().keep_in_tile(boxes_tile, rows, cols, geometry)
        g = geometry
        return ~touches_inner_edge(boxes_tile, rows, cols, g.n_rows, g.n_cols, g.tile, g.overlap)

    def row_started(self, y0_level0: float) -> None:
        self.merger.flush(float(y0_level0))

    def add(self, boxes_level0, scores, labels):
        self.merger.add(boxes_level0, scores, labels)

    def finish(self) -> Boxes:
        return self.merger.finish()

    def take_decided(self) -> Boxes | None:
        return self.merger.take_decided()


class TileOwnership(MergePolicy):
    """Keep each box in the one tile whose core holds its centre; no merging across tiles."""

    def __init__(self) -> None:
        self._parts: list[Boxes] = []

    def keep_in_tile(self, boxes_tile, rows, cols, geometry):
        g = geometry
        keep = np.zeros(len(boxes_tile), bool)
        tiles = np.stack([rows, cols], axis=1) if len(boxes_tile) else np.zeros((0, 2), np.int64)
        for row, col in np.unique(tiles, axis=0):
            part = (rows == row) & (cols == col)
            keep[part] = owned_by_tile(
                boxes_tile[part], int(row), int(col), g.n_rows, g.n_cols, g.tile, g.overlap, g.last_shift_grid
            )
        return keep

    def add(self, boxes_level0, scores, labels):
        self._parts.append((boxes_level0, scores, labels))

    def finish(self) -> Boxes:
        if not self._parts:
            return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)
        return tuple(np.concatenate(p) for p in zip(*self._parts, strict=True))  # type: ignore[return-value]


MERGE_POLICIES: dict[str, Callable[..., MergePolicy]] = {
    "nms": lambda **kw: CrossTileMerge("nms", **kw),
    "nmm": lambda **kw: CrossTileMerge("nmm", **kw),
    "wbf": lambda **kw: CrossTileMerge("wbf", **kw),
    "ownership": lambda **kw: TileOwnership(),
}


def merge_policy(
    name: str, iou_threshold: float = 0.5, metric: str = "iou", drop_edge_boxes: bool = True
) -> MergePolicy:
    """A new policy of the kind ``name`` (a key of :data:`MERGE_POLICIES`) for one slide."""
    try:
        make = MERGE_POLICIES[name]
    except KeyError:
        raise ValueError(f"merge policy: expected one of {', '.join(MERGE_POLICIES)}, found {name!r}") from None
    return make(iou_threshold=iou_threshold, metric=metric, drop_edge_boxes=drop_edge_boxes)


__all__ = ["MERGE_POLICIES", "CrossTileMerge", "MergePolicy", "TileOwnership", "merge_policy"]
