"""One slide's run, once planned: its tiles through the model into a stitcher, its result and files.

:class:`~.pipeline.Pipeline` sets the parts up (executor, service, writer processes, merging
process, JPEG helper processes) and plans a slide (:mod:`.slide_plan`); a :class:`SlideRunner`
runs the plan with those parts: the tiles read (on the CPU or the GPU) and inferred, the boxes
merged and the heatmap blended by a :class:`~.stitch.stitcher.Stitcher` into the slide's
:class:`~.outputs.SlideOutputs`, then the summary and the files.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .config import RunConfig
from .inference.card_spec import ModelCard
from .inference.choice import even_batches, fixed_batches
from .inference.executor import Executor
from .inference.service import TileService
from .io.detections import make_detections
from .io.writer_pool import WriterPool
from .outputs import SlideOutputs
from .result import Result
from .slide import Slide
from .slide_plan import SlidePlan
from .stages import StageTimer, peak_gpu_memory_mb, peak_host_memory_mb
from .stitch.merge_runner import MergeProcess
from .stitch.policies import merge_policy
from .stitch.stitcher import Stitcher
from .summary import (
    TilesInfo,
    TissueInfo,
    build_summary,
    mm2_per_level0_px,
    package_versions,
    slide_reader_info,
    summary_warnings,
    tiles_info,
    tissue_info,
)
from .tiling.grid import Tile, read_tile
from .tiling.jpeg_processes import SHARE_PERIOD, JpegHelpers
from .tiling.slide_loader import choose_tile_decode, make_slide_loader

log = logging.getLogger("wsi_pipeline")
# Slides of at least this many tiles merge their boxes in the pipeline's box-merging process
# (stitch.merge_runner): enough boxes that the merge's hold on the interpreter lock slows the run;
# a smaller image (a camera frame) merges on a thread, with no process to start or cross.
MERGE_PROCESS_MIN_TILES = 256
Progress = Callable[[int], None]


class RunParts(Protocol):
    """What a run takes from its pipeline, read at each run (the pipeline's attributes)."""

    card: ModelCard
    config: RunConfig
    executor: Executor
    backend_name: str
    batch_size: int
    reader_workers: int
    service: TileService
    writers: WriterPool
    merging: MergeProcess
    jpeg_helpers: JpegHelpers | None


class SlideRunner:
    """Runs a pipeline's planned slides with its parts; files finished on a thread of its own
    for runs that do not wait for them (``wait_written=False``)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        # One run's files at a time are waited for there, while the next runs go on.
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="finish-outputs")

    def close(self) -> None:
        """Wait for the files under way."""
        self.finisher.shutdown(wait=True)

    def run_slide(
        self,
        plan: SlidePlan,
        out_dir: str | os.PathLike[str] | None,
        progress: bool | Progress,
        keep_heatmap: bool | None,
        timer: StageTimer,
        t_start: float,
        extra_summary: dict[str, Any],
    ) -> Callable[[bool], Result]:
        """Run the plan's tiles through the model into a stitcher; the step that completes the run
        (given ``wait_written``: the stitching's end, the summary and the files)."""
        cfg, card = self.parts.config, self.parts.card
        slide, geometry, grid, tiles = plan.slide, plan.geometry, plan.grid, plan.tiles
        out = Path(out_dir) if out_dir is not None else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.parts.writers.start()  # the writer processes start while the slide runs
        if keep_heatmap is None:
            keep_heatmap = out is None
        extra_summary = {"tissue_warning": _tissue_warning(plan, cfg), "warnings": list(plan.warnings), **extra_summary}
        outputs = SlideOutputs(geometry, card, cfg, slide, plan.mask, out, keep_heatmap)
        stitcher, box_merge = self.start_stitcher(plan, outputs)
        run_info: dict[str, Any] = {
            "slide_reader": slide_reader_info(slide, geometry.level),
            "box_merge": box_merge,
            "tile_decode": {"where": "cpu", "why": "an array in memory"},
            "heatmap_blended_on": None
            if stitcher.blender is None
            else ("host" if stitcher.heatmap_device is None else str(stitcher.heatmap_device)),
        }
        try:
            peak_gpu_mb = self._infer(plan, stitcher, progress, timer, run_info)
        except BaseException:
            stitcher.close()
            outputs.abort()
            raise

        def complete(wait_written: bool) -> Result:
            try:
                with timer("stitch"):
                    dets = make_detections(*stitcher.finish())
                _note_detections_over_cap(stitcher, run_info, slide, card)
                with timer("write"):
                    heatmap = outputs.close_heatmap() if out is None else None
                    return self._result(
                        slide,
                        outputs,
                        dets,
                        heatmap,
                        tissue_info(plan.method, plan.mask, slide.mpp),
                        tiles_info(grid, len(tiles)),
                        {**run_info, **extra_summary},
                        timer,
                        t_start,
                        peak_gpu_mb,
                        wait_written,
                    )
            except BaseException:
                stitcher.close()
                outputs.abort()
                raise

        return complete

    def start_stitcher(self, plan: SlidePlan, outputs: SlideOutputs) -> tuple[Stitcher, str]:
        """The slide's stitcher into ``outputs``' heatmap sink, and where its boxes merge: in the
        pipeline's merging process (``process``) for slides of at least ``MERGE_PROCESS_MIN_TILES``
        tiles, else on a thread (``thread``)."""
        cfg, card, executor = self.parts.config, self.parts.card, self.parts.executor
        # On a GPU, a slide's heatmaps are blended where the model made them.
        on_device = executor.backend.device if executor.is_cuda and not plan.is_array else None
        policy = merge_policy(cfg.merge, cfg.nms_iou, cfg.nms_metric, cfg.drop_edge_boxes)
        merge = None
        if len(plan.tiles) >= MERGE_PROCESS_MIN_TILES:
            merge = self.parts.merging.merge(policy)
        try:
            stitcher = Stitcher(
                plan.geometry,
                policy,
                cfg.score_threshold,
                outputs.heatmap_sink,
                outputs.heatmap_weights,
                outputs.heatmap_channels,
                heatmap_device=on_device,
                source=str(card.card_path or card.name),
                merge=merge,
            )
        except BaseException:
            if merge is not None:
                merge.abandon()
            raise
        return stitcher, "process" if merge is not None else "thread"

    def _infer(
        self,
        plan: SlidePlan,
        stitcher: Stitcher,
        progress: bool | Progress,
        timer: StageTimer,
        run_info: dict[str, Any],
    ) -> float | None:
        """The plan's tiles read and through the model into ``stitcher``, timed as ``read_and_infer``,
        reported to ``progress``; this run's peak GPU memory (MB), read before the next run resets it."""
        slide, tiles = plan.slide, plan.tiles
        bar = None
        if progress is True:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tiles), desc=Path(str(slide.path)).name, unit="tile", leave=False)
            report: Progress | None = bar.update
        else:
            report = progress or None
        try:
            with timer("read_and_infer"):
                if plan.is_array:
                    self._infer_array(slide, tiles, stitcher, report)
                else:
                    self._infer_slide(slide, tiles, stitcher, report, timer, run_info)
            # The next run may start before this one completes.
            return peak_gpu_memory_mb()
        finally:
            if bar is not None:
                bar.close()

    def _infer_slide(
        self,
        slide: Slide,
        tiles: list[Tile],
        stitcher: Stitcher,
        report: Progress | None,
        timer: StageTimer,
        run_info: dict[str, Any],
    ) -> None:
        cfg, cuda = self.parts.config, self.parts.executor.is_cuda
        where, why, decoder = choose_tile_decode(
            slide, tiles, cfg.decode, cfg.on_damaged_tile, self.parts.backend_name, cuda
        )
        helpers = self.parts.jpeg_helpers if where == "gpu" else None
        if helpers is not None and helpers.tile_share:
            why += f", {helpers.tile_share}/{SHARE_PERIOD} of them by {helpers.count} libjpeg-turbo processes meanwhile"
        log.info("%s: tiles decoded on the %s (%s)", slide.path, where.upper(), why)
        loader, read_seconds = make_slide_loader(
            slide,
            tiles,
            where,
            batch_size=self.parts.batch_size,
            streams=self.parts.executor.streams,
            reader_workers=self.parts.reader_workers,
            device=str(self.parts.executor.backend.device) if cuda else None,
            jpeg_helpers=helpers,
            jpeg_decoder=decoder,
            model_on_cpu=not cuda,
        )
        with loader:
            on_device = stitcher.heatmap_device is not None
            for br in self.parts.executor.run(loader, ordered=True, heatmaps_on_device=on_device):
                stitcher.add_batch(br.tiles, br.batch)
                if report is not None:
                    report(len(br.tiles))
        run_info["tile_decode"] = {"where": where, "why": why, "decoder": decoder}
        if where == "gpu":
            dec = loader.decoder
            run_info["tile_decode"].update(
                cpu_fallback_batches=dec.cpu_fallback_batches,
                stored_tiles_decoded=dec.stored_tiles_decoded,
                stored_tiles_reused=dec.stored_tiles_reused,
                stored_tiles_by_helpers=dec.stored_tiles_by_helpers,
            )
        timer.seconds["tile_reads_worker_s"] += read_seconds()
        slide.clear_cache()  # the decoded tiles are not needed for what follows

    def _infer_array(self, slide: Slide, tiles: list[Tile], stitcher: Stitcher, report: Progress | None) -> None:
        size = self.parts.card.input.size_hw[0]
        streams = self.parts.executor.streams
        # A batch size given is kept; the CPU's default shares the tiles evenly among the sessions.
        chosen = self.parts.config.batch_size is not None or self.parts.executor.is_cuda
        batch = self.parts.batch_size
        chunks = fixed_batches(len(tiles), batch) if chosen else even_batches(len(tiles), batch, streams)
        pending: list[tuple[list[Tile], Any]] = []
        max_pending = streams + 1
        start = 0
        for n in chunks:
            part = tiles[start : start + n]
            start += n
            images = np.empty((len(part), size, size, 3), np.uint8)
            for i, t in enumerate(part):
                read_tile(slide, t, images[i])
            # The default's batches are each run alone: merged with the next they would undo the split.
            pending.append((part, self.parts.service.submit(images, batch=None if chosen else n)))
            while len(pending) >= max_pending:
                self._drain_one(pending, stitcher, report)
        while pending:
            self._drain_one(pending, stitcher, report)

    @staticmethod
    def _drain_one(pending: list, stitcher: Stitcher, report: Progress | None) -> None:
        part, fut = pending.pop(0)
        stitcher.add_batch(part, fut.result())
        if report is not None:
            report(len(part))

    def _result(
        self,
        slide: Slide,
        outputs: SlideOutputs,
        dets: np.ndarray,
        heatmap: Any,
        tissue: TissueInfo,
        tiles: TilesInfo,
        extra_summary: dict[str, Any],
        timer: StageTimer,
        t_start: float,
        peak_gpu_mb: float | None,
        wait_written: bool = True,
    ) -> Result:
        """The run's result and summary; with an output folder, its files started, and finished
        now or (``wait_written=False``) by a thread, ``summary.json`` last."""
        card = self.parts.card
        t_write = time.perf_counter()
        summary = build_summary(
            slide=slide,
            dets=dets,
            card=card,
            tissue=tissue,
            tiles=tiles,
            heatmap_scale_level0=outputs.geometry.heatmap_scale_level0,
            heatmap_scores=outputs.heatmap_scores(mm2_per_level0_px(slide.mpp)),
            seconds={**timer.as_dict(), "total": round(time.perf_counter() - t_start, 4)},
            run={
                "peak_host_memory_mb": round(peak_host_memory_mb(), 1),
                "peak_gpu_memory_mb": _round(peak_gpu_mb),
                "backend": self.parts.backend_name,
                "batch_size": self.parts.batch_size,
                "streams": self.parts.executor.streams,
                "reader_workers": self.parts.reader_workers,
                "parameters": self.parts.config.as_dict(),
                "versions": package_versions(),
            },
            extra=extra_summary,
        )
        result = Result(
            str(slide.path),
            dets,
            heatmap,
            outputs.geometry.heatmap_scale_level0,
            summary,
            card.class_names,
            list(card.heatmap.classes) if card.heatmap else [],
            outputs.out,
        )
        if outputs.out is None:
            return result
        # Detection files and overlay are written by worker processes while a thread finishes the
        # heatmap file; summary.json, the mark of a complete folder, comes last.
        summary.update(outputs.summary_entries(dets))  # type: ignore[typeddict-item]
        close_files = outputs.write(dets, self.parts.writers)
        summary["damaged_tiles"] = slide.damage_summary()  # the overlay's thumbnail reads tiles too
        summary["warnings"] = summary_warnings(summary, extra_summary["warnings"])

        def finish() -> None:
            result.heatmap = close_files()
            summary["peak_writer_memory_mb"] = outputs.writer_peak_memory_mb()
            summary["seconds"]["write"] = round(time.perf_counter() - t_write, 4)
            summary["seconds"]["total"] = round(time.perf_counter() - t_start, 4)
            outputs.write_summary(summary)

        if wait_written:
            finish()
        else:
            result.written = self.finisher.submit(finish)
        return result


def _tissue_warning(plan: SlidePlan, cfg: RunConfig) -> str | None:
    """Log the plan's tile selection; the warning about it, if its tissue selection looks wrong."""
    slide, tiles, grid = plan.slide, plan.tiles, plan.grid
    log.info("%s: %s, %d of %d tiles selected", slide.path, grid, len(tiles), len(grid))
    warning = plan.mask.selection_warning(len(tiles), len(grid), cfg.min_tissue, plan.method)
    if warning:
        log.warning("%s: %s", slide.path, warning)
    return warning


def _note_detections_over_cap(stitcher: Stitcher, run_info: dict[str, Any], slide: Slide, card: ModelCard) -> None:
    """Record in ``run_info`` (and log) the detections dropped past the card's cap a tile."""
    run_info["detections_over_cap"] = stitcher.over_cap
    if stitcher.over_cap:
        log.warning(
            "%s: %d detections dropped: tiles gave more than the card's %d a tile "
            "(max_detections_per_tile), the lowest scores were dropped",
            slide.path,
            stitcher.over_cap,
            card.detections_cap,
        )


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


__all__ = ["MERGE_PROCESS_MIN_TILES", "Progress", "RunParts", "SlideRunner"]
