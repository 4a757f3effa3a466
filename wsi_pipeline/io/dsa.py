"""Detections as a large_image annotation (JSON), for HistomicsTK and the Digital Slide Archive (DSA).

One annotation document (:data:`ANNOTATION_SCHEMA`, the subset of large_image's
annotation schema this file uses, written from its documentation): ``name``,
``description``, ``attributes.wsi_pipeline`` (coordinate frame and classes) and
``elements``, one ``rectangle`` per detection: ``center`` ``[cx, cy, 0]`` and
``width``, ``height`` in level-0 pixels (large_image's image coordinates:
origin top-left, x right, y down, as ours), ``rotation`` 0, ``lineColor`` the
class colour, ``group`` and ``label.value`` the class name, ``user.score`` the
score, ``id`` 24 hex digits unique in the file (:func:`element_id_prefix`: HistomicsTK's
``parse_slide_annotations_into_tables`` reads each element's ``id``, which the server
otherwise adds on upload). Rows whose box has a coordinate that is not finite are left out
(the schema takes numbers only); boxes of zero width or height are kept.
A slide without detections gives a document without elements. The text is
built a chunk of rows at a time (:mod:`.text_rows`), as the GeoJSON's.

Upload: DSA / HistomicsUI, the item's annotation upload (or girder_client:
``gc.post(f"annotation?itemId={item}", json=json.load(f))``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from .atomic import atomic_write
from .detections import CHUNK, DETECTION_DTYPE, detection_class, feature_ids, labels_present, parse_color
from .text_rows import choice_column, decimal_column, hex_column, join_rows

_COLOR = r"^(#[0-9a-fA-F]{3}|#[0-9a-fA-F]{6}|rgb\(\d+,\s*\d+,\s*\d+\)|rgba\(\d+,\s*\d+,\s*\d+,\s*(\d?\.|)\d+\))$"
_COORD = {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3}
# large_image's annotation schema, the part this writer uses (its documentation: "Annotation Schema";
# every shape's general properties, the rectangle, colours, coordinates).
ANNOTATION_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "attributes": {"type": "object"},
        "elements": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "type": {"const": "rectangle"},
                    "id": {"type": "string", "pattern": "^[0-9a-f]{24}$"},
                    "label": {
                        "type": "object",
                        "properties": {
                            "value": {"type": "string"},
                            "visibility": {"enum": ["always", "hidden", "onhover"]},
                            "fontSize": {"type": "number"},
                            "color": {"type": "string", "pattern": _COLOR},
                        },
                        "additionalProperties": False,
                    },
                    "group": {"type": "string"},
                    "user": {"type": "object"},
                    "lineColor": {"type": "string", "pattern": _COLOR},
                    "lineWidth": {"type": "number", "minimum": 0},
                    "center": _COORD,
                    "width": {"type": "number", "minimum": 0},
                    "height": {"type": "number", "minimum": 0},
                    "rotation": {"type": "number"},
                    "normal": _COORD,
                    "fillColor": {"type": "string", "pattern": _COLOR},
                },
                "required": ["type", "center", "width", "height", "rotation"],
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}
LINE_WIDTH = 2


def _head(dets: np.ndarray, classes: Sequence[dict]) -> str:
    doc = {
        "name": "wsi-pipeline detections",
        "description": f"{len(dets)} detections, boxes in level-0 pixels",
        "attributes": {
            "wsi_pipeline": {
                "coordinates": "level-0 pixels, origin top-left",
                "classes": [
                    {"label": lab, "name": detection_class(classes, lab)["name"]} for lab in labels_present(dets)
                ],
            }
        },
    }
    return json.dumps(doc, separators=(",", ":"))[:-1] + ',"elements":['


def element_id_prefix(dets: np.ndarray) -> str:
    """The first 12 of an element's 24 hex digits (a MongoDB ObjectId's length, which
    large_image's ``id`` pattern asks for): the digest part of the detections' GeoJSON feature ids
    (:func:`~.detections.feature_ids`), so the same detections get the same ids on every run and
    other slides' detections other ids; an element's last 12 digits are its row in ``dets``."""
    return feature_ids(dets).replace("-", "")[:12]


def _elements(dets: np.ndarray, classes: Sequence[dict]) -> Iterator[bytes]:
    head = b'{"type":"rectangle","id":"' + element_id_prefix(dets).encode()
    labels = np.array(labels_present(dets), np.int64)
    styles = []
    for lab in labels.tolist():
        cls = detection_class(classes, lab)
        r, g, b = parse_color(cls.get("color", [255, 0, 0]))
        name = json.dumps(str(cls["name"]))
        styles.append(
            f'"lineColor":"rgb({r},{g},{b})","lineWidth":{LINE_WIDTH},"group":{name},"label":{{"value":{name}}}'.encode()
        )
    sep = b""
    for start in range(0, len(dets), CHUNK):
        d = dets[start : start + CHUNK]
        x0, y0, x1, y1 = (d[k].astype(np.float64) for k in ("x0", "y0", "x1", "y1"))
        keep = np.isfinite(x0 + y0 + x1 + y1 + d["score"])
        rows = np.flatnonzero(keep) + start
        if not keep.all():
            d, x0, y0, x1, y1 = d[keep], x0[keep], y0[keep], x1[keep], y1[keep]
        if not len(d):
            continue
        text = join_rows(
            [
                head, hex_column(rows, 12), b'","center":[',
                decimal_column((x0 + x1) / 2, 3, shortest=True), b",",
                decimal_column((y0 + y1) / 2, 3, shortest=True), b',0],"width":',
                decimal_column(x1 - x0, 3, shortest=True), b',"height":',
                decimal_column(y1 - y0, 3, shortest=True), b',"rotation":0,',
                choice_column(np.searchsorted(labels, d["label"]), styles),
                b',"user":{"score":', decimal_column(d["score"], 6, shortest=True), b"}},",
            ]
        )  # fmt: skip
        yield sep + text[:-1]
        sep = b","


def write_dsa(path: str | os.PathLike[str], dets: np.ndarray, classes: Sequence[dict]) -> None:
    """Write detections as a large_image annotation document (the module's), atomically."""
    with atomic_write(path, "wb") as f:
        f.write(_head(dets, classes).encode())
        f.writelines(_elements(dets, classes))
        f.write(b"]}")


def read_dsa(path: str | os.PathLike[str], classes: Sequence[dict] | None = None) -> np.ndarray:
    """Rectangles of a large_image annotation document back as detections (level-0 boxes).

    Labels are looked up by ``group`` (the class name) in ``classes``, else numbered in order of
    appearance; a missing ``user.score`` reads as 1. Elements other than rectangles are skipped.
    """
    with open(path, "rb") as f:
        doc = json.load(f)
    names = {c["name"]: i for i, c in enumerate(classes or [])}
    rows = []
    for el in doc.get("elements", []):
        if el.get("type") != "rectangle":
            continue
        name = el.get("group") or (el.get("label") or {}).get("value") or "object"
        if name not in names:
            names[name] = len(names)
        cx, cy = el["center"][:2]
        w, h = el["width"] / 2, el["height"] / 2
        rows.append((cx - w, cy - h, cx + w, cy + h, (el.get("user") or {}).get("score", 1.0), names[name]))
    return np.array(rows, DETECTION_DTYPE) if rows else np.empty(0, DETECTION_DTYPE)
