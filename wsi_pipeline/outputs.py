"""One slide's outputs: the heatmap sinks the stitcher feeds, and the files written after it.

:class:`SlideOutputs` is built per slide by the pipeline and hands the
stitcher one sink (:attr:`SlideOutputs.heatmap_sink`) that fans out to the
OME-TIFF writer (with an output folder), an in-memory array (when asked),
per-class statistics over the tissue and a reduced copy for the overlay.
After stitching, :meth:`SlideOutputs.write` sends GeoJSON, CSV and overlay
to the writer processes and returns the step that closes the heatmap file
and writes ``summary.json`` last, the mark of a complete folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .geometry import TilingGeometry
from .inference.card import ModelCard
from .io.atomic import write_json
from .io.detections import detection_boxes, parse_color, write_csv, write_geojson
from .io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter
from .io.overlay import write_overlay
from .io.writer_pool import WriteJobs, WriterPool
from .slide import Slide
from .stitch.blend import Sink
from .stitch.sinks import ArraySink, HeatmapStats, ReducedCopy, fan_out
from .stitch.weights import tile_weights
from .tiling.tissue import TissueMask

OUTPUT_FILES = ("detections.geojson", "detections.csv", "heatmap.ome.tif", "overlay.png", "summary.json")
# Heatmap channels that cover everything (not shown on the overlay).
_ALL_OVER = ("tissue", "background")


class SlideOutputs:
    """The sinks and files of one slide's run.

    Args:
        geometry: the slide's tiling, with its heatmap plane when the card has a heatmap.
        card, config: the model card and run settings.
        slide: the slide (its resolution, and its thumbnail for the overlay).
        mask: the tissue mask (heatmap statistics are taken over it).
        out: the output folder, or None to write nothing.
        keep_heatmap: hold the blended heatmap in memory.
    """

    def __init__(self, geometry: TilingGeometry, card: ModelCard, config: RunConfig, slide: Slide,
                 mask: TissueMask, out: Path | None, keep_heatmap: bool):
        self.geometry, self.card, self.config, self.slide, self.out = geometry, card, config, slide, out
        self.writer: OmeTiffHeatmapWriter | None = None
        self.array_sink: ArraySink | None = None
        self.reduced: ReducedCopy | None = None
        self.stats: HeatmapStats | None = None
        self.heatmap_sink: Sink | None = None
        self.heatmap_weights: np.ndarray | None = None
        hm = card.heatmap
        if hm is None:
            return
        g, c = geometry, len(hm.classes)
        sinks: list[Sink] = []
        if out is not None:
            self.writer = OmeTiffHeatmapWriter(out / "heatmap.ome.tif", g.heatmap_width, g.heatmap_height, c,
                                               channel_names=list(hm.classes),
                                               physical_size_um=g.heatmap_pixel_size_um(slide.mpp))
            sinks.append(self.writer)
        if keep_heatmap:
            self.array_sink = ArraySink(c, g.heatmap_height, g.heatmap_width)
            sinks.append(self.array_sink)
        self.stats = HeatmapStats(c, g.heatmap_width, g.heatmap_scale_level0, mask)
        sinks.append(self.stats)
        w0, h0 = slide.dimensions
        thumb_downsample = max(w0 / config.overlay_size, h0 / config.overlay_size, 1.0)
        self.reduced = ReducedCopy(c, g.heatmap_height, g.heatmap_width,
                                   max(1, int(thumb_downsample // g.heatmap_scale_level0)))
        sinks.append(self.reduced)
        self.heatmap_sink = fan_out(*sinks)
        self.heatmap_weights = tile_weights(g.heatmap_tile, config.blend, config.sigma_scale,
                                            overlap_px=(g.overlap // hm.stride) or 1)

    @property
    def heatmap_channels(self) -> int:
        return len(self.card.heatmap.classes) if self.card.heatmap is not None else 0

    def close_heatmap(self) -> np.ndarray | HeatmapFile | None:
        """Finish the heatmap file; the heatmap in memory, the file's lazy reader, or None."""
        if self.reduced is not None:
            self.reduced.close()
        path = self.writer.close() if self.writer is not None else None
        if self.array_sink is not None:
            return self.array_sink.array
        return HeatmapFile(path) if path is not None else None

    def abort(self) -> None:
        """Remove what was begun (the heatmap file's partial data)."""
        if self.writer is not None:
            self.writer.abort()

    def heatmap_scores(self, mm2_per_px0: float | None) -> dict[str, Any] | None:
        """Per-class statistics over the tissue (see :class:`~.stitch.sinks.HeatmapStats`)."""
        if self.stats is None:
            return None
        mm2 = mm2_per_px0 * self.geometry.heatmap_scale_level0 ** 2 if mm2_per_px0 else None
        return self.stats.summary(list(self.card.heatmap.classes), mm2)

    def overlay_inputs(self, dets: np.ndarray) -> tuple:
        """:func:`~.io.overlay.write_overlay`'s arguments after the path: thumbnail, heatmap, boxes, colours."""
        thumb = self.slide.get_thumbnail(self.config.overlay_size)
        thumb_ds = self.slide.dimensions[0] / thumb.shape[1]
        heat = self.reduced.array if self.reduced is not None else None
        if heat is not None:
            shown = [i for i, n in enumerate(self.card.heatmap.classes) if n.lower() not in _ALL_OVER]
            heat = heat[shown] if shown else heat
        scale = self.geometry.heatmap_scale_level0 * (self.reduced.factor if self.reduced is not None else 1)
        boxes = detection_boxes(dets) if len(dets) else None
        colors = [parse_color(c.color) for c in self.card.classes]
        return thumb, thumb_ds, heat, scale, boxes, dets["label"] if len(dets) else None, colors

    def write(self, dets: np.ndarray, writers: WriterPool) -> Callable[[], np.ndarray | HeatmapFile | None]:
        """Start writing the detection files and the overlay; return the step that finishes them.

        The returned callable closes the heatmap file, waits for the writer
        processes (raising the first failure) and returns the heatmap (its
        file's lazy reader, or the array when kept in memory). Write
        ``summary.json`` (:meth:`write_summary`) after it, last.
        """
        out = self._folder()
        classes = [{"name": c.name, "color": c.color} for c in self.card.classes]
        overlay = self.overlay_inputs(dets)  # reads the thumbnail: may fail, before any file is begun
        jobs = WriteJobs()
        writers.submit(jobs, "detections.geojson", write_geojson, out / "detections.geojson", dets, classes)
        writers.submit(jobs, "detections.csv", write_csv, out / "detections.csv", dets, classes)
        writers.submit(jobs, "overlay.png", write_overlay, out / "overlay.png", *overlay)

        def finish() -> np.ndarray | HeatmapFile | None:
            try:
                return self.close_heatmap()
            finally:
                jobs.wait()

        return finish

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json``, the mark of a complete folder: after every other file."""
        write_json(self._folder() / "summary.json", summary)

    def _folder(self) -> Path:
        if self.out is None:
            raise ValueError("this slide's outputs have no folder")
        return self.out


__all__ = ["OUTPUT_FILES", "SlideOutputs"]
