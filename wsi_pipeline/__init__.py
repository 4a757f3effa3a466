"""wsi-pipeline: tiling inference over whole-slide and large industrial images."""

from __future__ import annotations

from ._version import __version__
from .errors import SlideError, SlideOpenError, TileReadError, WSIPipelineError
from .slide import Slide, open_slide

__all__ = [
    "__version__",
    "open_slide",
    "Pipeline",
    "Result",
    "Slide",
    "SlideError",
    "SlideOpenError",
    "TileReadError",
    "WSIPipelineError",
]


def __getattr__(name: str):
    # The pipeline pulls in the inference stack; load it on first use only.
    if name == "Pipeline":
        from .pipeline import Pipeline

        return Pipeline
    if name == "Result":
        from .result import Result

        return Result
    raise AttributeError(f"module 'wsi_pipeline' has no attribute {name!r}")
