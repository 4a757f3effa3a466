"""What one run returns: :class:`Result`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import MissingExtraError
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
            outputs to a folder, ``ome-tiff`` among them), or None for models
            without a heatmap.
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
        """The detections as a pandas DataFrame with a ``class`` column (needs pandas); the same
        columns and types without detections (:data:`~.io.detections.CSV_DTYPES`)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise MissingExtraError("Result.to_dataframe", "pandas", "notebooks") from exc

        df = pd.DataFrame(self.detections)
        names = np.array(self.class_names + ["?"], dtype=object)
        df["class"] = pd.array(names[np.clip(df["label"].to_numpy(), -1, len(self.class_names))], dtype="string")
        return df

    def boxes(self) -> np.ndarray:
        """N x 4 float32 (x0, y0, x1, y1) level-0 pixels."""
        return detection_boxes(self.detections)


class PendingResult:
    """A run's :class:`Result` while its last steps go on in the pipeline's threads.

    ``Pipeline.run(..., wait_written=False)`` returns one once the slide's tiles have been through
    the model: the merge's last rows, the summary and the output files follow on threads while the
    caller goes on (a batch runs its next slide). :meth:`wait_written` waits for all of it and
    returns the :class:`Result`, raising what failed; reading any of the Result's attributes here
    (``pending.detections``, ``pending.summary``) waits the same way.
    """

    def __init__(self, source: str, completed: Future):
        self.source = source
        self._completed = completed  # the Result, once stitched and its files started

    def wait_written(self) -> Result:
        """Wait until the run is stitched and every output file written; the Result. Raises what failed."""
        return self._completed.result().wait_written()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wait_written(), name)

    def __repr__(self) -> str:
        state = "done" if self._completed.done() else "running"
        return f"PendingResult({self.source!r}, {state})"


__all__ = ["PendingResult", "Result"]
