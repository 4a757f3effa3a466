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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .config import RunConfig
from .errors import ClosedError, ConfigError
from .geometry import TilingGeometry, check_tiling
from .inference.backend import cuda_may_be_present
from .inference.card import load_card
from .inference.card_spec import ModelCard
from .inference.choice import default_batch_size, default_reader_workers, make_executor
from .inference.service import TileService
from .inference.shipped import shipped_card
from .io.writer_pool import DEFAULT_PROCESSES as DEFAULT_WRITER_PROCESSES
from .io.writer_pool import WriterPool, check_not_importing_main
from .result import PendingResult, Result
from .slide import Slide
from .slide_plan import SlidePlan, make_plan, plan_geometry
from .slide_run import Progress, SlideRunner
from .stages import StageTimer
from .stitch.merge_runner import MergeProcess
from .tiling.jpeg_processes import JpegHelpers, default_helpers
from .tiling.slide_loader import import_gpu_loader_ahead

log = logging.getLogger("wsi_pipeline")
# Backends that may decode tiles on the GPU.
GPU_BACKENDS = ("torch", "tensorrt")

# Where it is looked up: see inference/shipped.py (WSI_PIPELINE_ENGINES, the checkout, the installed copy).
DEFAULT_MODEL = shipped_card()


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
        # time, in order, here; the runner waits for their files.
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="complete-run")
        self._runner = SlideRunner(self)
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
            complete = self._runner.run_slide(
                plan, out_dir, progress, keep_heatmap, timer, t_start, extra_summary or {}
            )
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

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Stop the service and free the executor's streams and buffers."""
        if not self._closed:
            self._closed = True
            self.service.close()
            self._completer.shutdown(wait=True)
            self.executor.close()
            self._runner.close()
            self.writers.close()
            self.merging.close()
            if self.jpeg_helpers is not None:
                self.jpeg_helpers.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DEFAULT_MODEL", "Pipeline"]
