"""What one run returns: :class:`Result`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .io.detections import detection_boxes
from .io.ome_tiff import HeatmapFile


@dataclass
class Result:
    """What one run found.

    Attributes:
        source: the slide's path or the array's name.
        detections: structured array (:data:`~.io.detections.DETECTION_DTYPE`:
            x0, y0, x1, y1, score, label) in level-0 pixels;
            ``pandas.DataFrame(result.detections)`` makes a table.
        heatmap: C x H x W float32 probabilities (an array), a
            :class:`~.io.ome_tiff.HeatmapFile` (lazy, when the run wrote its
            outputs to a folder), or None for models without a heatmap.
            Both index alike (``heatmap[1]``, ``heatmap[1, y0:y1, x0:x1]``,
            ``shape``, ``dtype``, ``numpy.asarray(heatmap)``).
        heatmap_scale_level0: level-0 pixels per heatmap pixel.
        summary: the summary.json document (counts, areas, scores, timings).
        class_names: names of the detection labels; heatmap_classes: of the
            heatmap channels.
        out_dir: where the outputs were written, or None.
    """

    source: str
    detections: np.ndarray
    heatmap: np.ndarray | HeatmapFile | None
    heatmap_scale_level0: float
    summary: dict[str, Any]
    class_names: list[str]
    heatmap_classes: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    written: Future | None = field(default=None, repr=False)

    def wait_written(self) -> Result:
        """Wait until every output file is written (runs with ``wait_written=False``); raise what failed."""
        if self.written is not None:
            self.written.result()
        return self

    def to_dataframe(self):
        """The detections as a pandas DataFrame with a ``class`` column (needs pandas)."""
        import pandas as pd

        df = pd.DataFrame(self.detections)
        names = np.array(self.class_names + ["?"], dtype=object)
        df["class"] = names[np.clip(df["label"].to_numpy(), -1, len(self.class_names))]
        return df

    def boxes(self) -> np.ndarray:
        """N x 4 float32 (x0, y0, x1, y1) level-0 pixels."""
        return detection_boxes(self.detections)


__all__ = ["Result"]
