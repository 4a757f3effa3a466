"""Detections in slide coordinates and their files (QuPath GeoJSON, plain, gzipped or zipped, and CSV).

A slide's detections are a numpy structured array with fields
``x0, y0, x1, y1`` (float32, level-0 pixels, origin top-left), ``score``
(float32) and ``label`` (int32, index into the model's classes);
``pandas.DataFrame(detections)`` turns it into a table. The files are written
in chunks of :data:`CHUNK` rows: besides the array itself, a writer holds one
chunk's text, whatever the number of detections. Parquet and GeoParquet are in
:mod:`.parquet`.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from ..errors import WSIPipelineError
from .atomic import atomic_write
from .text_rows import choice_column, decimal_column, hex_column, join_rows

DETECTION_DTYPE = np.dtype(
    [("x0", "<f4"), ("y0", "<f4"), ("x1", "<f4"), ("y1", "<f4"), ("score", "<f4"), ("label", "<i4")]
)
CSV_COLUMNS = ("x0", "y0", "x1", "y1", "score", "label", "class")
# A run's detections as its CSV and Parquet files get them: with the grid row and column of the tile
# whose core holds the box's centre (:meth:`~wsi_pipeline.geometry.TilingGeometry.core_tiles_level0`).
TILE_FIELDS = ("tile_row", "tile_col")
TILED_DETECTION_DTYPE = np.dtype(DETECTION_DTYPE.descr + [(k, "<i4") for k in TILE_FIELDS])
# Rows formatted at a time: a chunk of GeoJSON is ~21 MiB of text; building it (io/text_rows.py)
# peaks at ~70 MiB.
CHUNK = 65536
# gzip level of detections.geojson.gz: level 1 compresses this text to ~13 %, level 6 (zlib's
# default) to ~11 % in 3x the time (benchmarks/HISTORY.md, output formats).
GZIP_LEVEL = 1
GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGIC = b"PK\x03\x04"


def make_detections(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Pack ``boxes`` (Nx4 x0, y0, x1, y1), ``scores`` (N) and ``labels`` (N) into the record array."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    out = np.empty(len(boxes), DETECTION_DTYPE)
    for i, name in enumerate(("x0", "y0", "x1", "y1")):
        out[name] = boxes[:, i]
    out["score"] = np.asarray(scores, np.float32).reshape(-1)
    out["label"] = np.asarray(labels).reshape(-1).astype(np.int32)
    return out


def with_tiles(dets: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``dets`` with the fields ``tile_row`` and ``tile_col`` (:data:`TILED_DETECTION_DTYPE`).

    >>> d = with_tiles(make_detections([[10, 20, 30, 40]], [0.9], [0]), [2], [5])
    >>> int(d["tile_row"][0]), int(d["tile_col"][0])
    (2, 5)
    """
    out = np.empty(len(dets), TILED_DETECTION_DTYPE)
    for name in DETECTION_DTYPE.names:
        out[name] = dets[name]
    out["tile_row"], out["tile_col"] = rows, cols
    return out


def has_tiles(dets: np.ndarray) -> bool:
    """Whether ``dets`` has the tile fields (:func:`with_tiles`)."""
    return set(TILE_FIELDS) <= set(dets.dtype.names or ())


def detection_boxes(dets: np.ndarray) -> np.ndarray:
    """Nx4 float32 boxes (x0, y0, x1, y1) of a detection array."""
    return np.stack([dets[k] for k in ("x0", "y0", "x1", "y1")], axis=1).astype(np.float32)


def detection_class(classes: Sequence[dict], label: int) -> dict:
    if 0 <= label < len(classes):
        return classes[label]
    return {"name": f"class_{label}", "color": [255, 0, 0]}


def parse_color(color: str | Sequence[int]) -> tuple[int, int, int]:
    """``"#rrggbb"`` or ``[r, g, b]`` (0-255) -> an (r, g, b) tuple of ints.

    >>> parse_color("#7b2cbf"), parse_color([1, 2, 3, 255])
    ((123, 44, 191), (1, 2, 3))
    """
    if isinstance(color, str):
        v = int(color.lstrip("#"), 16)
        return ((v >> 16) & 255, (v >> 8) & 255, v & 255)
    r, g, b = (int(c) for c in list(color)[:3])
    return (r, g, b)


