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

import importlib.metadata
import logging
import math
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import RunConfig
from .errors import BackendUnavailableError, ConfigError, WSIPipelineError
from .inference.backend import resolve_backend
from .inference.card import ModelCard, load_card
from .inference.decoders import TileDetections
from .inference.executor import Executor
from .inference.service import TileService
from .inference.shipped import shipped_card
from .io.atomic import write_json
from .io.detections import DETECTION_DTYPE, detection_boxes, make_detections, parse_color
from .io.formats import DEFAULT_FORMATS, DETECTIONS, OVERLAY, chosen, detection_notes, output_files
from .io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter
from .io.writer_pool import DEFAULT_PROCESSES as DEFAULT_WRITER_PROCESSES
from .io.writer_pool import WriteJobs, WriterPool
from .slide import Slide, as_slide
from .stages import StageTimer, peak_gpu_memory_mb, peak_host_memory_mb
from .stitch import (
    BlendGeometry,
    HeatmapBlender,
    owned_by_tile,
    tile_weights,
    touches_inner_edge,
)
from .stitch.sinks import ArraySink, HeatmapStats, ReducedCopy, fan_out
from .stitch.streaming import StreamingMerger
from .tiling import TileGrid, TileLoader, tissue_mask
from .tiling.grid import Tile, read_tile

log = logging.getLogger("wsi_pipeline")

# Where it is looked up: see inference/shipped.py (WSI_PIPELINE_ENGINES, the checkout, the installed copy).
DEFAULT_MODEL = shipped_card()
CPU_BATCH_SIZE = 8
MAX_GPU_BATCH = 64
# Device memory one tile pixel needs in flight, an upper estimate for small
# detectors like the shipped ones: uint8 input (3 B), its normalised fp16 copy
# (6 B) and a generous allowance for activations. Only a quarter of the free
# memory is budgeted with it, so an underestimate still fits.
GPU_BYTES_PER_TILE_PIXEL = 96
# A GPU-decoded loader batch holds this many executor batches: the stored tiles that
# neighbouring patches share are decoded once per loader batch, so larger is cheaper.
GPU_DECODE_BATCHES = 4

# A slide folder of the default formats (summary.json lists the files of each run).
OUTPUT_FILES = tuple(output_files(DEFAULT_FORMATS))

Progress = Callable[[int], None]


@dataclass
class Result:
    """What one run found.

    Attributes:
        source: the slide's path or the array's name.
        detections: structured array (:data:`~.io.detections.DETECTION_DTYPE`:
            x0, y0, x1, y1, score, label) in level-0 pixels;
            ``pandas.DataFrame(result.detections)`` makes a table.
        heatmap: C x H x W float32 probabilities (an array), a
            :class:`~.io.ome_tiff.HeatmapFile` (lazy, when the run wrote its
            outputs to a folder, ``ome-tiff`` among them), or None for models
            without a heatmap.
            Both index alike (``heatmap[1]``, ``heatmap[1, y0:y1, x0:x1]``,
            ``shape``, ``dtype``, ``numpy.asarray(heatmap)``).
        heatmap_scale_level0: level-0 pixels per heatmap pixel.
        summary: the summary.json document (counts, areas, scores, timings).
        class_names: names of the detection labels; heatmap_classes: of the
            heatmap channels.
        out_dir: where the outputs were written, or None.
    """

    source: str
    detections: np.ndarray
    heatmap: np.ndarray | HeatmapFile | None
    heatmap_scale_level0: float
    summary: dict[str, Any]
    class_names: list[str]
    heatmap_classes: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    written: Future | None = field(default=None, repr=False)

    def wait_written(self) -> Result:
        """Wait until every output file is written (runs with ``wait_written=False``); raise what failed."""
        if self.written is not None:
            self.written.result()
        return self

    def to_dataframe(self):
        """The detections as a pandas DataFrame with a ``class`` column (needs pandas)."""
        import pandas as pd

        df = pd.DataFrame(self.detections)
        names = np.array(self.class_names + ["?"], dtype=object)
        df["class"] = names[np.clip(df["label"].to_numpy(), -1, len(self.class_names))]
        return df

    def boxes(self) -> np.ndarray:
        """N x 4 float32 (x0, y0, x1, y1) level-0 pixels."""
        return detection_boxes(self.detections)


