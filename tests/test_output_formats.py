"""Output formats: gzipped GeoJSON, Parquet and GeoParquet read back with the users' readers,
QuPath's rules for GeoJSON features, and the choice of formats in the config, CLI and run."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import uuid
import zipfile

import numpy as np
import pytest
from helpers import random_detections

from wsi_pipeline import Pipeline
from wsi_pipeline.batch.resume import RunKey
from wsi_pipeline.batch.runner import resume_state
from wsi_pipeline.commands.run import build_config
from wsi_pipeline.config import RunConfig, load_config
from wsi_pipeline.errors import ConfigError, WSIPipelineError
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.io import detections as detections_io
from wsi_pipeline.io import formats as formats_io
from wsi_pipeline.io import parquet as parquet_io
from wsi_pipeline.io.detections import make_detections, polygon_rows, read_geojson, write_geojson
from wsi_pipeline.io.formats import DEFAULT_FORMATS, FORMATS, output_files, parse_formats
from wsi_pipeline.io.parquet import write_geoparquet, write_parquet
from wsi_pipeline.outputs import OUTPUT_FILES
from wsi_pipeline.pipeline import DEFAULT_MODEL
from wsi_pipeline.synthetic import write_synthetic_slide

_WHY = "the format validators come with the dev extra"
gpd = pytest.importorskip("geopandas", reason=_WHY)
pd = pytest.importorskip("pandas", reason=_WHY)
pq = pytest.importorskip("pyarrow.parquet", reason=_WHY)
shapely = pytest.importorskip("shapely", reason=_WHY)
load_run = pytest.importorskip("wsi_pipeline.review.results", reason=_WHY, exc_type=ImportError).load_run

CLASSES = [{"name": "spot", "color": "#ff8000"}, {"name": "scratch", "color": [0, 0, 255]}]


def _dets(n=500, seed=0):
    return random_detections(n, seed)


def _with_degenerate(dets):
    """Rows 3 (zero width), 7 (zero height), 11 (width 0.001: zero at the GeoJSON's 0.01 px) and
    13 (NaN) have no area."""
    d = dets.copy()
    d["x1"][3] = d["x0"][3]
    d["y1"][7] = d["y0"][7]
    d["x0"][11] = np.float32(100.0)
    d["x1"][11] = np.float32(100.001)
    d["y0"][13] = np.nan
    return d


# -- GeoJSON: QuPath's rules, gzip ---------------------------------------------------


def _check_qupath_features(doc, dets):
    """Every feature as QuPath imports it: closed non-degenerate ring, classification with name and
    [r, g, b] colour, a UUID id whose last 12 hex digits are the detection's row."""
    assert doc["type"] == "FeatureCollection"
    ids = []
    for feat in doc["features"]:
        assert feat["type"] == "Feature" and feat["geometry"]["type"] == "Polygon"
        ring = np.asarray(feat["geometry"]["coordinates"][0])
        assert ring.shape == (5, 2) and (ring[0] == ring[-1]).all()
        assert ring[:, 0].max() > ring[:, 0].min() and ring[:, 1].max() > ring[:, 1].min()
        assert shapely.Polygon(ring).is_valid and shapely.Polygon(ring).area > 0
        cls = feat["properties"]["classification"]
        assert set(cls) == {"name", "color"}
        assert len(cls["color"]) == 3 and all(isinstance(v, int) and 0 <= v <= 255 for v in cls["color"])
        assert feat["properties"]["objectType"] == "detection"
        ids.append(feat["id"])
        row = int(feat["id"][-12:], 16)
        assert ring[0].tolist() == [round(float(dets[k][row]), 2) for k in ("x0", "y0")]
        assert cls["name"] == CLASSES[int(dets["label"][row])]["name"]
    assert all(str(uuid.UUID(i)) == i for i in ids)
    assert len(set(ids)) == len(ids)
    return ids


def test_boxes_without_area_are_left_out_of_the_geojson(tmp_path):
    dets = _with_degenerate(_dets())
    assert np.flatnonzero(~polygon_rows(dets)).tolist() == [3, 7, 11, 13]
    write_geojson(tmp_path / "d.geojson", dets, CLASSES)
    doc = json.loads((tmp_path / "d.geojson").read_text())
    assert len(doc["features"]) == len(dets) - 4
    ids = _check_qupath_features(doc, dets)
    assert [int(i[-12:], 16) for i in ids] == [i for i in range(len(dets)) if i not in (3, 7, 11, 13)]
    assert formats_io.detection_notes(["csv", "geojson.zip"], dets) == {"geojson_left_out": 4}
    assert formats_io.detection_notes(["csv", "parquet"], dets) == {}


def test_gzipped_geojson_is_the_same_document_and_reads_back(tmp_path, monkeypatch):
    # Several chunks, one of them made only of boxes without area (no stray commas).
    monkeypatch.setattr(detections_io, "CHUNK", 4)
    dets = _dets(40)
    dets["x1"][4:8] = dets["x0"][4:8]
    write_geojson(tmp_path / "d.geojson", dets, CLASSES)
    write_geojson(tmp_path / "d.geojson.gz", dets, CLASSES)
    raw = (tmp_path / "d.geojson.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"
    assert gzip.decompress(raw) == (tmp_path / "d.geojson").read_bytes()
    with gzip.open(tmp_path / "d.geojson.gz", "rt", encoding="utf-8") as f:
        doc = json.load(f)
    assert len(doc["features"]) == 36
    _check_qupath_features(doc, dets)
    back = read_geojson(tmp_path / "d.geojson.gz", CLASSES)
    kept = polygon_rows(dets)
    np.testing.assert_array_equal(back["label"], dets["label"][kept])
    np.testing.assert_allclose(back["x0"], dets["x0"][kept], atol=0.006)
    # The same detections give the same bytes (ids included) on every write; sorted paths differ.
    write_geojson(tmp_path / "again.geojson.gz", dets.copy(), CLASSES)
    assert (tmp_path / "again.geojson.gz").read_bytes() == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.geojson.gz", "d.geojson", "d.geojson.gz"]


def test_zipped_geojson_holds_the_document_as_qupath_reads_it(tmp_path):
    dets = _with_degenerate(_dets(300))
    write_geojson(tmp_path / "d.geojson", dets, CLASSES)
    write_geojson(tmp_path / "d.geojson.zip", dets, CLASSES)
    with zipfile.ZipFile(tmp_path / "d.geojson.zip") as zf:
        assert zf.namelist() == ["d.geojson"]  # QuPath imports the .geojson entries of a .zip
        assert zf.getinfo("d.geojson").compress_type == zipfile.ZIP_DEFLATED
        assert zf.read("d.geojson") == (tmp_path / "d.geojson").read_bytes()
        _check_qupath_features(json.loads(zf.read("d.geojson")), dets)
    back = read_geojson(tmp_path / "d.geojson.zip", CLASSES)
    assert len(back) == len(dets) - 4
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "no objects")
    with pytest.raises(WSIPipelineError, match=r"other.zip: not a readable GeoJSON file: expected a .geojson"):
        read_geojson(tmp_path / "other.zip")


def test_other_detections_get_other_ids(tmp_path):
    a, b = _dets(5, seed=1), _dets(5, seed=2)
    ids_a = [f["id"] for f in detections_io.to_geojson(a, CLASSES)["features"]]
    ids_b = [f["id"] for f in detections_io.to_geojson(b, CLASSES)["features"]]
    assert not set(ids_a) & set(ids_b)


def test_a_truncated_gzip_file_is_a_pipeline_error(tmp_path):
    write_geojson(tmp_path / "d.geojson.gz", _dets(2000), CLASSES)
    data = (tmp_path / "d.geojson.gz").read_bytes()
    (tmp_path / "cut.geojson.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(WSIPipelineError, match="cut.geojson.gz: not a readable GeoJSON"):
        read_geojson(tmp_path / "cut.geojson.gz")


# -- Parquet and GeoParquet ----------------------------------------------------------


def test_parquet_reads_back_with_pandas_in_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_io, "ROW_GROUP", 128)
    dets = _with_degenerate(_dets(500))
    dets["label"][0] = 5  # a label past the card's classes
    write_parquet(tmp_path / "d.parquet", dets, CLASSES)
    assert pq.ParquetFile(tmp_path / "d.parquet").metadata.num_row_groups == 4
    df = pd.read_parquet(tmp_path / "d.parquet")
    assert list(df.columns) == ["x0", "y0", "x1", "y1", "score", "label", "class"]
    assert [str(t) for t in df.dtypes[:6]] == ["float32"] * 5 + ["int32"]
    assert len(df) == len(dets)  # every detection, those without area included
    for k in ("x0", "y0", "x1", "y1", "score", "label"):
        np.testing.assert_array_equal(df[k].to_numpy(), dets[k])
    assert df["class"].astype(str).tolist() == [
        "class_5" if lab == 5 else CLASSES[lab]["name"] for lab in dets["label"].tolist()
    ]
    meta = json.loads(pq.read_schema(tmp_path / "d.parquet").metadata[b"wsi_pipeline"])
    assert meta["coordinates"].startswith("level-0 pixels")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]  # no partial file left