def to_geojson(dets: np.ndarray, classes: Sequence[dict]) -> dict:
    """A QuPath-importable FeatureCollection of detection boxes (level-0 pixels).

    Each Feature: a stable ``id`` (:func:`feature_ids`), a closed Polygon ring
    (coordinates rounded to 0.01 px), ``properties.objectType: "detection"``,
    ``properties.classification: {name, color}`` (color as [r, g, b], QuPath's
    convention) and ``properties.measurements: {score: ...}`` (rounded to
    1e-6). A box with no area after rounding (zero width or height) or with a
    coordinate that is not finite is no polygon and is left out
    (:func:`polygon_rows`). :func:`write_geojson` writes the same document.

    >>> d = make_detections([[10, 20, 30.5, 40]], [0.9], [0])
    >>> f = to_geojson(d, [{"name": "nucleus", "color": "#ff0000"}])["features"][0]
    >>> f["geometry"]["coordinates"][0][:3], f["properties"]["classification"]
    ([[10.0, 20.0], [30.5, 20.0], [30.5, 40.0]], {'name': 'nucleus', 'color': [255, 0, 0]})
    """
    return json.loads(b"".join(_geojson_chunks(dets, classes)))


# A feature's text around its values (QuPath's GeoJSON; see :func:`to_geojson`).
_FEATURE_TEXT = (
    b'{"type":"Feature","id":"',
    b'","geometry":{"type":"Polygon","coordinates":[[[',
    b'"properties":{"objectType":"detection","classification":',
    b',"measurements":{"score":',
    b"}}}",
)


def polygon_rows(dets: np.ndarray) -> np.ndarray:
    """Bool (N,): the rows whose box is a polygon in GeoJSON: finite, with positive width and
    height after rounding to 0.01 px (the GeoJSON's precision)."""
    x0, y0, x1, y1 = (np.round(dets[k].astype(np.float64), 2) for k in ("x0", "y0", "x1", "y1"))
    with np.errstate(invalid="ignore"):
        return np.isfinite(x0 + y0 + x1 + y1) & (x1 > x0) & (y1 > y0)


def labels_present(dets: np.ndarray) -> list[int]:
    """The labels found in ``dets``, ascending (a chunk at a time: no copy of the label column)."""
    found: set[int] = set()
    for start in range(0, len(dets), CHUNK):
        found.update(np.unique(dets["label"][start : start + CHUNK]).tolist())
    return sorted(found)


def count_polygons(dets: np.ndarray) -> int:
    """How many rows of ``dets`` are polygons in GeoJSON (:func:`polygon_rows`), a chunk at a time."""
    return sum(int(polygon_rows(dets[start : start + CHUNK]).sum()) for start in range(0, len(dets), CHUNK))


def feature_ids(dets: np.ndarray) -> str:
    """The first 24 hex digits (with dashes) of the features' ids; a feature's id adds its row
    index in ``dets`` as 12 hex digits, so each id is a UUID string (version 5 layout).

    The prefix is a digest of the detections, so the same detections get the same ids in
    every file and on every run, and different slides' detections get different ones; the row
    index ties a GeoJSON feature to its row in the CSV and Parquet files.

    >>> d = make_detections([[10, 20, 30.5, 40]], [0.9], [0])
    >>> prefix = feature_ids(d)
    >>> len(prefix + "%012x" % 0), prefix == feature_ids(d.copy())
    (36, True)
    """
    digest = hashlib.sha1()
    for start in range(0, len(dets), CHUNK):
        digest.update(np.ascontiguousarray(dets[start : start + CHUNK]).tobytes())
    h = digest.hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{'89ab'[int(h[16], 16) & 3]}{h[17:20]}-"


GEOJSON_HEAD = '{"type":"FeatureCollection","features":['
GEOJSON_TAIL = "]}"


def _geojson_chunks(dets: np.ndarray, classes: Sequence[dict], chunk: int | None = None) -> Iterator[bytes]:
    yield GEOJSON_HEAD.encode()
    yield from _geojson_features(dets, classes, feature_ids(dets), 0, chunk)
    yield GEOJSON_TAIL.encode()


def _class_texts(dets: np.ndarray, classes: Sequence[dict], text: Callable[[int], str]) -> tuple[np.ndarray, list]:
    """The labels present in ``dets`` (ascending) and ``text(label)`` of each, UTF-8."""
    labels = np.array(labels_present(dets), np.int64)
    return labels, [text(int(lab)).encode("utf-8") for lab in labels]


