"""The output formats a run can write into a slide's folder, by name (``RunConfig.formats``).

Each :class:`OutputFormat` names its file, how it is made and what it needs:

- ``detections``: a job of the writer pool (:mod:`.writer_pool`), the
  function ``writer(path, detections, classes)``;
- ``overlay``: a writer-pool job drawn from the slide's thumbnail;
- ``heatmap``: a sink the heatmap blender streams into while the slide runs
  (written only for models with a heatmap output), the class ``sink`` made as
  ``sink(path, width, height, channels, channel_names=..., physical_size_um=...)``,
  called with the rows top to bottom, then closed (``close()``) or aborted
  (``abort()``); a sink that offers ``spooled()`` has its file finished by a
  writer process (``spooled().write()``) instead, and a format with a
  ``reader`` is read back lazily as the run's heatmap;
- ``heatmap-file``: a writer-pool job made from the finished heatmap file of
  the format it is ``made_from``, ``writer(path, heatmap_path, channel_names,
  **slide)`` (so it needs that format, ``ome-tiff``, among the formats).

A new format is one entry in :data:`FORMATS` (:func:`register_format`): its module is imported
only when a run chooses it. Outside the package, the entry is made by a plugin module
(:mod:`wsi_pipeline.plugins`).

Jobs whose format has ``slide_args`` also get the slide's level-0
``dimensions``, ``slide_path`` and ``mpp`` as keywords (DICOM references its
source). ``summary.json`` is written after all of them and is not a format:
it is in every folder.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

from ..errors import ConfigError
from ..plugins import FORMATS_GROUP, carry
from ..summary import SUMMARY_FILE

DETECTIONS, OVERLAY, HEATMAP, HEATMAP_FILE = "detections", "overlay", "heatmap", "heatmap-file"


class DetectionsWriter(Protocol):
    """A :data:`DETECTIONS` format's ``writer``: a module-level function, run in a writer process.

    ``detections``: the slide's records, :data:`~.detections.DETECTION_DTYPE` (``x0 y0 x1 y1``
    level-0 pixels, ``score`` float32, ``label`` int32), sorted top to bottom;
    :data:`~.detections.TILED_DETECTION_DTYPE` (with ``tile_row``, ``tile_col``) for a format with
    ``tiles``. ``classes``: the card's classes, ``{"name": ..., "color": "#rrggbb"}`` each. A format
    with ``slide_args`` also gets ``dimensions``, ``slide_path`` and ``mpp`` as keywords. The writer
    writes ``path`` atomically itself (:func:`~.atomic.atomic_write`: a temporary name, renamed when
    complete), so that a killed run leaves no half-written file under the final name.
    """

    def __call__(
        self, path: str | os.PathLike[str], detections: np.ndarray, classes: Sequence[dict[str, Any]], /
    ) -> None: ...


class HeatmapSink(Protocol):
    """A :data:`HEATMAP` format's ``sink``, made as ``sink(path, width, height, channels,
    channel_names=[...], physical_size_um=(x, y) or None)`` (the heatmap plane's pixels) and fed on
    a thread of its own while the slide runs.

    Called with the rows top to bottom (``rows``: ``C x n x width float32``, ``y0_out`` the first
    one's row), then :meth:`close` (the file written, atomically) or :meth:`abort` (the slide
    failed: nothing left under the final name). A sink that also offers ``spooled()`` has its file
    finished by a writer process instead: ``spooled().write()`` there.
    """

    def __call__(self, y0_out: int, rows: np.ndarray) -> None: ...

    def close(self) -> Any: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class OutputFormat:
    """One output file of a slide.

    Attributes:
        name: the name ``--formats`` takes.
        filename: the file written in the slide's folder.
        kind: :data:`DETECTIONS`, :data:`OVERLAY`, :data:`HEATMAP` or :data:`HEATMAP_FILE`.
        writer: ``"module:function"`` of a writer-pool job (None for heatmap sinks);
            imported when a run uses it, so that its library is needed only then.
        requires: modules that must be importable for it.
        extra: the package extra that installs them (``pip install 'wsi-pipeline[EXTRA]'``).
        about: what it is, in a few words (for ``--help``).
        made_from: formats it is made from, which must be chosen with it.
        slide_args: the job also takes the slide's ``dimensions``, ``slide_path`` and ``mpp``.
        parts: ``"module:NAME"`` of a :class:`~.detections.PartsWriter`, where the file can be
            written in parts by several writer processes at once (large slides).
        tiles: the writer takes the detections with their tiles (:func:`~.detections.with_tiles`).
        includes: formats whose file this one's holds, and more (the same file name): choosing
            both writes this one alone.
        holds_none: what stops the file from holding zero detections, where it cannot (the file
            is then not written for a slide without detections, and ``summary.json`` says why).
        sink: ``"module:Class"`` of a :data:`HEATMAP` format's streaming writer (see above), imported
            when a run uses it.
        reader: ``"module:Class"`` of the lazy reader of a :data:`HEATMAP` format's finished file,
            ``reader(path)``: the run's heatmap where it is not held in memory.
    """

    name: str
    filename: str
    kind: str
    writer: str | None = None
    requires: tuple[str, ...] = ()
    extra: str | None = None
    about: str = ""
    made_from: tuple[str, ...] = ()
    slide_args: bool = False
    parts: str | None = None
    tiles: bool = False
    includes: tuple[str, ...] = ()
    holds_none: str | None = None
    sink: str | None = None
    reader: str | None = None

    def write_function(self) -> Callable:
        """The writer-pool job function (a module-level function: the pool pickles it)."""
        if self.writer is None:
            raise ValueError(f"format {self.name} is a {self.kind} sink, not a writer-pool job")
        return _load(self.writer)

    def sink_class(self) -> Callable[..., Any]:
        """The class of a heatmap format's streaming writer (its module imported now)."""
        if self.sink is None:
            raise ValueError(f"format {self.name} is a {self.kind} format, not a heatmap sink")
        return _load(self.sink)

    def reader_class(self) -> Callable[..., Any] | None:
        """The class that reads a heatmap format's finished file back lazily, or None where none does."""
        return _load(self.reader) if self.reader is not None else None

    def job(self, slide_args: dict[str, Any]) -> Callable:
        """:meth:`write_function` with the slide's keywords bound where the format takes them
        (picklable: a partial of a module-level function)."""
        fn = self.write_function()
        return functools.partial(fn, **slide_args) if self.slide_args else fn

    def parts_writer(self) -> Any:
        """The format's :class:`~.detections.PartsWriter`, or None where it is written whole."""
        return _load(self.parts) if self.parts is not None else None

    def missing(self) -> list[str]:
        """The required modules that cannot be imported here."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _load(spec: str) -> Any:
    """The object ``"module:name"`` names, its module imported."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


FORMATS: dict[str, OutputFormat] = {
    f.name: f
    for f in (
        OutputFormat(
            "geojson",
            "detections.geojson",
            DETECTIONS,
            "wsi_pipeline.io.detections:write_geojson",
            about="QuPath GeoJSON",
            parts="wsi_pipeline.io.detections:GEOJSON_PARTS",
        ),
        OutputFormat(
            "geojson.gz",
            "detections.geojson.gz",
            DETECTIONS,
            "wsi_pipeline.io.detections:write_geojson",
            about="the same, gzip-compressed, for pandas, geopandas, GDAL",
        ),
        OutputFormat(
            "geojson.zip",
            "detections.geojson.zip",
            DETECTIONS,
            "wsi_pipeline.io.detections:write_geojson",
            about="the same in a zip archive, which QuPath imports as it is",
        ),
        OutputFormat(
            "csv",
            "detections.csv",
            DETECTIONS,
            "wsi_pipeline.io.detections:write_csv",
            about="CSV table",
            parts="wsi_pipeline.io.detections:CSV_PARTS",
            tiles=True,
        ),
        OutputFormat(
            "parquet",
            "detections.parquet",
            DETECTIONS,
            "wsi_pipeline.io.parquet:write_parquet",
            requires=("pyarrow",),
            extra="parquet",
            about="Parquet table for pandas, polars, DuckDB",
            tiles=True,
        ),
        OutputFormat(
            "geoparquet",
            "detections.parquet",
            DETECTIONS,
            "wsi_pipeline.io.parquet:write_geoparquet",
            requires=("pyarrow", "shapely"),
            extra="geoparquet",
            about="the Parquet table with box polygons and GeoParquet metadata, for geopandas, GDAL, DuckDB",
            includes=("parquet",),
            tiles=True,
        ),
        OutputFormat(
            "dsa",
            "detections.dsa.json",
            DETECTIONS,
            "wsi_pipeline.io.dsa:write_dsa",
            about="large_image annotation JSON (rectangles), for HistomicsTK and the Digital Slide Archive",
        ),
        OutputFormat(
            "dicom",
            "detections.dcm",
            DETECTIONS,
            "wsi_pipeline.io.dicom:write_dicom_annotations",
            requires=("highdicom",),
            extra="dicom",
            slide_args=True,
            about="DICOM Microscopy Bulk Simple Annotations, for archives and DICOM viewers",
            holds_none="no detections: a DICOM Microscopy Bulk Simple Annotations object holds at least one",
        ),
        OutputFormat(
            "ome-tiff",
            "heatmap.ome.tif",
            HEATMAP,
            about="heatmap as a pyramidal OME-TIFF",
            sink="wsi_pipeline.io.ome_tiff:OmeTiffHeatmapWriter",
            reader="wsi_pipeline.io.ome_tiff:HeatmapFile",
        ),
        OutputFormat(
            "ome-zarr",
            "heatmap.ome.zarr",
            HEATMAP,
            sink="wsi_pipeline.io.ome_zarr:OmeZarrHeatmapWriter",
            requires=("zarr", "ome_zarr"),
            extra="zarr",
            about="heatmap as OME-Zarr (NGFF 0.4), for QuPath 0.6+ and napari",
        ),
        OutputFormat(
            "dicom-heatmap",
            "heatmap_dicom",
            HEATMAP_FILE,
            "wsi_pipeline.io.dicom:write_heatmap_parametric_maps",
            requires=("highdicom",),
            extra="dicom",
            made_from=("ome-tiff",),
            slide_args=True,
            about="heatmap as DICOM Parametric Maps, one file per class (with ome-tiff)",
        ),
        OutputFormat(
            "overlay",
            "overlay.png",
            OVERLAY,
            "wsi_pipeline.io.overlay:write_overlay",
            about="thumbnail with heatmap and boxes",
        ),
    )
}

_BUILT_IN = frozenset(FORMATS)


def register_format(fmt: OutputFormat, *, replace: bool = False) -> OutputFormat:
    """Add ``fmt`` to :data:`FORMATS`; ValueError where its name is taken (unless ``replace``)."""
    if fmt.name in FORMATS and not replace:
        raise ValueError(f"output format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove the format named ``name`` (nothing where there is none)."""
    FORMATS.pop(name, None)


def _added_formats() -> list[OutputFormat]:
    """Every format in its place, where one was added from outside the package (what a helper
    process is handed); nothing otherwise."""
    return list(FORMATS.values()) if set(FORMATS) - _BUILT_IN else []


def _restore_formats(formats: list[OutputFormat]) -> None:
    FORMATS.clear()
    FORMATS.update((f.name, f) for f in formats)


carry(_added_formats, _restore_formats, FORMATS_GROUP, whole=True)

# What a run writes unless told otherwise (what every reader of a slide folder expects).
DEFAULT_FORMATS = ("geojson", "csv", "ome-tiff", "overlay")


def parse_formats(value: str | Iterable[str], source: str = "config") -> tuple[str, ...]:
    """Names as given (``"geojson.gz,parquet"`` or a list) -> a tuple in :data:`FORMATS`' order,
    without repeats, nor a format another one chosen includes (``parquet`` beside ``geoparquet``:
    one ``detections.parquet``). ConfigError for an empty list, an unknown name, or a format whose library
    is not installed (naming the extra that installs it)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(n, str) for n in items):
        raise ConfigError(f"{source}: formats: expected format names, found {value!r}")
    names = {n.strip().lower() for n in items if n.strip()}
    if not names:
        raise ConfigError(f"{source}: formats: expected at least one of {', '.join(FORMATS)}, found {value!r}")
    unknown = sorted(names - set(FORMATS))
    if unknown:
        raise ConfigError(f"{source}: formats: unknown format {unknown[0]!r} (known: {', '.join(FORMATS)})")
    for name in names:
        fmt = FORMATS[name]
        missing = fmt.missing()
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(
                f"{source}: formats: {name} needs {' and '.join(missing)}, which {verb} not installed: "
                f"pip install 'wsi-pipeline[{fmt.extra}]'"
            )
    names -= {inner for name in names for inner in FORMATS[name].includes}
    for name in names:
        lacking = [m for m in FORMATS[name].made_from if m not in names]
        if lacking:
            raise ConfigError(
                f"{source}: formats: {name} is made from {' and '.join(lacking)}; "
                f"add {', '.join(lacking)} to the formats"
            )
    return tuple(n for n in FORMATS if n in names)


def chosen(names: Iterable[str], kind: str | None = None) -> list[OutputFormat]:
    """The formats of ``names`` (of ``kind`` when given), in :data:`FORMATS`' order."""
    names = set(names)
    return [f for n, f in FORMATS.items() if n in names and (kind is None or f.kind == kind)]


def output_files(names: Iterable[str], heatmap: bool = True, detections: bool = True) -> list[str]:
    """The files (or folders: ``ome-zarr``, ``dicom-heatmap``) a slide folder holds for formats
    ``names``, ``summary.json`` last; heatmap files only with ``heatmap`` (a model with a heatmap
    output); without ``detections`` (a slide with none), not the files that cannot hold zero."""
    return [
        f.filename
        for f in chosen(names)
        if (heatmap or f.kind not in (HEATMAP, HEATMAP_FILE)) and (detections or f.holds_none is None)
    ] + [SUMMARY_FILE]


def not_written(names: Iterable[str], dets) -> dict[str, str]:
    """The files of formats ``names`` left out for the detections ``dets``, each with why
    (``summary.json`` ``not_written``): those that cannot hold zero detections, for a slide without."""
    if len(dets):
        return {}
    return {f.filename: f.holds_none for f in chosen(names) if f.holds_none is not None}


def detection_notes(names: Iterable[str], dets) -> dict[str, int]:
    """Summary entries about how formats ``names`` write the detections ``dets``:
    ``geojson_left_out``, the boxes a GeoJSON file leaves out (no area; see
    :func:`~.detections.polygon_rows`), when a GeoJSON format is among them."""
    if not any(f.writer == FORMATS["geojson"].writer for f in chosen(names)):
        return {}
    from .detections import count_polygons

    return {"geojson_left_out": len(dets) - count_polygons(dets)}
