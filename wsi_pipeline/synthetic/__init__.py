"""Synthetic slides with known ground truth, for the demo model, tests and benchmarks.

* :class:`SyntheticScene`: procedural pathology or industrial content, a pure function of
  level-0 coordinates and a seed (render any region at any downsample, list its objects
  and region labels, in memory bounded by the region).
* :func:`write_synthetic_slide`: a pyramidal JPEG tiled TIFF that OpenSlide opens (or a
  BigTIFF for industrial), plus the truth as QuPath-style GeoJSON.
* :func:`load_truth` / :class:`Truth`: read the truth back.

See ``docs/synthetic.md`` for the scene model and the file layout.
"""

from __future__ import annotations

from .scene import CELL_SIZE_LEVEL0, KINDS, SyntheticScene
from .truth import Truth, default_truth_path, load_truth, trace_regions, write_truth
from .writer import level_dimensions, write_synthetic_slide

__all__ = [
    "CELL_SIZE_LEVEL0",
    "KINDS",
    "SyntheticScene",
    "Truth",
    "default_truth_path",
    "level_dimensions",
    "load_truth",
    "trace_regions",
    "write_synthetic_slide",
    "write_truth",
]
