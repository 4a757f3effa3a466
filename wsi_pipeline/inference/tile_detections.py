"""What a decoder gives: a tile's detections (:class:`TileDetections`) and a batch's as arrays
(:class:`BatchDetections`). Boxes are ``xyxy`` in tile pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class TileDetections:
    """Detections of one tile, in tile pixels of the model input.

    ``boxes``: ``Nx4 float32`` (x0, y0, x1, y1); ``scores``: ``N float32``;
    ``labels``: ``N int64`` indices into the card's classes; ``heatmap``:
    ``CxHxW float32`` region probabilities at the card's heatmap stride, or
    None for a model without one.
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    heatmap: np.ndarray | None = None
    over_cap: int = 0  # rows past the card's max_detections_per_tile, dropped (the lowest scores)

    def __len__(self) -> int:
        return int(self.boxes.shape[0])

    @classmethod
    def empty(cls, heatmap: np.ndarray | None = None) -> TileDetections:
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64), heatmap)


@dataclass
class BatchDetections:
    """Detections of a batch of tiles, as arrays: what the executor hands the stitcher.

    ``boxes``: ``Mx4 float32`` (x0, y0, x1, y1, tile pixels of the model
    input), ``scores``: ``M float32``, ``labels``: ``M int64``: the rows of
    every tile, tile after tile; ``counts``: ``n int64``, each tile's rows;
    ``heatmaps``: ``n x C x H x W float32`` or None (a numpy array, or a CUDA
    tensor where the executor was asked to leave them on the device). :meth:`tiles` gives the
    per-tile view (:class:`TileDetections`, arrays sharing this memory).
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    counts: np.ndarray
    heatmaps: Any = None
    over_cap: np.ndarray | None = None  # n int64: each tile's rows past the card's cap, dropped; None: none

    @property
    def over_cap_total(self) -> int:
        """Rows the batch's tiles gave past the card's max_detections_per_tile (dropped)."""
        return 0 if self.over_cap is None else int(self.over_cap.sum())

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        """``n + 1`` int64: tile i's rows are ``offsets[i]:offsets[i + 1]``."""
        return row_offsets(self.counts)

    def tiles(self) -> list[TileDetections]:
        off = self.offsets
        hm = self.heatmaps
        return [
            TileDetections(
                self.boxes[off[i] : off[i + 1]],
                self.scores[off[i] : off[i + 1]],
                self.labels[off[i] : off[i + 1]],
                None if hm is None else hm[i],
                0 if self.over_cap is None else int(self.over_cap[i]),
            )
            for i in range(len(self))
        ]

    @classmethod
    def from_tiles(cls, dets: Sequence[TileDetections]) -> BatchDetections:
        """The batch form of per-tile detections (copies)."""
        hms = [d.heatmap for d in dets]
        return cls(
            np.concatenate([np.asarray(d.boxes, np.float32).reshape(-1, 4) for d in dets] or [np.zeros((0, 4))]).astype(
                np.float32, copy=False
            ),
            np.concatenate([np.asarray(d.scores, np.float32).reshape(-1) for d in dets] or [np.zeros(0)]).astype(
                np.float32, copy=False
            ),
            np.concatenate([np.asarray(d.labels).reshape(-1) for d in dets] or [np.zeros(0)]).astype(
                np.int64, copy=False
            ),
            np.array([len(d) for d in dets], np.int64),
            np.stack(hms).astype(np.float32, copy=False) if hms and all(h is not None for h in hms) else None,
            rows_over_cap([d.over_cap for d in dets]),
        )

    @classmethod
    def concat(cls, parts: Sequence[BatchDetections]) -> BatchDetections:
        """Batches one after the other."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls(
                np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
            )
        hms = [p.heatmaps for p in parts]
        return cls(
            np.concatenate([p.boxes for p in parts]),
            np.concatenate([p.scores for p in parts]),
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.counts for p in parts]),
            _concat_heatmaps(hms) if all(h is not None for h in hms) else None,
            None
            if all(p.over_cap is None for p in parts)
            else np.concatenate([np.zeros(len(p), np.int64) if p.over_cap is None else p.over_cap for p in parts]),
        )


def rows_over_cap(per_tile: Sequence[int] | np.ndarray) -> np.ndarray | None:
    """Each tile's rows past the cap as an array, or None where no tile had any."""
    a = np.asarray(per_tile, np.int64).reshape(-1)
    return a if a.any() else None


def _concat_heatmaps(hms: list[Any]) -> Any:
    """numpy arrays, or device tensors (heatmaps left on the device), one after the other."""
    if all(isinstance(h, np.ndarray) for h in hms):
        return np.concatenate(hms)
    import torch

    return torch.cat([torch.as_tensor(h, device=hms[0].device) for h in hms])


def row_offsets(counts: np.ndarray) -> np.ndarray:
    """``n + 1`` int64 starts of ``n`` runs of ``counts`` rows laid back to back."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out
