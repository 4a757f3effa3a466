"""Stitching of tile results into slide results.

Boxes: :func:`global_nms` (greedy NMS over the whole slide, spatial-grid
accelerated), :func:`merge_boxes` (greedy NMM / weighted box fusion for boxes
cut by tile edges), :func:`owned_by_tile` (O(N) ownership by tile core).
Heatmaps: :class:`HeatmapBlender` with weights from :func:`tile_weights`.
See docs/stitching.md for when to use which.
"""

from wsi_pipeline.boxes.nms import global_nms, score_order
from wsi_pipeline.boxes.spatial_grid import intersecting_pairs
from wsi_pipeline.stitch.blend import BlendGeometry, HeatmapBlender
from wsi_pipeline.stitch.merge import cluster_leaders, merge_boxes
from wsi_pipeline.stitch.ownership import owned_by_tile, tile_core_px, touches_inner_edge
from wsi_pipeline.stitch.weights import tile_weights

__all__ = [
    "BlendGeometry",
    "HeatmapBlender",
    "cluster_leaders",
    "global_nms",
    "intersecting_pairs",
    "merge_boxes",
    "owned_by_tile",
    "score_order",
    "tile_core_px",
    "tile_weights",
    "touches_inner_edge",
]
