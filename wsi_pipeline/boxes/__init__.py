"""Axis-aligned boxes compared with one another: one greedy NMS for tiles and slides.

:func:`global_nms` (greedy NMS, class-aware or not, IoU or intersection over
the smaller box) is what a detection decoder runs on one tile's boxes and the
stitcher on a whole slide's; :func:`intersecting_pairs` (a uniform spatial
grid) finds the pairs of boxes that intersect without comparing all pairs.
Pure numpy, no other part of the package.
"""

from wsi_pipeline.boxes.nms import global_nms, score_order
from wsi_pipeline.boxes.spatial_grid import intersecting_pairs

__all__ = ["global_nms", "intersecting_pairs", "score_order"]
