"""A slide run's summary: its schema, written by one function, read back by one.

``summary.json`` is the last file of a slide's folder (its presence marks
the folder complete) and ``Result.summary`` is the same document. The
schema is :class:`Summary`; :func:`build_summary` makes it from a run's parts and
:func:`read_summary` reads it back for the batch (resume), the review
notebooks and the demo. Keys only ever get added, so older folders still read.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from .errors import WSIPipelineError

SUMMARY_FILE = "summary.json"


class ClassInfo(TypedDict):
    name: str
    color: str | list[int]


class HeatmapInfo(TypedDict):
    classes: list[str]
    stride: int
    scale_level0: float  # level-0 pixels per heatmap pixel


class TissueInfo(TypedDict):
    method: str
    fraction: float
    area_mm2: float | None
    source: dict | None  # an Otsu mask's thumbnail: level, decode, stored tiles decoded, seconds


class TilesInfo(TypedDict):
    total: int
    read: int
    skipped: int
    grid: list[int]  # [n_rows, n_cols]
    level: int
    downsample: float  # level-0 pixels per grid pixel


class SlideReaderInfo(TypedDict):
    """Which reader opened the slide and how the level the grid reads is stored."""

    name: str  # the reader backend: "tifffile", "openslide", "image", ...
    vendor: str | None  # the format as the reader names it ("aperio", "tiff", "ome-tiff", ...)
    level: int  # the level the grid reads
    # compression, photometric, samples_per_pixel, planar, extra_samples, jpeg_kind ("YCbCr 4:2:0",
    # "RGB", ...), jpeg_baseline; None where the reader gives no stored tiles
    storage: dict[str, Any] | None
    # where the reader's levels differ from OpenSlide's rule for the format, and why (a page set
    # apart as not a level, levels sorted); empty where they are OpenSlide's
    level_notes: list[str]


class TileDecodeInfo(TypedDict, total=False):
    """Where a run decoded its stored tiles, why, and with which decoder; the counts only where
    decoded on the GPU."""

    where: str  # "gpu" or "cpu"
    why: str
    decoder: str  # "nvjpeg", "nvimgcodec" (GPU), or "reader" (the slide reader's own, on the CPU)
    cpu_fallback_batches: int  # batches nvJPEG refused, decoded by libjpeg-turbo instead
    stored_tiles_decoded: int  # stored JPEG tiles read and decoded
    stored_tiles_reused: int  # stored tiles copied on the device from the previous batch instead
    stored_tiles_by_helpers: int  # of those decoded, the ones libjpeg-turbo processes decoded


class ModelInfo(TypedDict):
    name: str
    version: str
    sha256: str
    card: str
    precision: str


class Summary(TypedDict, total=False):
    """``summary.json``: what one slide's run found and how it ran."""

    slide: str  # absolute path
    slide_as_given: str
    dimensions_level0: list[int]  # [width, height]
    mpp: list[float] | None  # [x, y] micrometres per level-0 pixel
    status: str
    counts: dict[str, int]  # detections per class, in label order
    classes: list[ClassInfo]
    heatmap: HeatmapInfo | None
    detections_total: int
    detections_over_cap: int  # dropped: past the card's max_detections_per_tile (the lowest scores of their tile)
    tissue: TissueInfo
    tissue_warning: str | None
    warnings: list[str]  # every warning about the slide: recorded while it was opened and tiled, and the run's
    heatmap_scores: dict[str, Any] | None  # per heatmap class, see stitch.sinks.HeatmapStats
    tiles: TilesInfo
    seconds: dict[str, float]  # per stage, "total", and "write" once the files are written
    damaged_tiles: dict[str, Any] | None
    peak_host_memory_mb: float  # this process's
    peak_writer_memory_mb: float | None  # the writer processes' peaks during this slide's files, added up
    peak_gpu_memory_mb: float | None
    model: ModelInfo
    backend: str
    batch_size: int
    streams: int
    reader_workers: int
    parameters: dict[str, Any]  # the run settings (RunConfig.as_dict)
    versions: dict[str, str]
    slide_reader: SlideReaderInfo
    tile_decode: TileDecodeInfo
    box_merge: str  # where the boxes were merged: "process" (the pipeline's box-merging process) or "thread"
    heatmap_blended_on: str | None  # "host", or the device ("cuda:0") tile heatmaps were blended on; None: no heatmap
    run_key: dict[str, Any]  # a batch's resume key (see batch/resume.RunKey)
    files: list[str]  # the files the run wrote in its folder, summary.json last (docs/outputs.md)
    geojson_left_out: int  # boxes without area left out of the GeoJSON (with a GeoJSON format)
    not_written: dict[str, str]  # chosen files left out, and why (formats that cannot hold zero detections)


def package_versions() -> dict[str, str]:
    """Versions of the packages that decide a run's result (looked up once a process)."""
    return dict(_package_versions())


@functools.cache
def _package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in (
        "wsi-pipeline",
        "numpy",
        "tifffile",
        "imagecodecs",
        "opencv-python-headless",
        "openslide-python",
        "openslide-bin",
        "onnxruntime",
        "torch",
        "tensorrt",
    ):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def mm2_per_level0_px(mpp: Sequence[float] | None) -> float | None:
    """Square millimetres of one level-0 pixel of a slide of ``mpp`` (x, y µm per pixel); None if unknown."""
    return mpp[0] * mpp[1] / 1e6 if mpp else None


