"""One slide's outputs: the heatmap sinks the stitcher feeds, and the files written after it.

:class:`SlideOutputs` is built per slide by the pipeline and hands the
stitcher one sink (:attr:`SlideOutputs.heatmap_sink`) that fans out, from
threads of its own (:class:`~.stitch.sinks.BackgroundSink`), to the writers of
the heatmap files chosen (with an output folder: each heatmap format's
``sink`` in :mod:`.io.formats`, such as the OME-TIFF and OME-Zarr writers)
on one thread, and on another to an in-memory array (when asked),
per-class statistics over the tissue and, when an overlay is written, a
reduced copy for it. Whatever reads them (:meth:`SlideOutputs.heatmap_scores`,
the overlay, :meth:`SlideOutputs.close_heatmap`) waits for those threads
first; :meth:`SlideOutputs.abort` ends them too.
After stitching, :meth:`SlideOutputs.write` sends the heatmap files whose
sinks spool them (their pyramids), the overlay and the detection files of
``config.formats`` (:mod:`.io.formats`) to the writer processes, then the
files made from a finished heatmap file, and returns the step that waits for
them; ``summary.json``, the mark of a complete folder, is written last.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .config import RunConfig
from .geometry import TilingGeometry
from .inference.card_spec import ModelCard
from .io.atomic import partial_name, write_joined, write_json
from .io.detections import PartsWriter, detection_boxes, feature_ids, parse_color, with_tiles
from .io.formats import (
    DEFAULT_FORMATS,
    DETECTIONS,
    FORMATS,
    HEATMAP,
    HEATMAP_FILE,
    OVERLAY,
    chosen,
    detection_notes,
    not_written,
    output_files,
)
from .io.ome_tiff import HeatmapFile, write_spooled_heatmap
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

    Attributes:
        heatmap_files: the writers of the chosen heatmap formats' files (each format's ``sink``), by
            format name; empty without an output folder or a heatmap output.
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
        # The heatmap files' writers (each chosen heatmap format's ``sink``), by format name.
        self.heatmap_files: dict[str, Any] = {}
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
        sinks: list[Sink] = [FiniteCheck(hm.classes, g.heatmap_scale_level0)]
        if out is not None:
            self._begin_heatmap_files(out)
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
        # The heatmap files' writers on one thread, the other sinks on another.
        files = list(self.heatmap_files.values())
        self.heatmap_sink = self._background = BackgroundSink(*(fan_out(*group) for group in (files, sinks) if group))
        self.heatmap_weights = tile_weights(
            g.heatmap_tile, config.blend, config.sigma_scale, overlap_px=(g.overlap // hm.stride) or 1
        )

    def _begin_heatmap_files(self, out: Path) -> None:
        """Make the writer of each chosen heatmap format (:attr:`heatmap_files`); where one cannot be
        made, those made before it are aborted."""
        g, classes = self.geometry, list(self.card.heatmap.classes)
        plane = dict(channel_names=classes, physical_size_um=g.heatmap_pixel_size_um(self.slide.mpp))
        try:
            for fmt in chosen(self.config.formats, HEATMAP):
                sink = fmt.sink_class()(out / fmt.filename, g.heatmap_width, g.heatmap_height, len(classes), **plane)
                self.heatmap_files[fmt.name] = sink
        except BaseException:
            self.abort()
            raise

    def _spooled(self) -> dict[str, Any]:
        """The heatmap files' writers that hand their file to a writer process (``spooled()``)."""
        return {n: s for n, s in self.heatmap_files.items() if callable(getattr(s, "spooled", None))}

    def _heatmap_reader(self) -> HeatmapFile | None:
        """The lazy reader of the first finished heatmap file whose format has a ``reader``, or None."""
        for name, sink in self.heatmap_files.items():
            reader = FORMATS[name].reader_class()
            if reader is not None:
                return reader(sink.path)
        return None

    @property
    def heatmap_channels(self) -> int:
        return len(self.card.heatmap.classes) if self.card.heatmap is not None else 0

    def drain_heatmap(self) -> None:
        """Wait until every heatmap row handed over has reached the sinks (raises their failure)."""
        if self._background is not None:
            self._background.close()

    def close_heatmap(self, finish_file: bool = True) -> np.ndarray | HeatmapFile | None:
        """Finish the heatmap sinks; the heatmap in memory, the file's lazy reader, or None.

        ``finish_file=False`` leaves the heatmap files whose writers offer ``spooled()`` to the caller
        (:meth:`~.io.ome_tiff.OmeTiffHeatmapWriter.spooled`), and returns no reader.
        """
        self.drain_heatmap()
        if self.reduced is not None:
            self.reduced.close()
        spooled = self._spooled()
        for name, sink in self.heatmap_files.items():
            if name not in spooled:
                sink.close()
        if finish_file:
            for sink in spooled.values():
                sink.close()
        if self.array_sink is not None:
            return self.array_sink.array
        return self._heatmap_reader() if finish_file else None

    def abort(self) -> None:
        """Remove what was begun (the heatmap files' partial data)."""
        if self._background is not None:
            self._background.abandon()
        for sink in self.heatmap_files.values():
            sink.abort()

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
        """Start writing the heatmap files, the overlay and the detection files; return the step that
        finishes them.

        The jobs go to the writer processes longest first, so that the one-piece
        jobs (the heatmap files' pyramids, the overlay) do not wait behind the
        detection files' parts. The returned callable waits for the writer
        processes (raising the first failure), joins each detection file's parts
        as soon as they are written, writes the files made from a finished
        heatmap file, and returns the heatmap (its file's lazy reader, or the
        array when kept in memory). Write ``summary.json`` (:meth:`write_summary`)
        after it, last.
        """
        out = self._folder()
        # The overlay reads the thumbnail: that may fail, before any file is begun.
        overlay = self.overlay_inputs(dets) if chosen(self.config.formats, OVERLAY) else None
        slide = {
            "dimensions": tuple(self.slide.dimensions),
            "slide_path": self.slide.absolute_path,
            "mpp": self.slide.mpp,
        }
        heatmap = self.close_heatmap(finish_file=False)
        begun = _FilesBegun()
        self.write_jobs = [begun.heatmap_jobs, begun.jobs]  # and each file's parts: their writer processes' memory
        try:
            self._submit_spooled_heatmaps(writers, begun)
            for fmt in chosen(self.config.formats, OVERLAY):
                writers.submit(begun.jobs, fmt.filename, fmt.job(slide), out / fmt.filename, *overlay)
            self._submit_detection_files(dets, slide, writers, begun)
        except BaseException:
            begun.abandon()
            raise
        return functools.partial(self._finish_files, heatmap, slide, writers, begun)

    def _submit_spooled_heatmaps(self, writers: WriterPool, begun: _FilesBegun) -> None:
        """Hand each heatmap file whose writer spools it to the writer processes.

        Its pyramid and compression run in a writer process: done by a thread
        here, they contended for the interpreter lock with the next slide's run.
        """
        for sink in self._spooled().values():
            spooled = sink.spooled()
            begun.spooled.append(spooled)
            writers.submit(begun.heatmap_jobs, sink.path.name, write_spooled_heatmap, spooled)

    def _submit_detection_files(
        self, dets: np.ndarray, slide: dict[str, Any], writers: WriterPool, begun: _FilesBegun
    ) -> None:
        """Hand the detection files to the writer processes: each whole, or in parts where the
        detections are many and its format can be written in parts (joined by :meth:`_finish_files`)."""
        out, formats = self._folder(), self.config.formats
        classes = [{"name": c.name, "color": c.color} for c in self.card.classes]
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
                writers.submit(begun.jobs, fmt.filename, fmt.job(slide), out / fmt.filename, rows, classes)
                continue
            bounds = np.linspace(0, len(dets), n_parts + 1).astype(int).tolist()
            paths = [partial_name(out / f"{fmt.filename}.part{i}") for i in range(n_parts)]
            part_jobs = WriteJobs()
            self.write_jobs.append(part_jobs)
            begun.joins.append(_Join(split, out / fmt.filename, paths, part_jobs))
            for path, a, b in zip(paths, bounds[:-1], bounds[1:], strict=True):
                writers.submit(part_jobs, fmt.filename, split.write_part, path, rows[a:b], classes, prefix, a)

    def _finish_files(
        self,
        heatmap: np.ndarray | HeatmapFile | None,
        slide: dict[str, Any],
        writers: WriterPool,
        begun: _FilesBegun,
    ) -> np.ndarray | HeatmapFile | None:
        """The step :meth:`write` returns: wait for the files, joining those written in parts, and
        write the files made from a finished heatmap file; the heatmap."""
        try:
            # Each file's parts are joined (copied by the kernel, then synced) while the other
            # jobs run, on a thread of its own; leaving the block waits for the joins.
            with ThreadPoolExecutor(max(1, len(begun.joins)), thread_name_prefix="join-parts") as joiner:
                joined = [joiner.submit(_join, j) for j in begun.joins]
                try:
                    begun.heatmap_jobs.wait()
                    heatmap = heatmap if heatmap is not None else self._heatmap_reader()
                    self._submit_made_from_heatmap(slide, writers, begun.jobs)
                finally:
                    begun.jobs.wait()
            for done in joined:
                done.result()
        except BaseException:
            begun.remove_leftovers()  # a spool: where the writer process died before removing it
            raise
        return heatmap

    def _submit_made_from_heatmap(self, slide: dict[str, Any], writers: WriterPool, jobs: WriteJobs) -> None:
        """Hand the files made from a finished heatmap file (its pyramid read back, not the stream) to
        the writer processes: each from the file of the first format it is ``made_from``."""
        out = self._folder()
        for fmt in chosen(self.config.formats, HEATMAP_FILE):
            source = self.heatmap_files.get(fmt.made_from[0])
            if source is None:  # a model without a heatmap output
                continue
            job = fmt.job({**slide, "scale_level0": self.geometry.heatmap_scale_level0})
            writers.submit(jobs, fmt.filename, job, out / fmt.filename, source.path, list(self.card.heatmap.classes))

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


