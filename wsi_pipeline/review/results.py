"""A finished run, loaded for review: detections, classes, summary, slide and heatmap.

:func:`load_run` reads a run folder (the files :meth:`Pipeline.run` writes with
``out_dir``); :meth:`ReviewRun.from_result` wraps an in-memory
:class:`~wsi_pipeline.pipeline.Result`. Every coordinate is in level-0 pixels
of the slide (origin top-left, x to the right, y down).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import WSIPipelineError
from ..inference.card_fields import read_card_json
from ..io.detections import DETECTION_DTYPE, load_geojson, parse_color, read_geojson
from ..io.ome_tiff import HeatmapFile
from ..slide import Slide, as_slide, open_slide
from ..summary import SUMMARY_FILE, load_summary

RGB = tuple[int, int, int]

# Colours for classes a run names without one (matplotlib's tab10, as 0-255 RGB).
PALETTE: tuple[RGB, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
# Where a run folder may hold its detections as GeoJSON, in the order looked for.
GEOJSON_FILES = ("detections.geojson", "detections.geojson.zip", "detections.geojson.gz")
# Every detection file a run may have written (docs/outputs.md), in the order looked for: Parquet
# first (every box, read fastest; a GeoParquet too), then GeoJSON (class colours), CSV, the
# GeoParquet name of earlier versions, the DSA annotation. DICOM is not read here.
DETECTION_FILES = (
    "detections.parquet",
    *GEOJSON_FILES,
    "detections.csv",
    "detections.geoparquet",
    "detections.dsa.json",
)


class NoDetectionFileWarning(UserWarning):
    """A run folder holds none of :data:`DETECTION_FILES`: the review shows no detections."""


def _read_table(path: Path) -> tuple[np.ndarray, dict[int, str]]:
    """Detections and ``{label: class name}`` of a run's Parquet or CSV file."""
    if path.suffix in (".parquet", ".geoparquet"):
        if importlib.util.find_spec("pyarrow") is None:
            raise WSIPipelineError(f"{path}: reading Parquet needs pyarrow: pip install 'wsi-pipeline[parquet]'")
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[*DETECTION_DTYPE.names, "class"])
        dets = np.empty(table.num_rows, DETECTION_DTYPE)
        for name in DETECTION_DTYPE.names:
            dets[name] = table.column(name).to_numpy()
        found = dict(zip(table.column("label").to_pylist(), table.column("class").to_pylist(), strict=True))
        return dets, found
    try:
        with warnings.catch_warnings():  # a header alone (no detections) is an empty table, not a warning
            warnings.filterwarnings("ignore", "loadtxt: input contained no data", UserWarning)
            rows = np.loadtxt(path, delimiter=",", skiprows=1, usecols=range(6), quotechar='"', ndmin=2)
    except (ValueError, OSError) as exc:
        raise WSIPipelineError(f"{path}: not a readable detections CSV file: {exc}") from exc
    dets = np.empty(len(rows), DETECTION_DTYPE)
    for i, name in enumerate(DETECTION_DTYPE.names):
        dets[name] = rows[:, i]
    return dets, {}


def read_run_detections(run_dir: Path, names: list[str]) -> tuple[np.ndarray, Path | None]:
    """The detections of the first of :data:`DETECTION_FILES` the folder holds, and that file
    (None, with an empty array and a :class:`NoDetectionFileWarning`, when it holds none).

    Labels are the run's (``names``, the summary's classes, in label order); a class a file
    names beyond them is appended to ``names``.
    """
    path = next((run_dir / n for n in DETECTION_FILES if (run_dir / n).is_file()), None)
    if path is None:
        message = (
            f"{run_dir}: no detection file ({', '.join(DETECTION_FILES)}): the run's formats wrote none "
            f"that the review reads, so it shows no detections; rerun with --formats geojson, csv or parquet"
        )
        warnings.warn(message, NoDetectionFileWarning, stacklevel=3)
        return np.zeros(0, DETECTION_DTYPE), None
    if path.name in GEOJSON_FILES:
        dets = read_geojson(path, classes=[{"name": n} for n in names])
        if len(dets) and int(dets["label"].max()) >= len(names):  # names the summary did not list
            for feat in load_geojson(path).get("features", []):
                n = ((feat.get("properties") or {}).get("classification") or {}).get("name", "object")
                if n not in names:
                    names.append(n)
        return dets, path
    if path.name.endswith(".dsa.json"):
        from ..io.dsa import read_dsa

        dets = read_dsa(path, [{"name": n} for n in names])
        found = {}
    else:
        dets, found = _read_table(path)
    for label in sorted(set(np.unique(dets["label"]).tolist()) - set(range(len(names)))):
        names.extend(f"class_{k}" for k in range(len(names), label))
        names.append(found.get(label, f"class_{label}"))
    return dets, path


