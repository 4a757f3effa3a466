"""Detections in slide coordinates and their files (QuPath GeoJSON, CSV).

A slide's detections are a numpy structured array with fields
``x0, y0, x1, y1`` (float32, level-0 pixels, origin top-left), ``score``
(float32) and ``label`` (int32, index into the model's classes);
``pandas.DataFrame(detections)`` turns it into a table.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence

import numpy as np

from ..errors import WSIPipelineError
from .atomic import atomic_write

DETECTION_DTYPE = np.dtype(
    [("x0", "<f4"), ("y0", "<f4"), ("x1", "<f4"), ("y1", "<f4"), ("score", "<f4"), ("label", "<i4")]
)
CSV_COLUMNS = ("x0", "y0", "x1", "y1", "score", "label", "class")


def make_detections(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Pack ``boxes`` (Nx4 x0, y0, x1, y1), ``scores`` (N) and ``labels`` (N) into the record array."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    out = np.empty(len(boxes), DETECTION_DTYPE)
    for i, name in enumerate(("x0", "y0", "x1", "y1")):
        out[name] = boxes[:, i]
    out["score"] = np.asarray(scores, np.float32).reshape(-1)
    out["label"] = np.asarray(labels).reshape(-1).astype(np.int32)
    return out


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

    Each Feature: a closed Polygon ring (coordinates rounded to 0.01 px),
    ``properties.objectType: "detection"``, ``properties.classification:
    {name, color}`` (color as [r, g, b]) and ``properties.measurements:
    {score: ...}`` (rounded to 1e-6). :func:`write_geojson` writes the same
    document.

    >>> d = make_detections([[10, 20, 30.5, 40]], [0.9], [0])
    >>> f = to_geojson(d, [{"name": "nucleus", "color": "#ff0000"}])["features"][0]
    >>> f["geometry"]["coordinates"][0][:3], f["properties"]["classification"]
    ([[10.0, 20.0], [30.5, 20.0], [30.5, 40.0]], {'name': 'nucleus', 'color': [255, 0, 0]})
    """
    return json.loads("".join(_geojson_chunks(dets, classes)))


_FEATURE = ('{"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[%s,%s],[%s,%s],[%s,%s],[%s,%s],'
            '[%s,%s]]]},"properties":{"objectType":"detection","classification":%s,'
            '"measurements":{"score":%s}}}')


def _num(v: np.ndarray, decimals: int) -> list[str]:
    """Shortest decimal strings of ``v`` rounded to ``decimals`` (JSON numbers)."""
    return [repr(x) for x in np.round(v.astype(np.float64), decimals).tolist()]


def _geojson_chunks(dets: np.ndarray, classes: Sequence[dict], chunk: int = 65536):
    # Formatting rows from a template is ~10x faster than json.dump of nested dicts,
    # which matters at the 10^5-10^6 detections of a whole slide.
    labels_present = np.unique(dets["label"]).tolist() if len(dets) else []
    cls_json = {lab: json.dumps({"name": detection_class(classes, lab)["name"],
                                 "color": list(parse_color(detection_class(classes, lab).get("color", [255, 0, 0])))},
                                separators=(",", ":"))
                for lab in labels_present}
    yield '{"type":"FeatureCollection","features":['
    for start in range(0, len(dets), chunk):
        d = dets[start:start + chunk]
        x0, y0, x1, y1 = (_num(d[k], 2) for k in ("x0", "y0", "x1", "y1"))
        sc = _num(d["score"], 6)
        labels = d["label"].tolist()
        rows = [_FEATURE % (a, b, c, b, c, e, a, e, a, b, cls_json[lab], s_)
                for a, b, c, e, s_, lab in zip(x0, y0, x1, y1, sc, labels, strict=True)]
        yield ("," if start else "") + ",".join(rows)
    yield "]}"


def write_geojson(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as QuPath GeoJSON (:func:`to_geojson`'s document), atomically."""
    with atomic_write(path) as f:
        for part in _geojson_chunks(dets, classes):
            f.write(part)


def write_csv(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as CSV (x0, y0, x1, y1, score, label, class; level-0 pixels), atomically.

    Coordinates with 2 decimals, scores with 5; class names are quoted as CSV needs.
    """
    labels = np.unique(dets["label"]).tolist() if len(dets) else []
    names = {lab: _csv_field(detection_class(classes, int(lab))["name"]) for lab in labels}
    with atomic_write(path, newline="") as f:
        f.write(",".join(CSV_COLUMNS) + "\r\n")
        for start in range(0, len(dets), 65536):
            d = dets[start:start + 65536]
            cols = [d[k].astype(np.float64).tolist() for k in ("x0", "y0", "x1", "y1", "score")]
            rows = [f"{a:.2f},{b:.2f},{c:.2f},{e:.2f},{sc:.5f},{lab},{names[lab]}\r\n"
                    for a, b, c, e, sc, lab in zip(*cols, d["label"].tolist(), strict=True)]
            f.write("".join(rows))


def _csv_field(text: str) -> str:
    """``text`` as one CSV field (quoted when it holds a comma, quote or line break)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow([text])
    return buf.getvalue()


def read_geojson(path: str | os.PathLike[str], classes: Sequence[dict] | None = None) -> np.ndarray:
    """Read detection boxes back from a GeoJSON file (the boxes' bounding rectangles).

    Labels are looked up by classification name in ``classes`` (or numbered
    in order of appearance); a missing score reads as 1.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise WSIPipelineError(f"{path}: not a readable GeoJSON file: {exc}") from exc
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