def test_geoparquet_reads_back_as_a_geodataframe(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_io, "ROW_GROUP", 100)
    dets = _dets(250)
    write_geoparquet(tmp_path / "d.parquet", dets, CLASSES)
    gdf = gpd.read_parquet(tmp_path / "d.parquet")
    assert isinstance(gdf, gpd.GeoDataFrame) and gdf.geometry.name == "geometry"
    assert gdf.crs is None and len(gdf) == len(dets)
    assert (gdf.geom_type == "Polygon").all() and gdf.is_valid.all()
    bounds = gdf.geometry.bounds.to_numpy()
    np.testing.assert_array_equal(bounds, np.stack([dets[k] for k in ("x0", "y0", "x1", "y1")], 1))
    np.testing.assert_allclose(gdf.area, (dets["x1"] - dets["x0"]).astype(float) * (dets["y1"] - dets["y0"]))
    geo = json.loads(pq.read_schema(tmp_path / "d.parquet").metadata[b"geo"])
    assert geo["primary_column"] == "geometry"
    assert geo["columns"]["geometry"]["encoding"] == "WKB"
    np.testing.assert_allclose(geo["columns"]["geometry"]["bbox"], gdf.total_bounds)


def test_geoparquet_has_a_bbox_covering_and_row_groups_readers_skip_by_location(tmp_path, monkeypatch):
    """GeoParquet 1.1: a ``bbox`` struct column named as the geometry's covering, row-group
    statistics of its fields, row groups that are bands of the slide (detections top to bottom);
    geopandas' bbox filter and DuckDB's predicates read it."""
    import duckdb

    monkeypatch.setattr(parquet_io, "ROW_GROUP", 64)
    dets = _dets(500)
    dets = dets[np.argsort(dets["y0"], kind="stable")]  # a run's order: top to bottom
    path = tmp_path / "d.parquet"
    write_geoparquet(path, dets, CLASSES)
    schema = pq.read_schema(path)
    column = json.loads(schema.metadata[b"geo"])["columns"]["geometry"]
    assert column["covering"] == {"bbox": {k: ["bbox", k] for k in ("xmin", "ymin", "xmax", "ymax")}}
    bbox_type = schema.field("bbox").type
    assert [(f.name, str(f.type)) for f in bbox_type] == [(k, "double") for k in ("xmin", "ymin", "xmax", "ymax")]
    table = pq.read_table(path)
    for k, src in zip(("xmin", "ymin", "xmax", "ymax"), ("x0", "y0", "x1", "y1"), strict=True):
        np.testing.assert_array_equal(table.column("bbox").combine_chunks().field(k).to_numpy(), dets[src])
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 8
    paths = [meta.row_group(0).column(i).path_in_schema for i in range(meta.num_columns)]
    ymin = paths.index("bbox.ymin")
    bands = []
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(ymin).statistics
        assert stats is not None and stats.has_min_max
        bands.append((stats.min, stats.max))
    assert all(a[1] <= b[0] for a, b in zip(bands, bands[1:], strict=False))  # bands, top to bottom
    region = (10000.0, 15000.0, 25000.0, 26000.0)
    inside = (
        (dets["x1"] >= region[0]) & (dets["y1"] >= region[1]) & (dets["x0"] <= region[2]) & (dets["y0"] <= region[3])
    )
    assert 0 < inside.sum() < len(dets)
    picked = gpd.read_parquet(path, bbox=region)
    assert sorted(picked["x0"].tolist()) == sorted(dets["x0"][inside].tolist())
    query = (
        f"SELECT count(*) FROM '{path}' WHERE bbox.xmax >= {region[0]} AND bbox.ymax >= {region[1]} "
        f"AND bbox.xmin <= {region[2]} AND bbox.ymin <= {region[3]}"
    )
    assert duckdb.sql(query).fetchall() == [(int(inside.sum()),)]