def default_batch_size(card: ModelCard, backend: str) -> int:
    """Tiles per batch: from free device memory on CUDA (at most 64), 8 on the CPU.

    On CUDA a quarter of the free memory is budgeted for the tiles in flight
    of one stream, at :data:`GPU_BYTES_PER_TILE_PIXEL` per tile pixel.
    """
    if backend not in ("torch", "tensorrt"):
        return CPU_BATCH_SIZE
    import torch

    free, _ = torch.cuda.mem_get_info()
    h, w = card.input.size_hw
    n = int(free * 0.25 // (h * w * GPU_BYTES_PER_TILE_PIXEL))
    return max(1, min(MAX_GPU_BATCH, n))


def default_reader_workers(cores: int) -> int:
    """Tile reader threads for ``cores`` CPU cores: all but two (left to the executor and the
    consumer), between 2 and 4. The readers share the GIL with the executor's and the stitcher's
    threads: on 16 cores, 4 threads fed the GPU fastest (BENCHMARKS.md: 2 / 4 / 8 / 12 threads
    gave 818 / 1,007 / 985 / 880 tiles/s)."""
    return max(2, min(4, cores - 2))


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide a run's result."""
    out = {"python": platform.python_version()}
    for name in ("wsi-pipeline", "numpy", "tifffile", "imagecodecs", "opencv-python-headless", "openslide-python",
                 "openslide-bin", "onnxruntime", "torch", "tensorrt"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


class Pipeline:
    """A detector loaded once, with its executor, serving many runs.

    Args:
        card: a model card or its path (default: the shipped pathology model).
        backend: ``auto`` (:func:`resolve_backend`), ``ort``, ``torch`` or
            ``tensorrt``.
        config: the run settings (:class:`~.config.RunConfig`); keyword
            ``overrides`` replace single settings.
        writer_processes: worker processes that write a run's GeoJSON, CSV
            and overlay in parallel (:mod:`.io.writer_pool`; 0: in the
            calling thread).

    :meth:`run` is thread-safe: calls on arrays from several threads share
    batches through a :class:`TileService` (dynamic batching, waiting at most
    ``max_wait_s`` for a batch to fill).
    """

    def __init__(self, card: ModelCard | str | os.PathLike[str] | None = None, backend: str = "auto",
                 config: RunConfig | None = None, max_wait_s: float = 0.005,
                 writer_processes: int = DEFAULT_WRITER_PROCESSES, **overrides: Any):
        config = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
        if card is None:
            card = config.model or DEFAULT_MODEL
        self.card = card if isinstance(card, ModelCard) else load_card(card)
        self.config = config.replace(model=str(self.card.card_path or config.model or ""))
        self._check_card_config()
        requested = backend if backend != "auto" else config.backend
        self.executor, self.backend_name = self._make_executor(requested)
        self.batch_size = config.batch_size or min(default_batch_size(self.card, self.backend_name),
                                                   self.executor.max_batch)
        self.reader_workers = config.workers or default_reader_workers(os.cpu_count() or 2)
        self.service = TileService(self.executor.infer_tiles, max_batch=self.batch_size,
                                   workers=self.executor.streams, max_wait_s=max_wait_s)
        self.writers = WriterPool(writer_processes)
        # Finishes one run's output folder at a time, while the next run goes on.
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="finish-outputs")
        self._closed = False

    @classmethod
    def from_card(cls, path: str | os.PathLike[str] | None = None, backend: str = "auto",
                  config: RunConfig | None = None, **overrides: Any) -> Pipeline:
        """Load the model card at ``path`` (default: the shipped pathology model) once."""
        return cls(path, backend=backend, config=config, **overrides)

    # -- set-up ----------------------------------------------------------------
    def _check_card_config(self) -> None:
        h, w = self.card.input.size_hw
        if h != w:
            raise ConfigError(f"{self.card.card_path}: the tile grid needs a square model input, found {h} x {w}")
        cfg = self.config
        if cfg.tile is not None and cfg.tile != h:
            raise ConfigError(f"tile: the model {self.card.name} takes {h} px tiles, found tile = {cfg.tile}")
        if cfg.overlap >= h:
            raise ConfigError(f"overlap: expected less than the tile size {h}, found {cfg.overlap}")
        if self.card.heatmap is not None:
            s = self.card.heatmap.stride
            if (h - cfg.overlap) % s:
                raise ConfigError(
                    f"overlap: tile size minus overlap ({h} - {cfg.overlap}) must be a multiple of the "
                    f"model's heatmap stride {s}")

    def _make_executor(self, requested: str) -> tuple[Executor, str]:
        name = resolve_backend(requested)
        cfg = self.config
        order = ("tensorrt", "torch", "ort")  # auto: fall back down this list
        candidates = order[order.index(name):] if requested == "auto" else (name,)
        last: Exception | None = None
        for cand in candidates:
            opts: dict[str, Any] = {}
            if cand in ("torch", "tensorrt") and cfg.batch_size:
                opts["max_batch"] = max(cfg.batch_size, 1)
            try:
                return Executor.from_card(self.card, cand, streams=cfg.streams, **opts), cand
            except BackendUnavailableError as exc:
                last = exc
                if requested != "auto":
                    raise
                log.warning("backend %s unavailable (%s); trying the next", cand, exc)
        raise BackendUnavailableError(f"no backend could run {self.card.name}: {last}")

    # -- running ---------------------------------------------------------------
    def run(self, source: str | os.PathLike[str] | Slide | np.ndarray, out_dir: str | os.PathLike[str] | None = None,
            progress: bool | Progress = False, keep_heatmap: bool | None = None,
            extra_summary: dict[str, Any] | None = None, wait_written: bool = True) -> Result:
        """Detect and map over ``source``: a slide path, an open :class:`Slide` or an RGB array.

        ``out_dir``: write the files of ``config.formats`` there (by default
        detections.geojson, detections.csv, heatmap.ome.tif and overlay.png;
        :mod:`.io.formats`), each atomically, then summary.json.
        ``progress``: True for a tqdm bar, or a callable given the number of
        tiles each step finished. ``keep_heatmap``: hold the blended heatmap
        in memory as ``result.heatmap`` (default: when nothing is written);
        with ``out_dir``, ``result.heatmap`` otherwise reads the OME-TIFF
        lazily. ``extra_summary``: entries added to the summary (e.g. the
        batch's run key). ``wait_written=False`` returns once the slide is
        stitched, while its files are still being written (the next slide
        can start meanwhile); :meth:`Result.wait_written` waits for them and
        raises what failed.
        """
        if self._closed:
            raise WSIPipelineError("pipeline is closed")
        timer = StageTimer()
        t_start = time.perf_counter()
        owns = not isinstance(source, Slide)
        gpu = self.backend_name in ("torch", "tensorrt")
        if gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        with timer("open"):
            slide = as_slide(source)
        slide.on_damaged_tile = self.config.on_damaged_tile
        try:
            return self._run_slide(slide, isinstance(source, np.ndarray), out_dir, progress, keep_heatmap,
                                   timer, t_start, extra_summary or {}, wait_written)
        finally:
            if owns:
                slide.close()

    def _grid(self, slide: Slide) -> TileGrid:
        cfg, card = self.config, self.card
        tile = card.input.size_hw[0]
        if cfg.level is not None:
            return TileGrid(slide, tile, cfg.overlap, level=cfg.level)
        mpp = cfg.mpp if cfg.mpp is not None else card.mpp
        if mpp is not None and slide.mpp is None:
            if cfg.mpp is not None:
                raise ConfigError(f"{slide.path}: mpp = {cfg.mpp} was asked for, but the slide's resolution "
                                  "is unknown; give a level instead")
            warnings.warn(f"{slide.path}: resolution unknown; the model expects {mpp} um/px, reading level 0",
                          stacklevel=3)
            mpp = None
        if mpp is not None and mpp < slide.mpp[0] * (1 - 1e-6):
            warnings.warn(f"{slide.path}: level 0 is {slide.mpp[0]:.4g} um/px, coarser than the model's "
                          f"{mpp} um/px; reading level 0 as it is", stacklevel=3)
            mpp = None
        return TileGrid(slide, tile, cfg.overlap, mpp=mpp) if mpp is not None else TileGrid(slide, tile, cfg.overlap)

    def _run_slide(self, slide: Slide, is_array: bool, out_dir: str | os.PathLike[str] | None,
                   progress: bool | Progress, keep_heatmap: bool | None, timer: StageTimer,
                   t_start: float, extra_summary: dict[str, Any], wait_written: bool = True) -> Result:
        cfg, card = self.config, self.card
        out = Path(out_dir) if out_dir is not None else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.writers.start()  # the writer processes start while the slide runs
        if keep_heatmap is None:
            keep_heatmap = out is None
        with timer("tissue_mask"):
            grid = self._grid(slide)
            method = cfg.tissue if cfg.tissue != "auto" else ("otsu" if card.mpp is not None else "all")
            mask = tissue_mask(slide, method, mask_path=cfg.mask)
            fractions = mask.tile_fractions(grid)
            tiles = grid.select(fractions, cfg.min_tissue)
        log.info("%s: %s, %d of %d tiles selected", slide.path, grid, len(tiles), len(grid))
        tissue_warning = mask.selection_warning(len(tiles), len(grid), cfg.min_tissue)
        if tissue_warning:
            log.warning("%s: %s", slide.path, tissue_warning)
        extra_summary = {"tissue_warning": tissue_warning, **extra_summary}

        stitcher = _Stitcher(grid, card, cfg, mask, method, slide, out, keep_heatmap)
        run_info: dict[str, Any] = {"tile_decode": {"where": "cpu", "why": "an array in memory"}}
        bar = None
        if progress is True:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tiles), desc=Path(str(slide.path)).name, unit="tile", leave=False)
            report: Progress | None = bar.update
        else:
            report = progress or None
        try:
            with timer("read_and_infer"):
                if is_array:
                    self._infer_array(slide, tiles, stitcher, report)
                else:
                    self._infer_slide(slide, tiles, stitcher, report, timer, run_info)
            with timer("stitch"):
                dets = stitcher.finish()
            with timer("write"):
                t_write = time.perf_counter()
                heatmap = stitcher.close_heatmap() if out is None else None
                result = self._result(slide, grid, mask, tiles, stitcher, dets, heatmap, timer, t_start, t_write,
                                      out, {**run_info, **extra_summary}, wait_written)
        except BaseException:
            stitcher.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        return result

    def _tile_decode(self, slide: Slide, tiles: list[Tile]) -> tuple[str, str]:
        """Where this run decodes its stored tiles (``"gpu"`` or ``"cpu"``) and why."""
        want = self.config.decode
        if want == "cpu":
            return "cpu", "decode = cpu"
        if self.config.on_damaged_tile == "fail":
            # nvJPEG reports no corrupt-data warnings: only the CPU decoder can fail a damaged tile.
            reason = "on_damaged_tile = fail needs the CPU decoder's reports of corrupt tiles"
            if want == "gpu":
                raise ConfigError(f"{slide.path}: decode = gpu, but {reason}")
            return "cpu", reason
        if not self.executor.is_cuda:
            reason = f"the {self.backend_name} backend runs on the CPU"
        else:
            from .inference.gpu_decode import gpu_decode_refusal

            reason = gpu_decode_refusal(slide, tiles)
            if reason is None:
                return "gpu", "JPEG tiles decoded by nvJPEG"
        if want == "gpu":
            raise ConfigError(f"{slide.path}: decode = gpu, but {reason}")
        return "cpu", reason

    def _infer_slide(self, slide: Slide, tiles: list[Tile], stitcher: _Stitcher, report: Progress | None,
                     timer: StageTimer, run_info: dict[str, Any]) -> None:
        where, why = self._tile_decode(slide, tiles)
        log.info("%s: tiles decoded on the %s (%s)", slide.path, where.upper(), why)
        read_s = [0.0]
        if where == "gpu":
            from .inference.gpu_decode import GpuTileLoader

            loader: Any = GpuTileLoader(slide, tiles, batch_size=self.batch_size * GPU_DECODE_BATCHES,
                                        device=str(self.executor.backend.device),
                                        prefetch=self.executor.streams + 1, decode_threads=2)
        else:
            lock = threading.Lock()

            def timed_read(s: Slide, t: Tile, buf: np.ndarray) -> None:
                t0 = time.perf_counter()
                read_tile(s, t, buf)
                with lock:
                    read_s[0] += time.perf_counter() - t0

            loader = TileLoader(slide, tiles, batch_size=self.batch_size, workers=self.reader_workers,
                                prefetch=max(2, self.executor.streams), auto_release=False,
                                max_held=self.executor.streams + 1, read=timed_read)
        with loader:
            for br in self.executor.run(loader, ordered=True):
                stitcher.add_batch(br.tiles, br.detections)
                if report is not None:
                    report(len(br.tiles))
        run_info["tile_decode"] = {"where": where, "why": why}
        if where == "gpu":
            run_info["tile_decode"]["cpu_fallback_batches"] = loader.decoder.cpu_fallback_batches
        timer.seconds["tile_reads_worker_s"] += read_s[0]
        clear = getattr(slide, "clear_cache", None)
        if clear is not None:  # the decoded tiles are not needed for what follows
            clear()

    def _infer_array(self, slide: Slide, tiles: list[Tile], stitcher: _Stitcher, report: Progress | None) -> None:
        size = self.card.input.size_hw[0]
        chunk = self.batch_size
        pending: list[tuple[list[Tile], Any]] = []
        max_pending = self.executor.streams + 1
        for start in range(0, len(tiles), chunk):
            part = tiles[start:start + chunk]
            images = np.empty((len(part), size, size, 3), np.uint8)
            for i, t in enumerate(part):
                read_tile(slide, t, images[i])
            pending.append((part, self.service.submit(images)))
            while len(pending) >= max_pending:
                self._drain_one(pending, stitcher, report)
        while pending:
            self._drain_one(pending, stitcher, report)

    @staticmethod
    def _drain_one(pending: list, stitcher: _Stitcher, report: Progress | None) -> None:
        part, fut = pending.pop(0)
        stitcher.add_batch(part, fut.result())
        if report is not None:
            report(len(part))

    def _result(self, slide: Slide, grid: TileGrid, mask, tiles: list[Tile], stitcher: _Stitcher,
                dets: np.ndarray, heatmap: Any, timer: StageTimer, t_start: float, t_write: float,
                out: Path | None, extra_summary: dict[str, Any], wait_written: bool = True) -> Result:
        cfg, card = self.config, self.card
        classes = [{"name": c.name, "color": c.color} for c in card.classes]
        names = card.class_names
        counts = {n: int((dets["label"] == i).sum()) for i, n in enumerate(names)}
        mpp = slide.mpp
        mm2_per_px0 = (mpp[0] * mpp[1] / 1e6) if mpp else None
        summary: dict[str, Any] = {
            "slide": slide.absolute_path,
            "slide_as_given": str(slide.path),
            "dimensions_level0": list(slide.dimensions),
            "mpp": list(mpp) if mpp else None,
            "status": "done",
            "counts": counts,
            "classes": classes,
            "heatmap": None if card.heatmap is None else {
                "classes": list(card.heatmap.classes), "stride": card.heatmap.stride,
                "scale_level0": stitcher.heatmap_scale_level0},
            "detections_total": int(len(dets)),
            "tissue": {
                "method": stitcher.tissue_method,
                "fraction": float(mask.fraction),
                "area_mm2": float(mask.area_level0_px() * mm2_per_px0) if mm2_per_px0 else None,
            },
            "heatmap_scores": stitcher.heatmap_scores(mm2_per_px0),
            "tiles": {"total": len(grid), "read": len(tiles), "skipped": len(grid) - len(tiles),
                      "grid": [grid.n_rows, grid.n_cols], "level": grid.level, "downsample": grid.downsample},
            "seconds": {**timer.as_dict(), "total": round(time.perf_counter() - t_start, 4)},
            "damaged_tiles": slide.damage_summary(),
            "peak_host_memory_mb": round(peak_host_memory_mb(), 1),
            "peak_gpu_memory_mb": _round(peak_gpu_memory_mb()),
            "model": {"name": card.name, "version": card.version, "sha256": card.sha256,
                      "card": str(card.card_path), "precision": card.precision},
            "backend": self.backend_name,
            "batch_size": self.batch_size,
            "streams": self.executor.streams,
            "reader_workers": self.reader_workers,
            "parameters": cfg.as_dict(),
            "versions": package_versions(),
            **extra_summary,
        }
        result = Result(str(slide.path), dets, heatmap, stitcher.heatmap_scale_level0, summary, names,
                        list(card.heatmap.classes) if card.heatmap else [], out)
        if out is None:
            return result
        # Detection files and overlay are written by worker processes while a thread finishes the
        # heatmap file; summary.json, the mark of a complete folder, comes last.
        summary["files"] = output_files(cfg.formats, heatmap=card.heatmap is not None)
        summary.update(detection_notes(cfg.formats, dets))
        if summary.get("geojson_left_out"):
            log.warning("%s: %d detections have no area (zero width or height) and are left out of the GeoJSON",
                        slide.path, summary["geojson_left_out"])
        # The overlay reads the thumbnail: that may fail, before any file is begun.
        overlay = stitcher.overlay_inputs(dets) if chosen(cfg.formats, OVERLAY) else None
        summary["damaged_tiles"] = slide.damage_summary()  # the overlay's thumbnail reads tiles too
        jobs = WriteJobs()
        for fmt in chosen(cfg.formats):
            if fmt.kind in (DETECTIONS, OVERLAY):  # heatmap files are the stitcher's sinks
                args = (dets, classes) if fmt.kind == DETECTIONS else overlay
                self.writers.submit(jobs, fmt.filename, fmt.write_function(), out / fmt.filename, *args)

        def finish() -> None:
            try:
                heatmap_file = stitcher.close_heatmap()
            finally:
                jobs.wait()
            summary["seconds"]["write"] = round(time.perf_counter() - t_write, 4)
            summary["seconds"]["total"] = round(time.perf_counter() - t_start, 4)
            write_json(out / "summary.json", summary)
            result.heatmap = heatmap_file

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
            self.executor.close()
            self._finisher.shutdown(wait=True)
            self.writers.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