def _card_classes(card_path: str | None) -> tuple[list[str], list[RGB], int | None] | None:
    """Class names, colours and heatmap stride from a model card file, or None when unreadable."""
    if not card_path or not os.path.isfile(card_path):
        return None
    try:
        card = read_card_json(Path(card_path))  # the document only: the model file may be gone since
        names = [c["name"] for c in card["classes"]]
        colors = [parse_color(c.get("color", PALETTE[i % len(PALETTE)])) for i, c in enumerate(card["classes"])]
    except (WSIPipelineError, ValueError, KeyError, TypeError, AttributeError):
        return None
    stride = (card.get("heatmap") or {}).get("stride")
    return names, colors, int(stride) if stride else None


def _geojson_colors(path: Path, names: list[str]) -> dict[str, RGB]:
    """The first colour the GeoJSON file gives each class name."""
    try:
        doc = load_geojson(path)
    except WSIPipelineError:
        return {}
    found: dict[str, RGB] = {}
    for feat in doc.get("features", []):
        c = (feat.get("properties") or {}).get("classification") or {}
        if c.get("name") in names and c["name"] not in found and "color" in c:
            found[c["name"]] = parse_color(c["color"])
            if len(found) == len(names):
                break
    return found


@dataclass
class ReviewRun:
    """One run's results, ready for the figures and filters of :mod:`wsi_pipeline.review`.

    Attributes:
        detections: structured array (x0, y0, x1, y1 float32 level-0 pixels;
            score float32; label int32 indexing ``class_names``).
        class_names, class_colors: per label, the name and an (r, g, b) 0-255 colour.
        dimensions: level-0 (width, height) of the slide or image.
        mpp: level-0 (x, y) micrometres per pixel, or None when unknown.
        summary: the run's summary.json document.
        slide_path: the slide file, or None (an in-memory array).
        heatmap: C x H x W float32 array, a lazy :class:`HeatmapFile`, or None.
        heatmap_classes: names of the heatmap channels.
        heatmap_scale_level0: level-0 pixels per heatmap pixel (level 0 of the heatmap).
        run_dir: the run folder, or None.
        slide: an open :class:`Slide`; opened from ``slide_path`` on first use.
    """

    detections: np.ndarray
    class_names: list[str]
    class_colors: list[RGB]
    dimensions: tuple[int, int]
    mpp: tuple[float, float] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    slide_path: Path | None = None
    heatmap: np.ndarray | HeatmapFile | None = None
    heatmap_classes: list[str] = field(default_factory=list)
    heatmap_scale_level0: float = 1.0
    run_dir: Path | None = None
    slide: Slide | None = field(default=None, repr=False)
    detections_file: Path | None = field(default=None, repr=False)  # the file load_run read them from

    # -- construction ------------------------------------------------------
    @classmethod
    def from_result(cls, result: Any, slide: Slide | str | os.PathLike[str] | np.ndarray | None = None) -> ReviewRun:
        """Wrap a :class:`~wsi_pipeline.pipeline.Result`.

        ``slide``: the slide or RGB array the run read (needed for an array
        source, which has no file); default: the result's source path.
        Class colours come from the model card named in the summary.
        """
        summary = dict(result.summary)
        card = _card_classes((summary.get("model") or {}).get("card"))
        names = list(result.class_names)
        colors = card[1] if card and card[0] == names else [PALETTE[i % len(PALETTE)] for i in range(len(names))]
        opened = as_slide(slide) if slide is not None else None
        path = Path(result.source) if slide is None and os.path.isfile(str(result.source)) else None
        if opened is not None and not isinstance(slide, np.ndarray):
            path = Path(str(opened.path))
        mpp = summary.get("mpp")
        dims = summary.get("dimensions_level0") or (opened.dimensions if opened else (0, 0))
        return cls(
            detections=result.detections,
            class_names=names,
            class_colors=list(colors),
            dimensions=(int(dims[0]), int(dims[1])),
            mpp=tuple(mpp) if mpp else None,
            summary=summary,
            slide_path=path,
            heatmap=result.heatmap,
            heatmap_classes=list(result.heatmap_classes),
            heatmap_scale_level0=float(result.heatmap_scale_level0),
            run_dir=Path(result.out_dir) if result.out_dir else None,
            slide=opened,
        )

    # -- access --------------------------------------------------------------
    @property
    def classes(self) -> list[dict[str, Any]]:
        """``[{"name", "color": [r, g, b]}]`` per label, as :func:`~wsi_pipeline.io.detections.write_geojson` takes."""
        return [{"name": n, "color": list(c)} for n, c in zip(self.class_names, self.class_colors, strict=True)]

    def color_of(self, label: int) -> tuple[float, float, float]:
        """The matplotlib colour (0-1 floats) of ``label`` (grey for unknown labels)."""
        c = self.class_colors[label] if 0 <= label < len(self.class_colors) else (128, 128, 128)
        return (c[0] / 255.0, c[1] / 255.0, c[2] / 255.0)

    def name_of(self, label: int) -> str:
        return self.class_names[label] if 0 <= label < len(self.class_names) else f"class_{label}"

    def __repr__(self) -> str:
        where = self.run_dir or self.slide_path or "in memory"
        counts = ", ".join(f"{n} {int((self.detections['label'] == i).sum())}" for i, n in enumerate(self.class_names))
        heat = f", heatmap {'/'.join(self.heatmap_classes)}" if self.heatmap is not None else ""
        return (
            f"ReviewRun({where}: {len(self.detections)} detections ({counts}), "
            f"{self.dimensions[0]} x {self.dimensions[1]} px{heat})"
        )

    def open_slide(self) -> Slide:
        """The slide, opened once (:func:`~wsi_pipeline.open_slide` on ``slide_path``)."""
        if self.slide is None:
            if self.slide_path is None:
                raise WSIPipelineError("this run has no slide file; pass slide=... to load_run or from_result")
            if not self.slide_path.is_file():
                raise WSIPipelineError(
                    f"{self.slide_path}: the run's slide is not there; pass slide=... to load_run with its new place"
                )
            self.slide = open_slide(self.slide_path)
        return self.slide

    def filter(self, **criteria: Any) -> ReviewRun:
        """A copy holding only the detections that pass :func:`~.filters.filter_detections` ``criteria``."""
        from .filters import filter_detections

        dets = filter_detections(self.detections, class_names=self.class_names, **criteria)
        return dataclasses.replace(self, detections=dets)

    def close(self) -> None:
        if self.slide is not None:
            self.slide.close()
            self.slide = None

    def __enter__(self) -> ReviewRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _heatmap_scale(
    summary: dict[str, Any],
    heat: HeatmapFile,
    stride: int | None,
    mpp: tuple[float, float] | None,
    dims: tuple[int, int],
) -> float:
    """Level-0 pixels per heatmap pixel: from the OME physical size and the slide mpp, else the
    model's stride times the grid downsample, else the width ratio."""
    recorded = (summary.get("heatmap") or {}).get("scale_level0")
    if recorded:
        return float(recorded)
    if heat.physical_size_um and mpp:
        return heat.physical_size_um[0] / mpp[0]
    downsample = (summary.get("tiles") or {}).get("downsample")
    if stride and downsample:
        return float(stride) * float(downsample)
    return dims[0] / heat.shape[2]