def test_empty_detections_make_readable_tables(tmp_path):
    empty = make_detections(np.zeros((0, 4)), np.zeros(0), np.zeros(0))
    write_parquet(tmp_path / "e.parquet", empty, CLASSES)
    write_geoparquet(tmp_path / "e.geoparquet", empty, CLASSES)
    df = pd.read_parquet(tmp_path / "e.parquet")
    assert len(df) == 0 and list(df.columns) == ["x0", "y0", "x1", "y1", "score", "label", "class"]
    gdf = gpd.read_parquet(tmp_path / "e.geoparquet")
    assert isinstance(gdf, gpd.GeoDataFrame) and len(gdf) == 0


def test_dsa_annotations_meet_large_images_schema_and_read_back(tmp_path):
    """Rectangles in level-0 pixels with the class as group and label and the score in ``user``; a box with
    a coordinate that is not a number is left out (the schema takes numbers); none make an empty list."""
    import jsonschema

    from wsi_pipeline.io.dsa import ANNOTATION_SCHEMA, read_dsa, write_dsa

    dets = _with_degenerate(_dets(300))
    write_dsa(tmp_path / "d.dsa.json", dets, CLASSES)
    doc = json.loads((tmp_path / "d.dsa.json").read_text())
    jsonschema.validate(doc, ANNOTATION_SCHEMA)
    kept = np.isfinite(detections_io.detection_boxes(dets)).all(1)
    assert len(doc["elements"]) == kept.sum() == len(dets) - 1
    first = doc["elements"][0]
    assert first["group"] == first["label"]["value"] == CLASSES[int(dets["label"][0])]["name"]
    assert first["lineColor"] == "rgb(255,128,0)" if dets["label"][0] == 0 else "rgb(0,0,255)"
    back = read_dsa(tmp_path / "d.dsa.json", CLASSES)
    want = dets[kept]
    np.testing.assert_allclose(detections_io.detection_boxes(back), detections_io.detection_boxes(want), atol=2e-3)
    np.testing.assert_allclose(back["score"], want["score"], atol=1e-6)
    np.testing.assert_array_equal(back["label"], want["label"])
    write_dsa(tmp_path / "e.dsa.json", dets[:0], CLASSES)
    empty = json.loads((tmp_path / "e.dsa.json").read_text())
    jsonschema.validate(empty, ANNOTATION_SCHEMA)
    assert empty["elements"] == [] and len(read_dsa(tmp_path / "e.dsa.json")) == 0
    bad = {**doc, "elements": [{**first, "center": [1, 2]}]}  # the schema does catch what large_image refuses
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, ANNOTATION_SCHEMA)


