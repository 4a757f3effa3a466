"""A toy detections file and a toy heatmap file, each made the way an output format's module makes
its file, for tests that add them to :data:`wsi_pipeline.io.formats.FORMATS`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def write_counts(path: str | os.PathLike[str], detections: np.ndarray, classes: list[dict]) -> None:
    """A detections file: the number of detections of each class, as JSON (a writer-pool job)."""
    names = [c["name"] for c in classes]
    counts = np.bincount(detections["label"].astype(int), minlength=len(names)) if len(detections) else [0] * len(names)
    Path(path).write_text(json.dumps(dict(zip(names, (int(n) for n in counts), strict=True))), encoding="utf-8")


class NpyHeatmapWriter:
    """A heatmap file: the C x H x W float32 rows as they arrive, saved as ``.npy`` on ``close()``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        width: int,
        height: int,
        channels: int,
        channel_names: list[str] | None = None,
        physical_size_um: tuple[float, float] | None = None,
    ) -> None:
        self.path = Path(path)
        self.channel_names = channel_names
        self.rows = np.full((channels, height, width), np.nan, np.float32)
        self.closed = self.aborted = False

    def __call__(self, y0_out: int, rows: np.ndarray) -> None:
        self.rows[:, y0_out : y0_out + rows.shape[1]] = rows

    def close(self) -> Path:
        np.save(self.path, self.rows, allow_pickle=False)
        self.closed = True
        return self.path

    def abort(self) -> None:
        self.aborted = True
