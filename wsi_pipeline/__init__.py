"""wsi-pipeline: tiling inference over whole-slide and large industrial images."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import SlideError, SlideOpenError, TileReadError, WSIPipelineError  # noqa: E402
from .slide import Slide, open_slide  # noqa: E402

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
    if name in ("Pipeline", "Result"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'wsi_pipeline' has no attribute {name!r}")