def _geojson_features(
    dets: np.ndarray, classes: Sequence[dict], prefix: str, row0: int, chunk: int | None = None
) -> Iterator[bytes]:
    """The features of ``dets`` (rows numbered from ``row0`` in the ids), comma-separated, as
    UTF-8 pieces: the part of the FeatureCollection's ``features`` list between its brackets."""
    # Rows are built as byte arrays, a chunk at a time (text_rows): formatting each number
    # with repr took ~1.5 s for a slide's 286,528 detections.
    chunk = chunk or CHUNK

    def cls_json(lab: int) -> str:
        c = detection_class(classes, lab)
        return json.dumps(
            {"name": c["name"], "color": list(parse_color(c.get("color", [255, 0, 0])))}, separators=(",", ":")
        )

    labels, cls_texts = _class_texts(dets, classes, cls_json)
    head, coords, props, score, end = _FEATURE_TEXT
    head += prefix.encode()
    sep = b""
    for start in range(0, len(dets), chunk):
        d = dets[start : start + chunk]
        rows_kept = np.flatnonzero(polygon_rows(d))
        if len(rows_kept) < len(d):
            d = d[rows_kept]
        if not len(d):
            continue
        x0, y0, x1, y1 = (decimal_column(d[k], 2, shortest=True) for k in ("x0", "y0", "x1", "y1"))
        text = join_rows(
            [
                head,
                hex_column(rows_kept + (row0 + start), 12),
                coords,
                x0, b",", y0, b"],[", x1, b",", y0, b"],[", x1, b",", y1, b"],[", x0, b",", y1, b"],[", x0, b",", y0,
                b"]]]},",
                props,
                choice_column(np.searchsorted(labels, d["label"]), cls_texts),
                score,
                decimal_column(d["score"], 6, shortest=True),
                end + b",",
            ]
        )  # fmt: skip
        yield sep + text[:-1]
        sep = b","


def write_geojson(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as QuPath GeoJSON (:func:`to_geojson`'s document), atomically, a chunk at a time.

    By the path's ending: ``.gz``, gzip-compressed (pandas, geopandas, GDAL and
    :func:`read_geojson` read it); ``.zip``, a zip archive holding the document
    as the path's name without ``.zip`` (QuPath's File > Import objects reads
    it); otherwise plain text. Boxes that are no polygon are left out
    (:func:`polygon_rows`). A plain file can also be written in parts by
    several processes (:data:`GEOJSON_PARTS`).
    """
    parts = _geojson_chunks(dets, classes)
    name = os.path.basename(os.fspath(path))
    if name.endswith((".gz", ".zip")):
        with atomic_write(path, "wb") as raw, _compressed(raw, name) as out:
            for part in parts:
                out.write(part)
        return
    with atomic_write(path, "wb") as f:
        f.writelines(parts)


def write_geojson_part(
    path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict], prefix: str, row0: int
) -> None:
    """Write the features of the rows ``dets`` (rows ``row0...`` of a slide's detections, whose
    :func:`feature_ids` are ``prefix``) to ``path``: one part of a plain GeoJSON file, joined by
    :func:`~.atomic.write_joined` with :data:`GEOJSON_PARTS`' head, separator and tail."""
    with open(path, "wb") as f:
        f.writelines(_geojson_features(dets, classes, prefix, row0))


@contextlib.contextmanager
def _compressed(raw: IO[bytes], name: str) -> Iterator[IO[bytes]]:
    """A binary stream that compresses into ``raw``: gzip for ``*.gz``, else one zip entry."""
    if name.endswith(".gz"):
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=GZIP_LEVEL, mtime=0) as gz:
            yield gz
        return
    with (
        zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED, compresslevel=GZIP_LEVEL) as zf,
        zf.open(name.removesuffix(".zip"), "w", force_zip64=True) as entry,
    ):
        yield entry


# The CSV's columns as pandas reads them with ``pandas.read_csv(path, dtype=CSV_DTYPES)``: the same
# types for a slide without detections (a header alone, which pandas would read as text columns) as for
# one with, so that slides' tables concatenate.
CSV_DTYPES = {
    **{k: "float32" for k in ("x0", "y0", "x1", "y1", "score")},
    "label": "int32",
    "class": "string",
    **{k: "int32" for k in TILE_FIELDS},
}
CSV_HEAD = ",".join(CSV_COLUMNS) + "\r\n"
CSV_TILED_HEAD = ",".join((*CSV_COLUMNS, *TILE_FIELDS)) + "\r\n"


