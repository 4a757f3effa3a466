"""Detections as Apache Parquet and GeoParquet, for pandas, polars, DuckDB and geopandas.

One row per detection, columns ``x0, y0, x1, y1`` (float32, level-0 pixels,
origin top-left), ``score`` (float32), ``label`` (int32, index into the
model's classes), ``class`` (the label's name, dictionary-encoded) and, for
detections with their tiles (:func:`~.detections.with_tiles`, as a run writes
them), ``tile_row`` and ``tile_col`` (int32, the grid row and column of the
tile whose core holds the box's centre). GeoParquet adds ``geometry``: each
box as a WKB Polygon (level-0 pixels, no CRS), and ``bbox``, GeoParquet 1.1's
bbox covering column (a struct of xmin, ymin, xmax, ymax), with the GeoParquet
``geo`` metadata (version :data:`GEOPARQUET_VERSION`, naming ``bbox`` as the
geometry's covering), so ``geopandas.read_parquet`` returns a GeoDataFrame and
readers skip row groups by their bbox statistics (a run's detections are sorted
top to bottom, so each row group is a horizontal band of the slide); a run writes it as ``detections.parquet``, the
``.parquet`` extension GeoParquet 1.1 asks for, which pandas and DuckDB read
as the plain table. Rows are written in row groups of :data:`ROW_GROUP` rows,
zstd compressed: besides the detection array, a writer holds one row group.

Needs pyarrow (extra ``parquet``); GeoParquet also shapely (extra ``geoparquet``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence

import numpy as np

from .atomic import atomic_write
from .detections import TILE_FIELDS, detection_class, has_tiles, labels_present

# Rows a row group: ~2 MiB of columns; the GeoParquet writer holds their shapely boxes too (~0.1 GiB).
ROW_GROUP = 1 << 16
COMPRESSION = "zstd"
GEOPARQUET_VERSION = "1.1.0"
BOX_COLUMNS = ("x0", "y0", "x1", "y1")
# GeoParquet 1.1's bbox covering column: a struct of these fields, each box's bounds (BOX_COLUMNS'
# values, as doubles, the type GDAL and geopandas write).
BBOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")


def _schema(geometry: bool, tiles: bool, classes_doc: list[dict], bbox: list[float] | None):
    import pyarrow as pa

    fields = [pa.field(k, pa.float32()) for k in (*BOX_COLUMNS, "score")]
    fields += [pa.field("label", pa.int32()), pa.field("class", pa.dictionary(pa.int32(), pa.string()))]
    fields += [pa.field(k, pa.int32()) for k in TILE_FIELDS if tiles]
    meta = {"wsi_pipeline": json.dumps({"coordinates": "level-0 pixels, origin top-left", "classes": classes_doc})}
    if geometry:
        fields.append(pa.field("geometry", pa.binary()))
        fields.append(pa.field("bbox", pa.struct([pa.field(k, pa.float64()) for k in BBOX_FIELDS])))
        column: dict = {
            "encoding": "WKB",
            "geometry_types": ["Polygon"],
            "crs": None,
            "covering": {"bbox": {k: ["bbox", k] for k in BBOX_FIELDS}},
        }
        if bbox is not None:
            column["bbox"] = bbox
        meta["geo"] = json.dumps(
            {"version": GEOPARQUET_VERSION, "primary_column": "geometry", "columns": {"geometry": column}}
        )
    return pa.schema(fields, metadata=meta)


def _bbox(dets: np.ndarray) -> list[float] | None:
    """[xmin, ymin, xmax, ymax] of all boxes (level-0 pixels), or None without finite ones."""
    if not len(dets):
        return None
    with warnings.catch_warnings():  # all-NaN columns warn
        warnings.simplefilter("ignore", RuntimeWarning)
        lo = [np.nanmin(dets[k]) for k in ("x0", "y0")]
        hi = [np.nanmax(dets[k]) for k in ("x1", "y1")]
    box = [float(v) for v in (*lo, *hi)]
    return box if all(np.isfinite(box)) else None


def _write(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict], geometry: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Every class of the model in the dictionary, found or not: the same categories for every
    # slide (one without detections too), so that slides' tables concatenate as categories.
    labels = np.array(sorted(set(range(len(classes))) | set(labels_present(dets))), np.int32)
    names = pa.array([detection_class(classes, int(lab))["name"] for lab in labels], pa.string())
    classes_doc = [{"label": int(lab), "name": detection_class(classes, int(lab))["name"]} for lab in labels]
    tiles = has_tiles(dets)
    schema = _schema(geometry, tiles, classes_doc, _bbox(dets) if geometry else None)
    # Statistics (each row group's min and max of every column, the bbox fields' included) let
    # readers skip row groups by location; pyarrow writes them by default, asked here so it stays so.
    with (
        atomic_write(path, "wb") as f,
        pq.ParquetWriter(f, schema, compression=COMPRESSION, write_statistics=True) as writer,
    ):
        for start in range(0, max(len(dets), 1), ROW_GROUP):  # no detections: one empty row group
            d = dets[start : start + ROW_GROUP]
            cols = [pa.array(d[k]) for k in (*BOX_COLUMNS, "score", "label")]
            codes = np.searchsorted(labels, d["label"]).astype(np.int32)
            cols.append(pa.DictionaryArray.from_arrays(pa.array(codes), names))
            cols += [pa.array(d[k]) for k in TILE_FIELDS if tiles]
            if geometry:
                cols.append(_wkb_boxes(d))
                bounds = [pa.array(d[k].astype(np.float64)) for k in BOX_COLUMNS]
                cols.append(pa.StructArray.from_arrays(bounds, names=list(BBOX_FIELDS)))
            writer.write_table(pa.Table.from_arrays(cols, schema=schema), row_group_size=ROW_GROUP)


def _wkb_boxes(d: np.ndarray):
    """The boxes of ``d`` as a pyarrow binary array of WKB Polygons (closed, counter-clockwise
    in x-right / y-up axes), built by shapely's vectorised functions."""
    import pyarrow as pa
    import shapely

    boxes = shapely.box(*(d[k].astype(np.float64) for k in BOX_COLUMNS))
    return pa.array(shapely.to_wkb(boxes), pa.binary())


def write_parquet(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as Parquet (the module's columns, level-0 pixels), atomically."""
    _write(path, dets, classes, geometry=False)


def write_geoparquet(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as GeoParquet (the Parquet columns and a WKB ``geometry``), atomically."""
    _write(path, dets, classes, geometry=True)