def slide_reader_info(slide: Any, level: int) -> SlideReaderInfo:
    """The ``slide_reader`` entry of a run that reads ``level`` of ``slide``."""
    storage = slide.stored_tile_format(level)
    return {
        "name": slide.backend,
        "vendor": slide.vendor,
        "level": int(level),
        "storage": storage,
        "level_notes": list(slide.level_notes),
    }


def tiles_info(grid: Any, n_read: int) -> TilesInfo:
    """The ``tiles`` entry of a run over ``grid`` (a :class:`~.tiling.TileGrid`) that read ``n_read`` tiles."""
    return {
        "total": len(grid),
        "read": n_read,
        "skipped": len(grid) - n_read,
        "grid": [grid.n_rows, grid.n_cols],
        "level": grid.level,
        "downsample": grid.downsample,
    }


def tissue_info(method: str, mask: Any, mpp: Sequence[float] | None) -> TissueInfo:
    """The ``tissue`` entry: the mask's ``method``, the fraction of the slide it covers, its area in
    mm², and ``source``: where an Otsu mask's thumbnail came from (None for other masks)."""
    mm2 = mm2_per_level0_px(mpp)
    return {
        "method": method,
        "fraction": float(mask.fraction),
        "area_mm2": float(mask.area_level0_px() * mm2) if mm2 else None,
        "source": getattr(mask, "source", None),
    }


def build_summary(
    *,
    slide: Any,
    dets: np.ndarray,
    card: Any,
    tiles: TilesInfo,
    tissue: TissueInfo,
    heatmap_scale_level0: float,
    heatmap_scores: dict[str, Any] | None,
    seconds: dict[str, float],
    run: dict[str, Any],
    extra: dict[str, Any],
) -> Summary:
    """The summary of a run over ``slide`` (a :class:`~.slide.Slide`) that found ``dets``.

    ``card``: the :class:`~.inference.card.ModelCard`. ``run``: how it ran
    (backend, batch_size, streams, reader_workers, parameters, versions,
    peak memory). ``extra``: further entries (tile_decode, tissue_warning,
    a batch's run_key).
    """
    names = card.class_names
    mpp = slide.mpp
    summary: Summary = {
        "slide": slide.absolute_path,
        "slide_as_given": str(slide.path),
        "dimensions_level0": list(slide.dimensions),
        "mpp": list(mpp) if mpp else None,
        "status": "done",
        "counts": {n: int((dets["label"] == i).sum()) for i, n in enumerate(names)},
        "classes": [{"name": c.name, "color": c.color} for c in card.classes],
        "heatmap": None
        if card.heatmap is None
        else {
            "classes": list(card.heatmap.classes),
            "stride": card.heatmap.stride,
            "scale_level0": heatmap_scale_level0,
        },
        "detections_total": int(len(dets)),
        "tissue": tissue,
        "heatmap_scores": heatmap_scores,
        "tiles": tiles,
        "seconds": seconds,
        "damaged_tiles": slide.damage_summary(),
        "model": {
            "name": card.name,
            "version": card.version,
            "sha256": card.sha256,
            "card": str(card.card_path),
            "precision": card.precision,
        },
    }
    summary.update(run)  # type: ignore[typeddict-item]
    summary.update(extra)  # type: ignore[typeddict-item]
    summary["warnings"] = summary_warnings(summary, extra.get("warnings", []))
    return summary


def summary_warnings(summary: Summary, recorded: Sequence[str]) -> list[str]:
    """The summary's ``warnings``: those ``recorded`` about the slide (``slide_warnings``), then the
    run's own: a tissue selection that looks wrong, damaged tiles, boxes left out of the GeoJSON."""
    out = list(recorded)
    if summary.get("tissue_warning"):
        out.append(f"{summary['slide_as_given']}: {summary['tissue_warning']}")
    damaged = (summary.get("damaged_tiles") or {}).get("count", 0)
    if damaged:
        out.append(f"{summary['slide_as_given']}: {damaged} damaged tiles (see damaged_tiles)")
    if summary.get("geojson_left_out"):
        out.append(
            f"{summary['slide_as_given']}: {summary['geojson_left_out']} detections without area left out "
            "of the GeoJSON"
        )
    return out


def read_summary(folder: str | os.PathLike[str]) -> Summary | None:
    """The summary in ``folder``, or None where it is missing, unreadable or not a JSON object."""
    try:
        with open(Path(folder) / SUMMARY_FILE, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None  # type: ignore[return-value]


def load_summary(folder: str | os.PathLike[str]) -> Summary:
    """The summary in the run folder ``folder``; :class:`~.errors.WSIPipelineError` naming what is wrong."""
    path = Path(folder) / SUMMARY_FILE
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError as exc:
        raise WSIPipelineError(f"{path}: no {SUMMARY_FILE}; is {folder} a finished run folder?") from exc
    except (OSError, ValueError) as exc:
        raise WSIPipelineError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise WSIPipelineError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return doc  # type: ignore[return-value]


__all__ = [
    "SUMMARY_FILE",
    "Summary",
    "build_summary",
    "load_summary",
    "mm2_per_level0_px",
    "package_versions",
    "read_summary",
    "slide_reader_info",
    "tiles_info",
    "tissue_info",
]