def test_dsa_elements_have_unique_ids_as_histomicstk_reads_them(tmp_path):
    """Each element's ``id`` is 24 hex digits, unique in the file, stable for the same detections,
    other for other detections; its last 12 are the detection's row (as in the GeoJSON ids). The
    elements read as HistomicsTK's ``parse_slide_annotations_into_tables`` reads them: ``id``,
    ``type``, ``group``, the box truncated to integers."""
    from wsi_pipeline.io.dsa import ANNOTATION_SCHEMA, write_dsa

    jsonschema = pytest.importorskip("jsonschema", reason=_WHY)
    dets = _with_degenerate(_dets(300))
    write_dsa(tmp_path / "d.dsa.json", dets, CLASSES)
    doc = json.loads((tmp_path / "d.dsa.json").read_text())
    jsonschema.validate(doc, ANNOTATION_SCHEMA)
    ids = [el["id"] for el in doc["elements"]]
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids) == len(dets) - 1
    rows = [int(i[12:], 16) for i in ids]
    assert rows == [r for r in range(len(dets)) if r != 13]  # row 13 (NaN) is left out
    assert len({i[:12] for i in ids}) == 1
    write_dsa(tmp_path / "again.dsa.json", dets.copy(), CLASSES)
    assert [el["id"] for el in json.loads((tmp_path / "again.dsa.json").read_text())["elements"]] == ids
    write_dsa(tmp_path / "other.dsa.json", _dets(300, seed=1), CLASSES)
    other = json.loads((tmp_path / "other.dsa.json").read_text())["elements"]
    assert not {el["id"] for el in other} & set(ids)
    # HistomicsTK's table: one row per element from its id, type, group and integer box.
    table = []
    for el in doc["elements"]:
        cx, cy, _ = el["center"]
        xmin, ymin = int(cx - el["width"] / 2), int(cy - el["height"] / 2)
        table.append((el["id"], el["type"], el["group"], xmin, ymin))
    assert len({row[0] for row in table}) == len(table)