def write_csv(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as CSV (x0, y0, x1, y1, score, label, class; level-0 pixels, and
    tile_row, tile_col where ``dets`` has them: :func:`with_tiles`), atomically.

    Coordinates with 2 decimals, scores with 5; class names are quoted as CSV needs. The file can
    also be written in parts by several processes (:data:`CSV_PARTS`, for detections with tiles).
    """
    with atomic_write(path, "wb") as f:
        f.write((CSV_TILED_HEAD if has_tiles(dets) else CSV_HEAD).encode())
        f.writelines(_csv_rows(dets, classes))


def write_csv_part(
    path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict], prefix: str, row0: int
) -> None:
    """Write the rows ``dets`` to ``path`` as CSV lines without the header: one part of a CSV
    file, joined by :func:`~.atomic.write_joined` with :data:`CSV_PARTS`' head. (``prefix``
    and ``row0`` are not written: the arguments are those of every part writer.)"""
    with open(path, "wb") as f:
        f.writelines(_csv_rows(dets, classes))


def _csv_rows(dets: np.ndarray, classes: Sequence[dict]) -> Iterator[bytes]:
    labels, tails = _class_texts(
        dets, classes, lambda lab: f",{lab},{_csv_field(detection_class(classes, lab)['name'])}"
    )
    for start in range(0, len(dets), CHUNK):
        d = dets[start : start + CHUNK]
        x0, y0, x1, y1 = (decimal_column(d[k], 2, shortest=False) for k in ("x0", "y0", "x1", "y1"))
        tiles = [cell for k in TILE_FIELDS for cell in (b",", _int_column(d[k]))] if has_tiles(d) else []
        yield join_rows(
            [
                x0, b",", y0, b",", x1, b",", y1, b",",
                decimal_column(d["score"], 5, shortest=False),
                choice_column(np.searchsorted(labels, d["label"]), tails),
                *tiles,
                b"\r\n",
            ]
        )  # fmt: skip


def _int_column(values: np.ndarray) -> np.ndarray:
    """Integers as decimal text (few distinct values, as a slide's tile rows and columns)."""
    found = np.unique(values)
    return choice_column(np.searchsorted(found, values), [str(int(v)).encode() for v in found])


@dataclass(frozen=True)
class PartsWriter:
    """A detection file that several processes can write in parts, joined in order afterwards.

    ``write_part(path, dets, classes, prefix, row0)`` writes one part: the rows ``dets``, which are
    rows ``row0...`` of the slide's detections (``prefix``: their :func:`feature_ids`). The file
    is ``head``, the non-empty parts separated by ``sep``, then ``tail``
    (:func:`~.atomic.write_joined`); it equals what the whole-file writer makes.
    """

    write_part: Callable[..., None]
    head: str
    sep: str
    tail: str


GEOJSON_PARTS = PartsWriter(write_geojson_part, GEOJSON_HEAD, ",", GEOJSON_TAIL)
CSV_PARTS = PartsWriter(write_csv_part, CSV_TILED_HEAD, "", "")  # a run's CSV: with tiles


def _csv_field(text: str) -> str:
    """``text`` as one CSV field (quoted when it holds a comma, quote or line break)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow([text])
    return buf.getvalue()


def read_geojson(path: str | os.PathLike[str], classes: Sequence[dict] | None = None) -> np.ndarray:
    """Read detection boxes back from a GeoJSON file, plain, gzipped or zipped (the boxes' bounding rectangles).

    Labels are looked up by classification name in ``classes`` (or numbered
    in order of appearance); a missing score reads as 1.
    """
    doc = load_geojson(path)
    names = {c["name"]: i for i, c in enumerate(classes or [])}
    rows = []
    for feat in doc.get("features", []):
        props = feat.get("properties", {})
        if props.get("objectType", "detection") != "detection":
            continue
        ring = np.asarray(feat["geometry"]["coordinates"][0], np.float64)
        name = (props.get("classification") or {}).get("name", "object")
        if name not in names:
            names[name] = len(names)
        score = (props.get("measurements") or {}).get("score", 1.0)
        rows.append((*ring.min(0), *ring.max(0), score, names[name]))
    out = np.empty(len(rows), DETECTION_DTYPE)
    for i, r in enumerate(rows):
        out[i] = r
    return out


def load_geojson(path: str | os.PathLike[str]) -> dict:
    """The JSON document of a GeoJSON file, plain, gzipped or zipped; WSIPipelineError naming the file
    when it cannot be read as one."""
    try:
        with _open_geojson(path) as f:
            return json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError, zipfile.BadZipFile) as exc:
        raise WSIPipelineError(f"{path}: not a readable GeoJSON file: {exc}") from exc


@contextlib.contextmanager
def _open_geojson(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """The GeoJSON bytes of a plain, gzip or zip file (a zip: its first ``.geojson``/``.json`` entry)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == GZIP_MAGIC:
        with gzip.open(path, "rb") as gz:
            yield gz
        return
    if magic != ZIP_MAGIC:
        with open(path, "rb") as f:
            yield f
        return
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.lower().endswith((".geojson", ".json"))]
        if not names:
            raise OSError(f"expected a .geojson entry in the zip archive, found {zf.namelist()}")
        with zf.open(names[0]) as entry:
            yield entry
