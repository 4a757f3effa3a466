"""Ground truth of synthetic slides as QuPath-style GeoJSON, written as a stream.

Layout of a truth file (level-0 pixel coordinates, origin top-left, x right, y down)::

    {"type": "FeatureCollection",
     "wsiPipeline": {"kind", "seed", "width", "height", "mpp", "classNames", "regionNames"},
     "features": [
       region annotations: one (Multi)Polygon per region class present,
         properties {"objectType": "annotation", "classification": {"name", "color"}};
       objects: one Polygon box (closed 5-point ring) each,
         properties {"objectType": "detection", "classification": {"name", "color"}}
     ]}

Region "tissue" outlines all tissue (tumour included); "tumour" outlines tumour only.
``wsiPipeline`` is a GeoJSON foreign member (RFC 7946 section 6.1) that readers ignore.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import IO

import cv2
import numpy as np

from ..errors import WSIPipelineError
from ..io.atomic import atomic_write
from .scene import SyntheticScene

# Truth regions are traced on a region mask no larger than this on its longer side.
_MASK_MAX_SIDE = 4096
_MASK_MIN_DOWNSAMPLE = 4


@dataclass
class Truth:
    """Ground truth read back from a truth GeoJSON file.

    boxes (N, 4) float32 x0, y0, x1, y1 and labels (N,) int64 (indexing ``class_names``)
    of the detections; ``regions[name]`` lists the exterior rings (M, 2) float64 x, y of
    that region's polygons, closed (first point repeated), and ``region_holes[name][i]``
    the hole rings of polygon i. All in level-0 pixels.
    """

    boxes: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    regions: dict[str, list[np.ndarray]] = field(default_factory=dict)
    region_holes: dict[str, list[list[np.ndarray]]] = field(default_factory=dict)
    kind: str | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    mpp: float | None = None

    def region_mask(self, name: str, downsample: float = 1.0) -> np.ndarray:
        """Rasterise region ``name`` (holes left out): (ceil(height/d), ceil(width/d)) uint8 0/1."""
        if self.width is None or self.height is None:
            raise WSIPipelineError("truth file gives no slide size; cannot rasterise its regions")
        h = int(np.ceil(self.height / downsample))
        w = int(np.ceil(self.width / downsample))
        mask = np.zeros((h, w), np.uint8)
        s = float(1 << 4)
        for outer, holes in zip(self.regions.get(name, []), self.region_holes.get(name, []), strict=True):
            # cv2 pixel centres sit at integer coordinates: level-0 x maps to x/d - 0.5.
            rings = [np.round((r / downsample - 0.5) * s).astype(np.int32) for r in [outer, *holes]]
            cv2.fillPoly(mask, rings, 1, cv2.LINE_8, 4)
        return mask


def default_truth_path(slide_path: str | os.PathLike[str]) -> str:
    """``dir/slide.tiff`` -> ``dir/slide.truth.geojson``."""
    root, _ext = os.path.splitext(os.fspath(slide_path))
    return root + ".truth.geojson"


def _colour(c) -> list[int]:
    return [int(v) for v in c]


def _ring_coords(ring: np.ndarray) -> list[list[float]]:
    return np.round(ring, 4).tolist()


def trace_regions(scene: SyntheticScene, downsample: float | None = None) -> dict[str, list[list[np.ndarray]]]:
    """Polygons of each region class of the scene, traced on its region mask.

    Returns name -> list of polygons, each a list of closed rings (M, 2) float64 in
    level-0 pixels: the exterior first, then its holes. Industrial scenes have none.
    """
    if scene.kind != "pathology":
        return {}
    if downsample is None:
        downsample = _MASK_MIN_DOWNSAMPLE
        while max(scene.width, scene.height) / downsample > _MASK_MAX_SIDE:
            downsample *= 2
    d = downsample
    strip = 256 * d  # level-0 rows per strip: bounded memory whatever the slide size
    mask = np.concatenate(
        [scene.region_mask(0, y, scene.width, min(strip, scene.height - y), d) for y in range(0, scene.height, strip)]
    )
    out: dict[str, list[list[np.ndarray]]] = {}
    for name, binary in (("tissue", mask >= 1), ("tumour", mask == 2)):
        contours, hierarchy = cv2.findContours(binary.astype(np.uint8), cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
        if hierarchy is None:
            continue
        hierarchy = hierarchy[0]
        rings = {}
        for i, c in enumerate(contours):
            c = cv2.approxPolyDP(c, 0.7, True)[:, 0, :].astype(np.float64)
            if len(c) < 3 or abs(cv2.contourArea(c.astype(np.float32))) < 2.0:
                continue
            ring = (c + 0.5) * d
            rings[i] = np.vstack([ring, ring[:1]])
        polygons = []
        for i in rings:
            if hierarchy[i][3] < 0:  # an exterior boundary; its children are its holes
                holes = [rings[j] for j in rings if hierarchy[j][3] == i]
                polygons.append([rings[i], *holes])
        if polygons:
            out[name] = polygons
    return out


def write_truth(scene: SyntheticScene, path: str | os.PathLike[str]) -> dict[str, int]:
    """Write the scene's truth GeoJSON to ``path`` (atomically: temporary name, then
    rename), streaming detections cell by cell. Returns object counts per class name."""
    path = os.fspath(path)
    counts = {name: 0 for name in scene.class_names}
    with atomic_write(path) as fh:
        meta = {
            "kind": scene.kind,
            "seed": scene.seed,
            "width": scene.width,
            "height": scene.height,
            "mpp": scene.mpp,
            "classNames": scene.class_names,
            "regionNames": scene.region_class_names,
        }
        fh.write('{"type":"FeatureCollection","wsiPipeline":' + json.dumps(meta) + ',"features":[\n')
        first = True
        for name, polygons in trace_regions(scene).items():
            colour = scene.region_class_colors[scene.region_class_names.index(name)]
            coords = [[_ring_coords(r) for r in poly] for poly in polygons]
            geometry = (
                {"type": "Polygon", "coordinates": coords[0]}
                if len(coords) == 1
                else {"type": "MultiPolygon", "coordinates": coords}
            )
            feature = {
                "type": "Feature",
                "geometry": geometry,
                "properties": {"objectType": "annotation", "classification": {"name": name, "color": _colour(colour)}},
            }
            fh.write(("" if first else ",\n") + json.dumps(feature, separators=(",", ":")))
            first = False
        templates = [
            (
                '{"type":"Feature","geometry":{"type":"Polygon","coordinates":[[[%.4f,%.4f],'
                '[%.4f,%.4f],[%.4f,%.4f],[%.4f,%.4f],[%.4f,%.4f]]]},"properties":{"objectType":'
                '"detection","classification":{"name":'
                + json.dumps(name)
                + ',"color":'
                + json.dumps(_colour(colour))
                + "}}}"
            )
            for name, colour in zip(scene.class_names, scene.class_colors, strict=True)
        ]
        for _cx, _cy, boxes, labels in scene.iter_cells():
            _write_boxes(fh, boxes, labels, templates, first)
            if len(labels):
                first = False
            for lab in labels:
                counts[scene.class_names[lab]] += 1
        fh.write("\n]}\n")
    return counts


def _write_boxes(fh: IO[str], boxes: np.ndarray, labels: np.ndarray, templates: list[str], first: bool) -> None:
    parts = []
    for (x0, y0, x1, y1), lab in zip(boxes.tolist(), labels.tolist(), strict=True):
        parts.append(templates[lab] % (x0, y0, x1, y0, x1, y1, x0, y1, x0, y0))
    if parts:
        fh.write(("" if first else ",\n") + ",\n".join(parts))


def load_truth(path: str | os.PathLike[str]) -> Truth:
    """Read a truth GeoJSON written by :func:`write_truth` (or any QuPath-style
    FeatureCollection of detections and annotations) back into a :class:`Truth`."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise WSIPipelineError(f"{path}: cannot read truth GeoJSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("type") != "FeatureCollection":
        raise WSIPipelineError(
            f"{path}: expected a GeoJSON FeatureCollection, found "
            f"{type(doc).__name__ if not isinstance(doc, dict) else doc.get('type')!r}"
        )
    meta = doc.get("wsiPipeline") or {}
    class_names = list(meta.get("classNames") or [])
    boxes, labels = [], []
    regions: dict[str, list[np.ndarray]] = {}
    holes: dict[str, list[list[np.ndarray]]] = {}
    for feat in doc.get("features", []):
        props = feat.get("properties") or {}
        name = (props.get("classification") or {}).get("name", "")
        geom = feat.get("geometry") or {}
        if props.get("objectType") == "detection":
            ring = np.asarray(geom["coordinates"][0], np.float64)
            if name not in class_names:
                class_names.append(name)
            boxes.append((ring[:, 0].min(), ring[:, 1].min(), ring[:, 0].max(), ring[:, 1].max()))
            labels.append(class_names.index(name))
        else:
            polys = [geom["coordinates"]] if geom.get("type") == "Polygon" else geom.get("coordinates", [])
            for poly in polys:
                regions.setdefault(name, []).append(np.asarray(poly[0], np.float64))
                holes.setdefault(name, []).append([np.asarray(r, np.float64) for r in poly[1:]])
    return Truth(
        boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
        labels=np.asarray(labels, np.int64),
        class_names=class_names,
        regions=regions,
        region_holes=holes,
        kind=meta.get("kind"),
        seed=meta.get("seed"),
        width=meta.get("width"),
        height=meta.get("height"),
        mpp=meta.get("mpp"),
    )
