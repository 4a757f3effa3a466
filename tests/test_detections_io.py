"""Detection files: QuPath GeoJSON and CSV written from the structured array, and read back."""

import csv
import json

import numpy as np
import pytest
from helpers import random_detections

from wsi_pipeline.io.atomic import write_joined
from wsi_pipeline.io.detections import (
    CSV_PARTS,
    GEOJSON_PARTS,
    feature_ids,
    make_detections,
    read_geojson,
    to_geojson,
    with_tiles,
    write_csv,
    write_geojson,
)

CLASSES = [{"name": "spot", "color": "#ff8000"}, {"name": 'scratch, "long"', "color": [0, 0, 255]}]


def _dets(n=300, seed=0):
    return random_detections(n, seed)


def _reference_feature(d, row, id_prefix):
    """The QuPath feature of row ``row`` of the detections, written out by hand."""
    x0, y0, x1, y1 = (round(float(d[k]), 2) for k in ("x0", "y0", "x1", "y1"))
    c = CLASSES[int(d["label"])]
    color = [255, 128, 0] if c["color"] == "#ff8000" else [0, 0, 255]
    return {
        "type": "Feature",
        "id": f"{id_prefix}{row:012x}",
        "geometry": {"type": "Polygon", "coordinates": [[[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]]},
        "properties": {
            "objectType": "detection",
            "classification": {"name": c["name"], "color": color},
            "measurements": {"score": round(float(d["score"]), 6)},
        },
    }


def test_geojson_equals_the_reference_and_reads_back(tmp_path):
    dets = _dets()
    path = tmp_path / "d.geojson"
    write_geojson(path, dets, CLASSES)
    doc = json.loads(path.read_text())
    assert doc == to_geojson(dets, CLASSES)
    assert doc["type"] == "FeatureCollection"
    prefix = feature_ids(dets)
    assert doc["features"] == [_reference_feature(d, i, prefix) for i, d in enumerate(dets)]
    back = read_geojson(path, CLASSES)
    np.testing.assert_array_equal(back["label"], dets["label"])
    for k in ("x0", "y0", "x1", "y1"):
        np.testing.assert_allclose(back[k], dets[k], atol=0.006)


def test_empty_detections_make_valid_files(tmp_path):
    empty = make_detections(np.zeros((0, 4)), np.zeros(0), np.zeros(0))
    write_geojson(tmp_path / "e.geojson", empty, CLASSES)
    assert json.loads((tmp_path / "e.geojson").read_text()) == {"type": "FeatureCollection", "features": []}
    write_csv(tmp_path / "e.csv", empty, CLASSES)
    assert (tmp_path / "e.csv").read_text().splitlines() == ["x0,y0,x1,y1,score,label,class"]


def test_csv_rows_and_quoting(tmp_path):
    dets = _dets(50)
    write_csv(tmp_path / "d.csv", dets, CLASSES)
    with open(tmp_path / "d.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["x0", "y0", "x1", "y1", "score", "label", "class"]
    assert len(rows) == 51
    for row, d in zip(rows[1:], dets, strict=True):
        assert float(row[0]) == round(float(d["x0"]), 2) and float(row[4]) == round(float(d["score"]), 5)
        assert row[6] == CLASSES[int(d["label"])]["name"]  # 'scratch, "long"' survives quoting


@pytest.mark.parametrize("n_parts", [1, 2, 3, 7])
@pytest.mark.parametrize("fmt", ["geojson", "csv"])
def test_a_file_written_in_parts_equals_the_file_written_whole(tmp_path, fmt, n_parts):
    """Parts written separately (rows numbered from their place in the whole array) and joined give
    the whole-file writer's bytes, with boxes that are no polygon in between (a part of only
    such rows is empty in the GeoJSON)."""
    d = _dets(500, seed=3)
    d[40:120]["x1"] = d[40:120]["x0"]  # no area: left out of the GeoJSON
    if fmt == "csv":  # a run's CSV has the detections' tiles
        d = with_tiles(d, np.arange(len(d)) // 30, np.arange(len(d)) % 30)
    whole, parts_writer, writer = {
        "geojson": ("whole.geojson", GEOJSON_PARTS, write_geojson),
        "csv": ("whole.csv", CSV_PARTS, write_csv),
    }[fmt]
    writer(tmp_path / whole, d, CLASSES)
    bounds = [0, 40, 120, 500] if n_parts == 3 else np.linspace(0, len(d), n_parts + 1).astype(int).tolist()
    paths = [tmp_path / f"part{i}" for i in range(len(bounds) - 1)]
    prefix = feature_ids(d)
    for path, a, b in zip(paths, bounds[:-1], bounds[1:], strict=True):
        parts_writer.write_part(path, d[a:b], CLASSES, prefix, a)
    if n_parts == 3 and fmt == "geojson":
        assert paths[1].stat().st_size == 0
    write_joined(tmp_path / "joined", paths, parts_writer.head, parts_writer.sep, parts_writer.tail)
    assert (tmp_path / "joined").read_bytes() == (tmp_path / whole).read_bytes()
    assert not any(p.exists() for p in paths)  # the parts are removed once joined


def test_a_join_that_fails_leaves_no_file_and_no_parts(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("1")
    with pytest.raises(FileNotFoundError):
        write_joined(tmp_path / "out", [a, b], "[", ",", "]")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
