"""wsi-pipeline: tiling inference over whole-slide and large industrial images."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import SlideError, WSIPipelineError  # noqa: E402
from .slide import Slide, open_slide  # noqa: E402

__all__ = ["__version__", "open_slide", "Slide", "SlideError", "WSIPipelineError"]
