"""Review a run in a notebook: load its results, draw them, filter and export them.

>>> from wsi_pipeline.review import load_run, plot_overview   # doctest: +SKIP
>>> run = load_run("runs/slide_01")                           # doctest: +SKIP
>>> fig = plot_overview(run)                                  # doctest: +SKIP

All coordinates are level-0 pixels of the slide (origin top-left). Needs
matplotlib (``pip install 'wsi-pipeline[notebooks]'``); ipywidgets is
optional (:mod:`.widgets`).
"""

from __future__ import annotations

try:
    import matplotlib  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("wsi_pipeline.review needs matplotlib: pip install 'wsi-pipeline[notebooks]'") from exc

from .figures import plot_counts, plot_gallery, plot_overview, plot_region, save_figure
from .filters import busiest_region, count_by_class, export_geojson, filter_detections, region_mask
from .results import ReviewRun, load_run
from .widgets import region_picker, score_slider, widgets_available, widgets_wanted

__all__ = [
    "ReviewRun",
    "busiest_region",
    "count_by_class",
    "export_geojson",
    "filter_detections",
    "load_run",
    "plot_counts",
    "plot_gallery",
    "plot_overview",
    "plot_region",
    "region_mask",
    "region_picker",
    "save_figure",
    "score_slider",
    "widgets_available",
    "widgets_wanted",
]