def _resolve_slide(run_dir: Path, recorded: str | None) -> Path | None:
    if not recorded:
        return None
    p = Path(recorded)
    if p.is_file() or p.is_absolute():
        return p
    return run_dir / p if (run_dir / p).is_file() else p


def _slide_folder(run_dir: Path) -> Path:
    """``run_dir``, or the one slide folder of the batch folder ``run_dir``."""
    from ..batch.folder import slides_dir

    batch = slides_dir(run_dir)
    if (run_dir / SUMMARY_FILE).exists() or not batch.is_dir():
        return run_dir
    names = sorted(p.name for p in batch.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(names) == 1:
        return batch / names[0]
    raise WSIPipelineError(
        f"{run_dir}: a batch folder of {len(names)} slides: expected one slide's folder, "
        f"{batch}{os.sep}<name> (names: {', '.join(names[:10]) or 'none'})"
    )


def load_run(run_dir: str | os.PathLike[str], slide: str | os.PathLike[str] | Slide | None = None) -> ReviewRun:
    """Load a run folder (summary.json, the detections from whichever file the run wrote of
    :data:`DETECTION_FILES`, recorded as ``detections_file``; heatmap.ome.tif when written).
    A folder without any detection file loads with no detections, a logged warning and a
    :class:`NoDetectionFileWarning`.

    ``run_dir`` is one slide's folder (``pipe.run(..., out_dir=...)``, or
    ``DIR/slides/<name>`` of ``wsi-pipeline run --out DIR``), or a batch
    folder ``DIR`` that holds a single slide. Class names follow the order of ``summary["counts"]`` (the label order);
    colours come from the model card, else from the GeoJSON file. ``slide``
    replaces the slide path the summary records (for a moved slide).
    """
    run_dir = _slide_folder(Path(run_dir))
    summary = load_summary(run_dir)

    card = _card_classes((summary.get("model") or {}).get("card"))
    names = list((summary.get("counts") or {}).keys())
    if summary.get("classes"):  # the run recorded its classes and colours
        names = [c["name"] for c in summary["classes"]]
        colors = [parse_color(c.get("color", PALETTE[i % len(PALETTE)])) for i, c in enumerate(summary["classes"])]
    elif card and (not names or card[0] == names):
        names, colors = card[0], list(card[1])
    else:
        colors = []
    dets, detections_file = read_run_detections(run_dir, names)
    if len(colors) != len(names):
        geo = next((p for p in (run_dir / n for n in GEOJSON_FILES) if p.is_file()), None)
        found = _geojson_colors(geo, names) if geo is not None else {}
        colors = [found.get(n, PALETTE[i % len(PALETTE)]) for i, n in enumerate(names)]

    mpp = tuple(summary["mpp"]) if summary.get("mpp") else None
    dims_raw = summary.get("dimensions_level0")
    opened = slide if isinstance(slide, Slide) else None
    slide_path = (
        Path(str(opened.path))
        if opened
        else (Path(slide) if slide is not None else _resolve_slide(run_dir, summary.get("slide")))
    )
    if dims_raw:
        dims = (int(dims_raw[0]), int(dims_raw[1]))
    elif opened is not None:
        dims = opened.dimensions
    else:
        dims = (int(np.ceil(dets["x1"].max())) if len(dets) else 0, int(np.ceil(dets["y1"].max())) if len(dets) else 0)

    heat = None
    scale = 1.0
    classes: list[str] = []
    hpath = run_dir / "heatmap.ome.tif"
    if hpath.is_file():
        heat = HeatmapFile(hpath)
        classes = list(heat.channel_names) or [f"channel_{i}" for i in range(heat.shape[0])]
        scale = _heatmap_scale(summary, heat, card[2] if card else None, mpp, dims)
    return ReviewRun(
        detections=dets,
        class_names=names,
        class_colors=colors,
        dimensions=dims,
        mpp=mpp,
        summary=summary,
        slide_path=slide_path,
        heatmap=heat,
        heatmap_classes=classes,
        heatmap_scale_level0=float(scale),
        run_dir=run_dir,
        slide=opened,
        detections_file=detections_file,
    )


__all__ = ["DETECTION_FILES", "PALETTE", "NoDetectionFileWarning", "ReviewRun", "load_run"]