# -- choosing formats ----------------------------------------------------------------


def test_formats_are_parsed_into_the_registry_order():
    assert RunConfig().formats == DEFAULT_FORMATS == ("geojson", "csv", "ome-tiff", "overlay")
    assert parse_formats("parquet, geojson.gz,parquet") == ("geojson.gz", "parquet")
    assert parse_formats("geoparquet,parquet") == parse_formats(["geoparquet"]) == ("geoparquet",)
    assert output_files(["geoparquet"]) == ["detections.parquet", "summary.json"]
    assert RunConfig(formats=["csv", "GeoJSON"]).formats == ("geojson", "csv")
    assert output_files(DEFAULT_FORMATS) == list(OUTPUT_FILES)
    assert output_files(("parquet", "ome-tiff"), heatmap=False) == ["detections.parquet", "summary.json"]
    assert {f.kind for f in FORMATS.values()} == {"detections", "heatmap", "heatmap-file", "overlay"}
    for f in FORMATS.values():
        if f.writer is not None:
            assert callable(f.write_function())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("geojson,shapefile", "formats: unknown format 'shapefile' (known: geojson, geojson.gz, geojson.zip, csv"),
        ("", "formats: expected at least one of geojson"),
        ([1, 2], "formats: expected format names, found [1, 2]"),
    ],
)
def test_bad_formats_are_refused(value, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(formats=value)
    assert message in str(err.value)


def test_a_format_without_its_library_names_the_extra(monkeypatch):
    real = formats_io.importlib.util.find_spec
    monkeypatch.setattr(formats_io.importlib.util, "find_spec", lambda name: None if name == "pyarrow" else real(name))
    with pytest.raises(
        ConfigError,
        match=r"parquet needs pyarrow, which is not installed: "
        r"pip install 'wsi-pipeline\[parquet\]'",
    ):
        RunConfig(formats="csv,parquet")
    assert RunConfig(formats="csv,geojson.gz").formats == ("geojson.gz", "csv")


def test_formats_from_toml_and_the_command_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('formats = ["parquet", "geojson.gz"]\n')
    assert load_config(toml).formats == ("geojson.gz", "parquet")
    toml.write_text("formats = 3\n")
    with pytest.raises(
        ConfigError,
        match=r"run.toml: formats: expected a list of names or a comma-separated "
        r"string, found int 3",
    ):
        load_config(toml)
    toml.write_text('formats = "csv,nope"\n')
    with pytest.raises(ConfigError, match=r"run.toml: formats: unknown format 'nope'"):
        load_config(toml)
    from wsi_pipeline.cli import build_parser

    args = build_parser().parse_args(["run", "x.tiff", "--out", str(tmp_path), "--formats", "geoparquet,csv"])
    assert build_config(args).formats == ("csv", "geoparquet")


def test_an_unknown_format_on_the_command_line_is_one_usage_error(slide_path, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "wsi_pipeline",
            "run",
            str(slide_path),
            "--out",
            str(tmp_path / "o"),
            "--formats",
            "geojson,shp",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: options: formats: unknown format 'shp' (known: geojson, geojson.gz, geojson.zip, csv, parquet, "
        "geoparquet, dsa, dicom, ome-tiff, ome-zarr, dicom-heatmap, overlay)"
    ]
    assert not (tmp_path / "o").exists()


def test_the_resume_key_covers_formats_and_keeps_default_keys():
    card = load_card(DEFAULT_MODEL)
    default = RunKey.of(RunConfig(), card)
    settings = RunConfig().result_key()
    del settings["formats"]
    for k in ("model", "mask"):
        settings.pop(k)
    from wsi_pipeline.batch.resume import settings_digest

    assert default.parts["settings"] == settings_digest(settings)  # as before formats could be chosen
    assert RunKey.of(RunConfig(formats="overlay,csv,ome-tiff,geojson"), card) == default
    other = RunKey.of(RunConfig(formats="geojson.gz,parquet"), card)
    assert other.value != default.value and other.changes_from(default.parts) == ["the settings"]


def test_resume_needs_the_files_the_summary_lists(tmp_path):
    slide = tmp_path / "s.tiff"
    slide.write_bytes(b"x" * 100)
    key = RunKey({"settings": "a"})
    folder = tmp_path / "out"
    folder.mkdir()
    from wsi_pipeline.file_identity import input_identity

    summary = {"run_key": key.value, "input": input_identity(slide), "files": ["detections.parquet", "summary.json"]}
    (folder / "summary.json").write_text(json.dumps(summary))
    assert resume_state(folder, key, slide)[1] == "its outputs are incomplete (no detections.parquet)"
    (folder / "detections.parquet").write_bytes(b"")
    assert resume_state(folder, key, slide)[1] is None  # no GeoJSON, CSV or heatmap asked for


# -- a run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("formats") / "tissue.tiff"
    write_synthetic_slide(path, 1536, 1536, seed=3, kind="pathology")
    return path


def test_a_run_writes_the_chosen_formats_and_lists_them(slide_path, tmp_path):
    """GeoParquet is written as ``detections.parquet`` (GeoParquet 1.1: not ``.geoparquet``), read by
    geopandas, pyarrow and DuckDB; ``parquet`` beside it is that one file. The CSV and Parquet rows
    carry their tile."""
    import duckdb

    with Pipeline(
        backend="ort", formats="geojson.gz,geojson.zip,csv,parquet,geoparquet,dsa", writer_processes=0
    ) as pipe:
        result = pipe.run(slide_path, out_dir=tmp_path / "run")
        plan = pipe.plan(slide_path)
        geometry = plan.geometry
        plan.close()
    out = tmp_path / "run"
    files = [
        "detections.geojson.gz",
        "detections.geojson.zip",
        "detections.csv",
        "detections.parquet",
        "detections.dsa.json",
        "summary.json",
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # no heatmap.ome.tif, no overlay
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"] == files
    assert summary["parameters"]["formats"] == ["geojson.gz", "geojson.zip", "csv", "geoparquet", "dsa"]
    assert summary["geojson_left_out"] == 0
    assert summary["heatmap_scores"] is not None  # the heatmap is still blended and measured
    assert result.heatmap is None
    n = len(result.detections)
    assert n > 0
    with gzip.open(out / "detections.geojson.gz", "rt", encoding="utf-8") as f:
        assert len(json.load(f)["features"]) == n
    with zipfile.ZipFile(out / "detections.geojson.zip") as zf:
        assert zf.read("detections.geojson") == gzip.decompress((out / "detections.geojson.gz").read_bytes())
    df = pd.read_parquet(out / "detections.parquet")
    np.testing.assert_array_equal(df["x0"].to_numpy(), result.detections["x0"])
    assert set(df["class"].astype(str)) == {"nucleus"}
    gdf = gpd.read_parquet(out / "detections.parquet")
    assert len(gdf) == n and (gdf.geom_type == "Polygon").all()
    assert json.loads(pq.read_schema(out / "detections.parquet").metadata[b"geo"])["version"] == "1.1.0"
    path = str(out / "detections.parquet")
    assert duckdb.sql(f"SELECT count(*) FROM '{path}'").fetchall() == [(n,)]
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{path}')").fetchall() == [(n,)]
    # Each detection's tile: the one whose core holds its centre, so whose whole extent holds it too.
    csv = pd.read_csv(out / "detections.csv")
    np.testing.assert_array_equal(csv[["tile_row", "tile_col"]].to_numpy(), df[["tile_row", "tile_col"]].to_numpy())
    cx, cy = (df.x0 + df.x1) / 2, (df.y0 + df.y1) / 2
    x0, y0 = geometry.col_x0_level0(df.tile_col.to_numpy()), geometry.row_y0_level0(df.tile_row.to_numpy())
    assert ((cx >= x0) & (cx < x0 + geometry.tile_extent_level0)).all()
    assert ((cy >= y0) & (cy < y0 + geometry.tile_extent_level0)).all()
    assert df.tile_row.nunique() > 1 and df.tile_col.nunique() > 1
    assert len(json.loads((out / "detections.dsa.json").read_text())["elements"]) == n
    review = load_run(out)  # the review helpers find the zipped GeoJSON
    assert len(review.detections) == n and review.heatmap is None
    np.testing.assert_allclose(review.detections["x0"], result.detections["x0"], atol=0.006)


def test_a_slide_without_detections_keeps_every_tables_schema(slide_path, tmp_path):
    """A slide with no detections writes the same CSV header and the same typed Parquet and
    GeoParquet columns as one with, so that slides' tables concatenate without losing their types."""
    runs = {}
    for name, threshold in (("some", 0.5), ("none", 1.0)):
        with Pipeline(backend="ort", formats="csv,geoparquet", score_threshold=threshold, writer_processes=0) as pipe:
            runs[name] = pipe.run(slide_path, out_dir=tmp_path / name)
    assert len(runs["some"].detections) > 0 and len(runs["none"].detections) == 0
    some, none = tmp_path / "some", tmp_path / "none"
    header = (some / "detections.csv").read_text().splitlines()[0]
    assert (none / "detections.csv").read_text().splitlines() == [header]
    csvs = [pd.read_csv(d / "detections.csv", dtype=detections_io.CSV_DTYPES) for d in (some, none)]
    assert csvs[0].dtypes.to_dict() == csvs[1].dtypes.to_dict()
    assert list(csvs[1].columns) == list(detections_io.CSV_DTYPES)
    joined = pd.concat(csvs, ignore_index=True)
    assert joined.dtypes.to_dict() == csvs[0].dtypes.to_dict() and len(joined) == len(csvs[0])
    schemas = [pq.read_schema(d / "detections.parquet") for d in (some, none)]
    assert schemas[0].equals(schemas[1], check_metadata=False)
    tables = [pd.read_parquet(d / "detections.parquet") for d in (some, none)]
    # ``class`` is categorical in both (Parquet keeps no dictionary for a column without values).
    assert all(isinstance(t["class"].dtype, pd.CategoricalDtype) for t in tables)
    assert tables[0].drop(columns="class").dtypes.to_dict() == tables[1].drop(columns="class").dtypes.to_dict()
    assert str(tables[1]["x0"].dtype) == "float32" and str(tables[1]["tile_row"].dtype) == "int32"
    frames = [gpd.read_parquet(d / "detections.parquet") for d in (some, none)]
    assert list(frames[0].columns) == list(frames[1].columns) and frames[1].geometry.name == "geometry"
    joined = pd.concat(frames).drop(columns="class")
    assert joined.dtypes.to_dict() == frames[0].drop(columns="class").dtypes.to_dict()
    api = [r.to_dataframe() for r in runs.values()]
    assert api[0].dtypes.to_dict() == api[1].dtypes.to_dict()
    assert str(api[1]["score"].dtype) == "float32" and str(api[1]["class"].dtype) == "string"
    review = load_run(none)
    assert review.detections.dtype == detections_io.DETECTION_DTYPE and len(review.detections) == 0


def test_a_dicom_heatmap_needs_the_ome_tiff_it_is_made_from():
    with pytest.raises(ConfigError, match=r"formats: dicom-heatmap is made from ome-tiff; add ome-tiff"):
        RunConfig(formats="geojson,dicom-heatmap")
    assert RunConfig(formats="dicom-heatmap,ome-tiff").formats == ("ome-tiff", "dicom-heatmap")


def test_a_run_writes_ome_zarr_and_dicom_through_the_writer_processes(slide_path, tmp_path):
    """The heatmap as OME-Zarr (streamed beside the OME-TIFF) and as DICOM Parametric Maps (made from
    the OME-TIFF), the detections as DICOM annotations, read back with their users' readers."""
    import highdicom as hd
    import pydicom
    import tifffile
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    from wsi_pipeline.io.dicom import parametric_map_file_names
    from wsi_pipeline.io.dicom_source import PLACEHOLDER_ATTRIBUTES

    with Pipeline(backend="ort", formats="dicom,ome-tiff,ome-zarr,dicom-heatmap") as pipe:
        result = pipe.run(slide_path, out_dir=tmp_path / "run")
    out = tmp_path / "run"
    files = ["detections.dcm", "heatmap.ome.tif", "heatmap.ome.zarr", "heatmap_dicom", "summary.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert json.loads((out / "summary.json").read_text())["files"] == files
    n = len(result.detections)
    assert n > 0

    ann = hd.ann.annread(out / "detections.dcm")
    groups = ann.get_annotation_groups()
    assert [g.label for g in groups] == ["nucleus"]
    polygons = groups[0].get_graphic_data("2D")
    assert len(polygons) == n
    got = np.array([[p[:, 0].min(), p[:, 1].min(), p[:, 0].max(), p[:, 1].max()] for p in polygons])
    want = np.stack([result.detections[k] for k in ("x0", "y0", "x1", "y1")], axis=1)
    np.testing.assert_allclose(got[np.lexsort(got.T[::-1])], want[np.lexsort(want.T[::-1])], atol=1e-3)
    assert all(not str(getattr(ann, a, "") or "") for a in PLACEHOLDER_ATTRIBUTES)  # not a DICOM slide

    tiff = tifffile.imread(out / "heatmap.ome.tif")  # C x H x W uint8, level 0
    node = next(iter(Reader(parse_url(str(out / "heatmap.ome.zarr")))()))
    assert node.metadata["channel_names"] == ["tissue", "tumour"]
    np.testing.assert_array_equal(np.asarray(zarr.open_group(str(out / "heatmap.ome.zarr"), mode="r")["0"]), tiff)
    # The classes' display colours: the same in the OME-TIFF's OME-XML (RGBA as a signed int) and the OME-Zarr.
    ome = tifffile.TiffFile(out / "heatmap.ome.tif").ome_metadata
    tiff_colors = [f"{int(c) & 0xFFFFFFFF:08X}" for c in re.findall(r'<Channel [^>]*Color="(-?\d+)"', ome)]
    omero = zarr.open_group(str(out / "heatmap.ome.zarr"), mode="r").attrs["omero"]
    zarr_colors = [ch["color"] for ch in omero["channels"]]
    assert [c[:6] for c in tiff_colors] == zarr_colors and len(set(zarr_colors)) == 2
    assert all(c.endswith("FF") for c in tiff_colors)

    maps = sorted(p.name for p in (out / "heatmap_dicom").iterdir())
    assert maps == sorted(parametric_map_file_names(["tissue", "tumour"]))
    pm = pydicom.dcmread(out / "heatmap_dicom" / maps[1])
    assert pm.SOPClassUID == pydicom.uid.ParametricMapStorage
    assert int(pm.TotalPixelMatrixColumns) == tiff.shape[2] and int(pm.TotalPixelMatrixRows) == tiff.shape[1]
    from helpers.dicom_conformance import DCIODVFY, dciodvfy_errors, standard_problems

    for path in [out / "detections.dcm", *(out / "heatmap_dicom").iterdir()]:
        assert standard_problems(path) == [], path
        assert DCIODVFY is None or dciodvfy_errors(path) == [], path
    # One placeholder study and source for every DICOM object of the slide, though written by different processes.
    headers = [
        pydicom.dcmread(p, stop_before_pixels=True)
        for p in [out / "detections.dcm", *(out / "heatmap_dicom").iterdir()]
    ]
    assert len({h.StudyInstanceUID for h in headers}) == 1
    assert len({h.ReferencedSeriesSequence[0].SeriesInstanceUID for h in headers}) == 1


def test_a_slide_without_detections_has_no_dicom_annotation_file_and_says_why(slide_path, tmp_path):
    """No annotation file (none can hold zero annotations); the heatmap's DICOM files are written and
    meet the standard."""
    from helpers.dicom_conformance import DCIODVFY, dciodvfy_errors, standard_problems

    formats = "dicom,csv,ome-tiff,dicom-heatmap"
    with Pipeline(backend="ort", formats=formats, score_threshold=1.0, writer_processes=0) as pipe:
        result = pipe.run(slide_path, out_dir=tmp_path / "run")
    out = tmp_path / "run"
    assert len(result.detections) == 0
    summary = json.loads((out / "summary.json").read_text())
    files = ["detections.csv", "heatmap.ome.tif", "heatmap_dicom", "summary.json"]
    assert summary["files"] == files
    assert summary["not_written"] == {"detections.dcm": FORMATS["dicom"].holds_none}
    assert sorted(p.name for p in out.iterdir()) == files
    maps = sorted((out / "heatmap_dicom").iterdir())
    assert len(maps) == 2
    for path in maps:
        assert standard_problems(path) == [], path
        assert DCIODVFY is None or dciodvfy_errors(path) == [], path