class _Stitcher:
    """Collects one run's tile results in grid order: boxes to level 0, heatmaps to the blender."""

    def __init__(self, grid: TileGrid, card: ModelCard, cfg: RunConfig, mask, tissue_method: str, slide: Slide,
                 out: Path | None, keep_heatmap: bool):
        self.grid, self.card, self.cfg, self.slide = grid, card, cfg, slide
        self.tissue_method = tissue_method
        self._next = 0  # next grid index expected
        self._row = -1  # grid row of the last tile added
        self.merger = StreamingMerger(cfg.merge, cfg.nms_iou, cfg.nms_metric) if cfg.merge != "ownership" else None
        self._boxes: list[np.ndarray] = []
        self._scores: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self.blender: HeatmapBlender | None = None
        self.writer: OmeTiffHeatmapWriter | None = None
        self.array_sink: ArraySink | None = None
        self.reduced: ReducedCopy | None = None
        self.stats: HeatmapStats | None = None
        self.heatmap_scale_level0 = grid.downsample
        thumb_side = cfg.overlay_size
        w0, h0 = slide.dimensions
        self.thumb_downsample = max(w0 / thumb_side, h0 / thumb_side, 1.0)
        hm = card.heatmap
        if hm is None:
            return
        stride = hm.stride
        geom = BlendGeometry(n_rows=grid.n_rows, n_cols=grid.n_cols, tile_size_out=grid.tile_size // stride,
                             step_out=grid.step // stride, out_height=math.ceil(grid.height_out / stride),
                             out_width=math.ceil(grid.width_out / stride))
        self.heatmap_scale_level0 = grid.downsample * stride
        c = len(hm.classes)
        sinks = []
        if out is not None and "ome-tiff" in cfg.formats:
            phys = None
            if slide.mpp:
                phys = (slide.mpp[0] * self.heatmap_scale_level0, slide.mpp[1] * self.heatmap_scale_level0)
            self.writer = OmeTiffHeatmapWriter(out / "heatmap.ome.tif", geom.out_width, geom.out_height, c,
                                               channel_names=list(hm.classes), physical_size_um=phys)
            sinks.append(self.writer)
        if keep_heatmap:
            self.array_sink = ArraySink(c, geom.out_height, geom.out_width)
            sinks.append(self.array_sink)
        self.stats = HeatmapStats(c, geom.out_width, self.heatmap_scale_level0, mask)
        sinks.append(self.stats)
        factor = max(1, int(self.thumb_downsample // self.heatmap_scale_level0))
        self.reduced = ReducedCopy(c, geom.out_height, geom.out_width, factor)
        sinks.append(self.reduced)
        weights = tile_weights(geom.tile_size_out, cfg.blend, cfg.sigma_scale,
                               overlap_px=(grid.overlap // stride) or 1)
        self.blender = HeatmapBlender(geom, c, weights, fan_out(*sinks), window_rows=3)

    def _skip_to(self, index: int) -> None:
        while self._next < index:
            if self.blender is not None:
                t = self.grid[self._next]
                self.blender.skip(t.row, t.col)
            self._next += 1

    def add_batch(self, tiles: list[Tile], dets: list[TileDetections]) -> None:
        """A batch's detections (tile pixels), tiles in grid order: heatmaps per tile, boxes per grid row."""
        start = 0
        while start < len(tiles):
            stop = start + 1
            while stop < len(tiles) and tiles[stop].row == tiles[start].row:
                stop += 1
            self._add_row_run(tiles[start:stop], dets[start:stop])
            start = stop

    def _add_row_run(self, tiles: list[Tile], dets: list[TileDetections]) -> None:
        """Tiles of one grid row, in order: blend their heatmaps, then map and merge their boxes at once."""
        for tile, det in zip(tiles, dets, strict=True):
            if tile.index < self._next:
                raise WSIPipelineError(f"tile {tile.index} arrived out of grid order (expected >= {self._next})")
            self._skip_to(tile.index)
            if self.blender is not None:
                if det.heatmap is None:
                    raise WSIPipelineError(f"{self.card.card_path}: the card names a heatmap, the model gave none")
                self.blender.add(tile.row, tile.col, det.heatmap)
            self._next = tile.index + 1
        row = tiles[0].row
        if self.merger is not None and row != self._row:
            # No box of this row or below reaches above its top edge: finish what lies above.
            self.merger.flush(float(tiles[0].y0_level0))
        self._row = row
        counts = np.array([len(d.boxes) for d in dets], np.int64)
        if not counts.any():
            return
        boxes = np.concatenate([np.asarray(d.boxes, np.float32).reshape(-1, 4) for d in dets])
        scores = np.concatenate([np.asarray(d.scores, np.float32).reshape(-1) for d in dets])
        labels = np.concatenate([np.asarray(d.labels).reshape(-1) for d in dets])
        owner = np.repeat(np.arange(len(tiles)), counts)  # each box's tile in ``tiles``
        cols = np.array([t.col for t in tiles])[owner]
        grid, cfg = self.grid, self.cfg
        keep = np.ones(len(boxes), bool)
        if cfg.score_threshold is not None:
            keep &= scores >= cfg.score_threshold
        if cfg.drop_edge_boxes and cfg.merge != "ownership":
            keep &= ~touches_inner_edge(boxes, np.full(len(boxes), row), cols, grid.n_rows, grid.n_cols,
                                        grid.tile_size, grid.overlap)
        if cfg.merge == "ownership":
            for i, tile in enumerate(tiles):
                part = owner == i
                keep[part] &= owned_by_tile(boxes[part], tile.row, tile.col, grid.n_rows, grid.n_cols,
                                            grid.tile_size, grid.overlap)
        if not keep.any():
            return
        owner = owner[keep]
        b = boxes[keep] * np.array([t.downsample for t in tiles], np.float32)[owner, None]
        b[:, [0, 2]] += np.array([t.x0_level0 for t in tiles], np.float32)[owner, None]
        b[:, [1, 3]] += np.array([t.y0_level0 for t in tiles], np.float32)[owner, None]
        # Edge tiles are padded past the slide; boxes centred there are the padding's edge, not objects.
        w0, h0 = self.slide.dimensions
        cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
        inside = (cx >= 0) & (cx < w0) & (cy >= 0) & (cy < h0)
        b = b[inside]
        b[:, [0, 2]] = b[:, [0, 2]].clip(0, w0)
        b[:, [1, 3]] = b[:, [1, 3]].clip(0, h0)
        s, lab = scores[keep][inside], labels[keep][inside]
        if self.merger is not None:
            self.merger.add(b, s, lab)
        else:
            self._boxes.append(b)
            self._scores.append(s)
            self._labels.append(lab)

    def finish(self) -> np.ndarray:
        """Skip the tiles after the last one read; merge the boxes; return the detections."""
        self._skip_to(len(self.grid))
        if self.blender is not None:
            self.blender.close()
        if self.merger is not None:
            boxes, scores, labels = self.merger.finish()
        elif self._boxes:
            boxes, scores, labels = (np.concatenate(self._boxes), np.concatenate(self._scores),
                                     np.concatenate(self._labels))
        else:
            return np.zeros(0, DETECTION_DTYPE)
        order = np.lexsort((boxes[:, 0], boxes[:, 1]))  # reading order: top to bottom, left to right
        return make_detections(boxes[order], scores[order], labels[order])

    def close_heatmap(self) -> np.ndarray | HeatmapFile | None:
        if self.reduced is not None:
            self.reduced.close()
        path = self.writer.close() if self.writer is not None else None
        if self.array_sink is not None:
            return self.array_sink.array
        return HeatmapFile(path) if path is not None else None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    def heatmap_scores(self, mm2_per_px0: float | None) -> dict[str, Any] | None:
        if self.stats is None:
            return None
        mm2 = mm2_per_px0 * self.heatmap_scale_level0 ** 2 if mm2_per_px0 else None
        return self.stats.summary(list(self.card.heatmap.classes), mm2)

    def overlay_inputs(self, dets: np.ndarray) -> tuple:
        """:func:`~.io.overlay.write_overlay`'s arguments after the path: thumbnail, heatmap, boxes, colours."""
        thumb = self.slide.get_thumbnail(self.cfg.overlay_size)
        thumb_ds = self.slide.dimensions[0] / thumb.shape[1]
        heat = self.reduced.array if self.reduced is not None else None
        if heat is not None:
            # A "tissue"/"background" channel covers everything; show the classes of interest.
            shown = [i for i, n in enumerate(self.card.heatmap.classes) if n.lower() not in ("tissue", "background")]
            heat = heat[shown] if shown else heat
        scale = self.heatmap_scale_level0 * (self.reduced.factor if self.reduced is not None else 1)
        boxes = detection_boxes(dets) if len(dets) else None
        colors = [parse_color(c.color) for c in self.card.classes]
        return thumb, thumb_ds, heat, scale, boxes, dets["label"] if len(dets) else None, colors


__all__ = ["DEFAULT_MODEL", "OUTPUT_FILES", "Pipeline", "Result", "default_batch_size", "package_versions",
           "resolve_backend"]
