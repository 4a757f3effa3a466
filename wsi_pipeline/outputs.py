"""One slide's outputs: the heatmap sinks the stitcher feeds, and the files written after it.

:class:`SlideOutputs` is built per slide by the pipeline and hands the
stitcher one sink (:attr:`SlideOutputs.heatmap_sink`) that fans out, from
threads of its own (:class:`~.stitch.sinks.BackgroundSink`), to the OME-TIFF
writer (with an output folder; and the OME-Zarr writer where ``ome-zarr`` is
chosen) on one thread, and on another to an in-memory array (when asked),
per-class statistics over the tissue and, when an overlay is written, a
reduced copy for it. Whatever reads them (:meth:`SlideOutputs.heatmap_scores`,
the overlay, :meth:`SlideOutputs.close_heatmap`) waits for those threads
first; :meth:`SlideOutputs.abort` ends them too.
After stitching, :meth:`SlideOutputs.write` sends the heatmap file's
pyramid, the overlay and the detection files of ``config.formats``
(:mod:`.io.formats`) to the writer processes and returns the step that waits
for them; ``summary.json``, the mark of a complete folder, is written last.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .geometry import TilingGeometry
from .inference.card import ModelCard
from .io.atomic import partial_name, write_joined, write_json
from .io.detections import PartsWriter, detection_boxes, feature_ids, parse_color, with_tiles
from .io.formats import (
    DEFAULT_FORMATS,
    DETECTIONS,
    FORMATS,
    HEATMAP_FILE,
    OVERLAY,
    chosen,
    detection_notes,
    not_written,
    output_files,
)
from .io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter, SpooledHeatmap, write_spooled_heatmap
from .io.writer_pool import WriteJobs, WriterPool, writer_peak_memory_mb
from .slide import Slide
from .stitch.blend import Sink
from .stitch.sinks import ArraySink, BackgroundSink, FiniteCheck, HeatmapStats, ReducedCopy, fan_out
from .stitch.weights import tile_weights
from .summary import SUMMARY_FILE
from .tiling.tissue import TissueMask

# A slide folder of the default formats (summary.json lists the files of each run).
OUTPUT_FILES = tuple(output_files(DEFAULT_FORMATS))
log = logging.getLogger("wsi_pipeline")
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

    def __init__(
        self,
        geometry: TilingGeometry,
        card: ModelCard,
        config: RunConfig,
        slide: Slide,
        mask: TissueMask,
        out: Path | None,
        keep_heatmap: bool,
    ):
        self.geometry, self.card, self.config, self.slide, self.out = geometry, card, config, slide, out
        self.writer: OmeTiffHeatmapWriter | None = None
        self.zarr_writer: Any = None  # an OmeZarrHeatmapWriter with ``ome-zarr``
        self.array_sink: ArraySink | None = None
        self.reduced: ReducedCopy | None = None
        self.stats: HeatmapStats | None = None
        self.heatmap_sink: Sink | None = None
        self._background: BackgroundSink | None = None
        self.heatmap_weights: np.ndarray | None = None
        self.write_jobs: list[WriteJobs] = []
        hm = card.heatmap
        if hm is None:
            return
        g, c = geometry, len(hm.classes)
        files: list[Sink] = []  # the heatmap files' writers, on one thread; the other sinks on another
        sinks: list[Sink] = [FiniteCheck(hm.classes, g.heatmap_scale_level0)]
        plane = dict(channel_names=list(hm.classes), physical_size_um=g.heatmap_pixel_size_um(slide.mpp))
        if out is not None and "ome-tiff" in config.formats:
            self.writer = OmeTiffHeatmapWriter(
                out / FORMATS["ome-tiff"].filename, g.heatmap_width, g.heatmap_height, c, **plane
            )
            files.append(self.writer)
        if out is not None and "ome-zarr" in config.formats:
            from .io.ome_zarr import OmeZarrHeatmapWriter  # needs zarr: only where chosen

            self.zarr_writer = OmeZarrHeatmapWriter(
                out / FORMATS["ome-zarr"].filename, g.heatmap_width, g.heatmap_height, c, **plane
            )
            files.append(self.zarr_writer)
        if keep_heatmap:
            self.array_sink = ArraySink(c, g.heatmap_height, g.heatmap_width)
            sinks.append(self.array_sink)
        self.stats = HeatmapStats(c, g.heatmap_width, g.heatmap_scale_level0, mask)
        sinks.append(self.stats)
        if out is not None and chosen(config.formats, OVERLAY):  # the reduced copy is the overlay's
            w0, h0 = slide.dimensions
            thumb_downsample = max(w0 / config.overlay_size, h0 / config.overlay_size, 1.0)
            self.reduced = ReducedCopy(
                c, g.heatmap_height, g.heatmap_width, max(1, int(thumb_downsample // g.heatmap_scale_level0))
            )
            sinks.append(self.reduced)
        self.heatmap_sink = self._background = BackgroundSink(*(fan_out(*group) for group in (files, sinks) if group))
        self.heatmap_weights = tile_weights(
            g.heatmap_tile, config.blend, config.sigma_scale, overlap_px=(g.overlap // hm.stride) or 1
        )

    @property
    def heatmap_channels(self) -> int:
        return len(self.card.heatmap.classes) if self.card.heatmap is not None else 0

    def drain_heatmap(self) -> None:
        """Wait until every heatmap row handed over has reached the sinks (raises their failure)."""
        if self._background is not None:
            self._background.close()

    def close_heatmap(self, finish_file: bool = True) -> np.ndarray | HeatmapFile | None:
        """Finish the heatmap sinks; the heatmap in memory, the file's lazy reader, or None.

        ``finish_file=False`` leaves the OME-TIFF to the caller (:meth:`OmeTiffHeatmapWriter.spooled`).
        """
        self.drain_heatmap()
        if self.reduced is not None:
            self.reduced.close()
        if self.zarr_writer is not None:
            self.zarr_writer.close()
        path = self.writer.close() if self.writer is not None and finish_file else None
        if self.array_sink is not None:
            return self.array_sink.array
        return HeatmapFile(path) if path is not None else None

    def abort(self) -> None:
        """Remove what was begun (the heatmap files' partial data)."""
        if self._background is not None:
            self._background.abandon()
        for writer in (self.writer, self.zarr_writer):
            if writer is not None:
                writer.abort()

    def heatmap_scores(self, mm2_per_px0: float | None) -> dict[str, Any] | None:
        """Per-class statistics over the tissue (see :class:`~.stitch.sinks.HeatmapStats`)."""
        if self.stats is None:
            return None
        self.drain_heatmap()
        mm2 = mm2_per_px0 * self.geometry.heatmap_scale_level0**2 if mm2_per_px0 else None
        return self.stats.summary(list(self.card.heatmap.classes), mm2)

    def overlay_inputs(self, dets: np.ndarray) -> tuple:
        """:func:`~.io.overlay.write_overlay`'s arguments after the path: thumbnail, heatmap, boxes,
        colours, and the class and heatmap channel names of its legend."""
        self.drain_heatmap()
        thumb = self.slide.get_thumbnail(self.config.overlay_size)
        thumb_ds = self.slide.dimensions[0] / thumb.shape[1]
        heat = self.reduced.array if self.reduced is not None else None
        heat_names = None
        if heat is not None:
            names = list(self.card.heatmap.classes)
            shown = [i for i, n in enumerate(names) if n.lower() not in _ALL_OVER] or list(range(len(names)))
            heat, heat_names = heat[shown], [names[i] for i in shown]
        scale = self.geometry.heatmap_scale_level0 * (self.reduced.factor if self.reduced is not None else 1)
        boxes = detection_boxes(dets) if len(dets) else None
        colors = [parse_color(c.color) for c in self.card.classes]
        labels = dets["label"] if len(dets) else None
        return thumb, thumb_ds, heat, scale, boxes, labels, colors, [c.name for c in self.card.classes], heat_names

    def write(self, dets: np.ndarray, writers: WriterPool) -> Callable[[], np.ndarray | HeatmapFile | None]:
        """Start writing the heatmap file, the overlay and the detection files; return the step that
        finishes them.

        The jobs go to the writer processes longest first, so that the one-piece
        jobs (the heatmap file's pyramid, the overlay) do not wait behind the
        detection files' parts. The returned callable waits for the writer
        processes (raising the first failure), joins each detection file's parts
        as soon as they are written, and returns the heatmap (its file's lazy
        reader, or the array when kept in memory). Write ``summary.json``
        (:meth:`write_summary`) after it, last.
        """
        out = self._folder()
        formats = self.config.formats
        classes = [{"name": c.name, "color": c.color} for c in self.card.classes]
        # The overlay reads the thumbnail: that may fail, before any file is begun.
        overlay = self.overlay_inputs(dets) if chosen(formats, OVERLAY) else None
        slide = {
            "dimensions": tuple(self.slide.dimensions),
            "slide_path": self.slide.absolute_path,
            "mpp": self.slide.mpp,
        }
        heatmap = self.close_heatmap(finish_file=False)
        heatmap_jobs, jobs = WriteJobs(), WriteJobs()
        self.write_jobs = [heatmap_jobs, jobs]  # and each file's parts: their writer processes' memory
        # Files written in parts: each file's part jobs apart, joined once they are written.
        joins: list[tuple[PartsWriter, Path, list[Path], WriteJobs]] = []
        spooled: SpooledHeatmap | None = None
        try:
            if self.writer is not None:
                # The heatmap file's pyramid and compression run in a writer process: done by a
                # thread here, they contended for the interpreter lock with the next slide's run.
                spooled = self.writer.spooled()
                writers.submit(heatmap_jobs, self.writer.path.name, write_spooled_heatmap, spooled)
            for fmt in chosen(formats, OVERLAY):
                writers.submit(jobs, fmt.filename, fmt.job(slide), out / fmt.filename, *overlay)
            n_parts = writers.parts(len(dets))
            prefix = feature_ids(dets) if n_parts > 1 else ""
            tiled = None
            for fmt in chosen(formats, DETECTIONS):
                if fmt.filename in not_written(formats, dets):
                    continue
                if fmt.tiles and tiled is None:
                    x_level0, y_level0 = ((dets[a] + dets[b]) / 2 for a, b in (("x0", "x1"), ("y0", "y1")))
                    tiled = with_tiles(dets, *self.geometry.core_tiles_level0(x_level0, y_level0))
                rows = tiled if fmt.tiles else dets
                split = fmt.parts_writer() if n_parts > 1 else None
                if split is None:
                    writers.submit(jobs, fmt.filename, fmt.job(slide), out / fmt.filename, rows, classes)
                    continue
                bounds = np.linspace(0, len(dets), n_parts + 1).astype(int).tolist()
                paths = [partial_name(out / f"{fmt.filename}.part{i}") for i in range(n_parts)]
                part_jobs = WriteJobs()
                self.write_jobs.append(part_jobs)
                joins.append((split, out / fmt.filename, paths, part_jobs))
                for path, a, b in zip(paths, bounds[:-1], bounds[1:], strict=True):
                    writers.submit(part_jobs, fmt.filename, split.write_part, path, rows[a:b], classes, prefix, a)
        except BaseException:
            # Nothing may write into the folder after this returns: the jobs begun end first.
            for begun in (heatmap_jobs, jobs, *(j[3] for j in joins)):
                with contextlib.suppress(BaseException):
                    begun.wait()
            _remove_parts(joins)
            if spooled is not None:
                spooled.discard()
            raise

        def join(split: PartsWriter, path: Path, paths: list[Path], part_jobs: WriteJobs) -> None:
            part_jobs.wait()
            write_joined(path, paths, split.head, split.sep, split.tail)

        def finish() -> np.ndarray | HeatmapFile | None:
            nonlocal heatmap
            try:
                # Each file's parts are joined (copied by the kernel, then synced) while the other
                # jobs run, on a thread of its own; leaving the block waits for the joins.
                with ThreadPoolExecutor(max(1, len(joins)), thread_name_prefix="join-parts") as joiner:
                    joined = [joiner.submit(join, *j) for j in joins]
                    try:
                        heatmap_jobs.wait()
                        if self.writer is not None:
                            heatmap = heatmap if heatmap is not None else HeatmapFile(self.writer.path)
                            # Files made from the finished heatmap file (its pyramid read back, not the stream).
                            for fmt in chosen(formats, HEATMAP_FILE):
                                job = fmt.job({**slide, "scale_level0": self.geometry.heatmap_scale_level0})
                                writers.submit(
                                    jobs,
                                    fmt.filename,
                                    job,
                                    out / fmt.filename,
                                    self.writer.path,
                                    list(self.card.heatmap.classes),
                                )
                    finally:
                        jobs.wait()
                for done in joined:
                    done.result()
            except BaseException:
                if spooled is not None:
                    spooled.discard()  # where the writer process died before removing it
                _remove_parts(joins)
                raise
            return heatmap

        return finish

    def writer_peak_memory_mb(self) -> float | None:
        """The peak memory of the writer processes while they wrote this slide's files (after :meth:`write`'s
        step has finished; :func:`~.io.writer_pool.writer_peak_memory_mb`)."""
        return writer_peak_memory_mb(self.write_jobs)

    def summary_entries(self, dets: np.ndarray) -> dict[str, Any]:
        """What ``summary.json`` says of the files: ``files`` (written, itself last), with a
        GeoJSON format ``geojson_left_out`` (boxes without area, not written there; logged), and
        ``not_written`` where a chosen file cannot hold a slide's zero detections (logged)."""
        notes: dict[str, Any] = detection_notes(self.config.formats, dets)
        if notes.get("geojson_left_out"):
            log.warning(
                "%s: %d detections have no area (zero width or height) and are left out of the GeoJSON",
                self.slide.path,
                notes["geojson_left_out"],
            )
        left_out = not_written(self.config.formats, dets)
        for name, why in left_out.items():
            log.info("%s: %s not written: %s", self.slide.path, name, why)
        if left_out:
            notes["not_written"] = left_out
        files = output_files(self.config.formats, heatmap=self.card.heatmap is not None, detections=len(dets) > 0)
        return {"files": files, **notes}

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json``, the mark of a complete folder: after every other file."""
        write_json(self._folder() / SUMMARY_FILE, summary)

    def _folder(self) -> Path:
        if self.out is None:
            raise ValueError("this slide's outputs have no folder")
        return self.out


def _remove_parts(joins: list) -> None:
    """Remove the parts of the files written in parts (those not yet joined and removed)."""
    for _, _, paths, _ in joins:
        for part in paths:
            with contextlib.suppress(OSError):  # a failure is being raised: this one would hide it
                part.unlink(missing_ok=True)


__all__ = ["OUTPUT_FILES", "SlideOutputs"]