class _Join(NamedTuple):
    """A file written in parts: its :class:`~.io.detections.PartsWriter`, path, parts and their jobs."""

    split: PartsWriter
    path: Path
    parts: list[Path]
    jobs: WriteJobs


def _join(join: _Join) -> None:
    """Wait for a file's parts, then join them into the file."""
    join.jobs.wait()
    write_joined(join.path, join.parts, join.split.head, join.split.sep, join.split.tail)


@dataclass
class _FilesBegun:
    """The writer-pool jobs :meth:`SlideOutputs.write` began for one slide's folder.

    The heatmap files' jobs are apart from the others (the files made from a
    finished heatmap file wait for them), and each file written in parts has
    its part jobs apart (:class:`_Join`).
    """

    heatmap_jobs: WriteJobs = field(default_factory=WriteJobs)
    jobs: WriteJobs = field(default_factory=WriteJobs)
    joins: list[_Join] = field(default_factory=list)
    spooled: list[Any] = field(default_factory=list)  # the heatmap files' spools handed to writer processes

    def abandon(self) -> None:
        """Undo a write that failed while its jobs were handed over: wait for the jobs begun (nothing
        may write into the folder after this returns), then remove what they leave."""
        for begun in (self.heatmap_jobs, self.jobs, *(j.jobs for j in self.joins)):
            with contextlib.suppress(BaseException):
                begun.wait()
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """Remove the parts not yet joined and removed, and the heatmap files' spools."""
        for join in self.joins:
            for part in join.parts:
                with contextlib.suppress(OSError):  # a failure is being raised: this one would hide it
                    part.unlink(missing_ok=True)
        for spooled in self.spooled:
            spooled.discard()


__all__ = ["OUTPUT_FILES", "SlideOutputs"]
