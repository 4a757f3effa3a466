"""The Python API: a model loaded once, run over slides, images and arrays.

>>> import numpy as np
>>> from wsi_pipeline import Pipeline
>>> pipe = Pipeline.from_card("engines/defects_industrial.card.json", backend="ort")
>>> result = pipe.run(np.full((600, 800, 3), 128, np.uint8))
>>> result.detections.dtype.names
('x0', 'y0', 'x1', 'y1', 'score', 'label')
>>> result.heatmap is None  # this model has no heatmap output
True
>>> result.summary["tiles"]["total"]
4
>>> pipe.close()

A run: tile grid at the model's resolution (or the config's level / mpp) ->
tissue mask -> tiles with enough tissue read by a :class:`TileLoader` ->
the :class:`Executor` -> boxes mapped to level-0 pixels and merged across
tile overlaps (global NMS by default) -> tile heatmaps blended by position
weights, streamed to the OME-TIFF writer, slide statistics and a reduced
copy for the overlay. Slides go through the executor's streaming path;
arrays (camera images) go through a :class:`TileService`, so several threads
calling :meth:`Pipeline.run` at once share batches.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .errors import ClosedError, ConfigError
from .geometry import TilingGeometry, check_tiling
from .inference.backend import cuda_may_be_present
from .inference.card import ModelCard, load_card
from .inference.choice import default_batch_size, default_reader_workers, make_executor
from .inference.service import TileService
from .inference.shipped import shipped_card
from .io.detections import make_detections
from .io.writer_pool import DEFAULT_PROCESSES as DEFAULT_WRITER_PROCESSES
from .io.writer_pool import WriterPool, check_not_importing_main
from .outputs import OUTPUT_FILES, SlideOutputs
from .result import PendingResult, Result
from .slide import Slide
from .slide_plan import SlidePlan, make_plan, plan_geometry
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
from .tiling.jpeg_processes import SHARE_PERIOD, JpegHelpers, default_helpers
from .tiling.slide_loader import choose_tile_decode, import_gpu_loader_ahead, make_slide_loader

log = logging.getLogger("wsi_pipeline")
# Backends that may decode tiles on the GPU.
GPU_BACKENDS = ("torch", "tensorrt")

# Where it is looked up: see inference/shipped.py (WSI_PIPELINE_ENGINES, the checkout, the installed copy).
DEFAULT_MODEL = shipped_card()
# Slides of at least this many tiles merge their boxes in the pipeline's box-merging process
# (stitch.merge_runner): enough boxes that the merge's hold on the interpreter lock slows the run;
# a smaller image (a camera frame) merges on a thread, with no process to start or cross.
MERGE_PROCESS_MIN_TILES = 256
Progress = Callable[[int], None]


def check_card_config(card: ModelCard, config: RunConfig) -> None:
    """Raise :class:`ConfigError` unless ``config``'s tiling fits ``card``'s model (square input,
    its tile size, an overlap that makes a grid of its heatmap stride): what :class:`Pipeline`
    checks, here for a command to check before it writes anything."""
    h, w = card.input.size_hw
    if h != w:
        raise ConfigError(f"{card.card_path}: the tile grid needs a square model input, found {h} x {w}")
    if config.tile is not None and config.tile != h:
        raise ConfigError(f"tile: the model {card.name} takes {h} px tiles, found tile = {config.tile}")
    stride = card.heatmap.stride if card.heatmap is not None else None
    # The overlap is the config's, the tile size and stride the card's: the message names the setting.
    check_tiling(h, config.overlap, stride, where=f"config (model {card.name}, {h} px tiles)")


class Pipeline:
    """A detector loaded once, with its executor, serving many runs.

    Args:
        card: a model card or its path (default: the shipped pathology model).
        backend: ``auto`` (the best this machine runs, see
            :func:`~.inference.choice.make_executor`), ``ort``, ``torch`` or ``tensorrt``.
        config: the run settings (:class:`~.config.RunConfig`); keyword
            ``overrides`` replace single settings.
        writer_processes: worker processes that write a run's GeoJSON, CSV
            and overlay in parallel (:mod:`.io.writer_pool`; 0: in the
            calling thread).
        jpeg_helpers: where tiles are decoded on the GPU, processes that decode
            a share of the stored JPEG tiles with libjpeg-turbo meanwhile
            (:mod:`.tiling.jpeg_processes`); None: as many as the machine's
            cores allow (:func:`~.tiling.jpeg_processes.default_helpers`), 0: none.

    :meth:`run` is thread-safe: calls on arrays from several threads share
    batches through a :class:`TileService` (dynamic batching, waiting at most
    ``max_wait_s`` for a batch to fill).
    """

    def __init__(
        self,
        card: ModelCard | str | os.PathLike[str] | None = None,
        backend: str = "auto",
        config: RunConfig | None = None,
        max_wait_s: float = 0.005,
        writer_processes: int = DEFAULT_WRITER_PROCESSES,
        jpeg_helpers: int | None = None,
        **overrides: Any,
    ):
        check_not_importing_main()
        config = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
        if card is None:
            card = config.model or DEFAULT_MODEL
        self.card = card if isinstance(card, ModelCard) else load_card(card)
        self.config = config.replace(model=str(self.card.card_path or config.model or ""))
        self._check_card_config()
        requested = backend if backend != "auto" else config.backend
        self.jpeg_helpers: JpegHelpers | None = None
        if config.decode != "cpu" and requested in ("auto", *GPU_BACKENDS) and cuda_may_be_present():
            import_gpu_loader_ahead()  # while the model loads
            n = default_helpers(os.cpu_count()) if jpeg_helpers is None else int(jpeg_helpers)
            if n > 0:
                self.jpeg_helpers = JpegHelpers(n)
                self.jpeg_helpers.start_processes()  # they import their modules while the model loads
        try:
            self.executor, self.backend_name = make_executor(self.card, requested, config.streams, config.batch_size)
        except BaseException:
            if self.jpeg_helpers is not None:
                self.jpeg_helpers.close()
            raise
        self.batch_size = config.batch_size or min(
            default_batch_size(self.card, self.executor.is_cuda), self.executor.max_batch
        )
        self.reader_workers = config.workers or default_reader_workers(os.cpu_count() or 2)
        self.service = TileService(
            self.executor.infer_tiles, max_batch=self.batch_size, workers=self.executor.streams, max_wait_s=max_wait_s
        )
        self.writers = WriterPool(writer_processes)
        if self.jpeg_helpers is not None and not self.executor.is_cuda:
            self.jpeg_helpers.close()  # the backend runs on the CPU: its runs decode there
            self.jpeg_helpers = None
        self.merging = MergeProcess()  # started by the first slide that uses it
        # Runs with wait_written=False: one completes (stitching's end, summary, files started) at a
        # time, in order, on the first; the second waits for one run's files at a time, while the
        # next runs go on.
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="complete-run")
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="finish-outputs")
        self._closed = False

    @classmethod
    def from_card(
        cls,
        path: str | os.PathLike[str] | None = None,
        backend: str = "auto",
        config: RunConfig | None = None,
        **overrides: Any,
    ) -> Pipeline:
        """Load the model card at ``path`` (default: the shipped pathology model) once."""
        return cls(path, backend=backend, config=config, **overrides)

    # -- set-up ----------------------------------------------------------------
    def _check_card_config(self) -> None:
        check_card_config(self.card, self.config)

    # -- running ---------------------------------------------------------------
    def run(
        self,
        source: str | os.PathLike[str] | Slide | np.ndarray | SlidePlan,
        out_dir: str | os.PathLike[str] | None = None,
        progress: bool | Progress = False,
        keep_heatmap: bool | None = None,
        extra_summary: dict[str, Any] | None = None,
        wait_written: bool = True,
    ) -> Result | PendingResult:
        """Detect and map over ``source``: a slide path, an open :class:`Slide`, an RGB array, or a
        :class:`SlidePlan` of one (:meth:`plan`; its steps are not done again).

        ``out_dir``: write the files of ``config.formats`` there (by default
        detections.geojson, detections.csv, heatmap.ome.tif and overlay.png;
        :mod:`.io.formats`), each atomically, then summary.json.
        ``progress``: True for a tqdm bar, or a callable given the number of
        tiles each step finished. ``keep_heatmap``: hold the blended heatmap
        in memory as ``result.heatmap`` (default: when nothing is written);
        with ``out_dir``, ``result.heatmap`` otherwise reads the OME-TIFF
        lazily. ``extra_summary``: entries added to the summary (e.g. the
        batch's run key). ``wait_written=False`` returns a
        :class:`~.result.PendingResult` once the slide's tiles have been
        through the model: the merge's last rows, the summary and the files
        follow on the pipeline's threads while the caller goes on (a batch's
        next slide runs meanwhile); its :meth:`~.result.PendingResult.wait_written`
        waits for them, returns the :class:`Result` and raises what failed.
        """
        if self._closed:
            if isinstance(source, SlidePlan):
                source.close()
            raise ClosedError("pipeline is closed")
        timer = StageTimer()
        t_start = time.perf_counter()
        if self.executor.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        if isinstance(source, SlidePlan):
            plan = source
            if plan.made_by is not self:
                plan.close()
                msg = f"{plan.slide.path}: a plan made by another pipeline (its card and settings tiled it)"
                raise ConfigError(msg)
            if plan.file_changed():
                # Replaced or rewritten while queued: the structure parsed at its opening is stale.
                log.info("%s: changed since it was opened ahead: opened again", plan.slide.path)
                plan.close()
                plan = self._plan(plan.slide.path, timer)
            else:
                for stage, seconds in plan.seconds.items():  # done before this call: counted in the total once
                    timer.seconds[stage] += seconds
                t_start -= sum(plan.seconds.values())
        else:
            plan = self._plan(source, timer)
        handed_over = False
        try:
            complete = self._run_slide(plan, out_dir, progress, keep_heatmap, timer, t_start, extra_summary or {})
            if wait_written:
                return complete(True)

            def complete_later() -> Result:
                try:
                    return complete(False)
                finally:
                    plan.close()

            pending = PendingResult(str(plan.slide.path), self._completer.submit(complete_later))
            handed_over = True
            return pending
        finally:
            if not handed_over:
                plan.close()

    def plan(self, source: str | os.PathLike[str] | Slide | np.ndarray) -> SlidePlan:
        """A run's first steps for ``source`` (see :meth:`run`): open it, tile it, find its tissue.

        Made ahead, e.g. on another thread while the previous slide runs, then given to
        :meth:`run`. Raises as :meth:`run` would for a slide that cannot be opened.
        """
        if self._closed:
            raise ClosedError("pipeline is closed")
        timer = StageTimer()
        plan = self._plan(source, timer)
        plan.seconds = dict(timer.seconds)
        return plan

    def _plan(self, source: str | os.PathLike[str] | Slide | np.ndarray, timer: StageTimer) -> SlidePlan:
        return make_plan(source, self.card, self.config, timer, made_by=self)

    def _geometry(self, slide: Slide) -> TilingGeometry:
        """The slide's tiling (:func:`~.slide_plan.plan_geometry` for this pipeline's card and settings)."""
        return plan_geometry(slide, self.card, self.config)

    def _run_slide(
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
        cfg, card = self.config, self.card
        slide, geometry, grid, tiles = plan.slide, plan.geometry, plan.grid, plan.tiles
        out = Path(out_dir) if out_dir is not None else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.writers.start()  # the writer processes start while the slide runs
        if keep_heatmap is None:
            keep_heatmap = out is None
        extra_summary = {"tissue_warning": _tissue_warning(plan, cfg), "warnings": list(plan.warnings), **extra_summary}
        outputs = SlideOutputs(geometry, card, cfg, slide, plan.mask, out, keep_heatmap)
        stitcher, box_merge = self._start_stitcher(plan, outputs)
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

    def _start_stitcher(self, plan: SlidePlan, outputs: SlideOutputs) -> tuple[Stitcher, str]:
        """The slide's stitcher into ``outputs``' heatmap sink, and where its boxes merge: in the
        pipeline's merging process (``process``) for slides of at least ``MERGE_PROCESS_MIN_TILES``
        tiles, else on a thread (``thread``)."""
        cfg, card = self.config, self.card
        policy = merge_policy(cfg.merge, cfg.nms_iou, cfg.nms_metric, cfg.drop_edge_boxes)
        merge = None
        if len(plan.tiles) >= MERGE_PROCESS_MIN_TILES:
            merge = self.merging.merge(policy)
        try:
            stitcher = Stitcher(
                plan.geometry,
                policy,
                cfg.score_threshold,
                outputs.heatmap_sink,
                outputs.heatmap_weights,
                outputs.heatmap_channels,
                # On a GPU, a slide's heatmaps are blended where the model made them.
                heatmap_device=self.executor.backend.device if self.executor.is_cuda and not plan.is_array else None,
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
        cfg, cuda = self.config, self.executor.is_cuda
        where, why, decoder = choose_tile_decode(slide, tiles, cfg.decode, cfg.on_damaged_tile, self.backend_name, cuda)
        helpers = self.jpeg_helpers if where == "gpu" else None
        if helpers is not None and helpers.tile_share:
            why += f", {helpers.tile_share}/{SHARE_PERIOD} of them by {helpers.count} libjpeg-turbo processes meanwhile"
        log.info("%s: tiles decoded on the %s (%s)", slide.path, where.upper(), why)
        loader, read_seconds = make_slide_loader(
            slide,
            tiles,
            where,
            batch_size=self.batch_size,
            streams=self.executor.streams,
            reader_workers=self.reader_workers,
            device=str(self.executor.backend.device) if cuda else None,
            jpeg_helpers=helpers,
            jpeg_decoder=decoder,
        )
        with loader:
            on_device = stitcher.heatmap_device is not None
            for br in self.executor.run(loader, ordered=True, heatmaps_on_device=on_device):
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
        size = self.card.input.size_hw[0]
        chunk = self.batch_size
        pending: list[tuple[list[Tile], Any]] = []
        max_pending = self.executor.streams + 1
        for start in range(0, len(tiles), chunk):
            part = tiles[start : start + chunk]
            images = np.empty((len(part), size, size, 3), np.uint8)
            for i, t in enumerate(part):
                read_tile(slide, t, images[i])
            pending.append((part, self.service.submit(images)))
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
        card = self.card
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
                "backend": self.backend_name,
                "batch_size": self.batch_size,
                "streams": self.executor.streams,
                "reader_workers": self.reader_workers,
                "parameters": self.config.as_dict(),
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
        close_files = outputs.write(dets, self.writers)
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
            result.written = self._finisher.submit(finish)
        return result

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Stop the service and free the executor's streams and buffers."""
        if not self._closed:
            self._closed = True
            self.service.close()
            self._completer.shutdown(wait=True)
            self.executor.close()
            self._finisher.shutdown(wait=True)
            self.writers.close()
            self.merging.close()
            if self.jpeg_helpers is not None:
                self.jpeg_helpers.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


__all__ = ["DEFAULT_MODEL", "OUTPUT_FILES", "Pipeline", "Result"]
