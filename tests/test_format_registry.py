"""An output format is one entry in ``io.formats.FORMATS``: a detections file and a heatmap file added
there are chosen, written by a run and listed in its summary like the built-in ones."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ConfigError
from wsi_pipeline.io.formats import DETECTIONS, FORMATS, HEATMAP, OutputFormat, output_files, parse_formats
from wsi_pipeline.synthetic import write_synthetic_slide

TOY_FORMATS = (
    OutputFormat(
        "counts",
        "detections.counts.json",
        DETECTIONS,
        "helpers.toy_formats:write_counts",
        about="the number of detections of each class",
    ),
    OutputFormat(
        "npy-heatmap",
        "heatmap.npy",
        HEATMAP,
        sink="helpers.toy_formats:NpyHeatmapWriter",
        about="the heatmap as one .npy array",
    ),
)


@contextlib.contextmanager
def registered(*formats: OutputFormat):
    """``formats`` in the registry while the block runs."""
    for fmt in formats:
        FORMATS[fmt.name] = fmt
    try:
        yield formats
    finally:
        for fmt in formats:
            del FORMATS[fmt.name]


@pytest.fixture
def toy_formats():
    """The toy formats in the registry for one test, removed after it."""
    with registered(*TOY_FORMATS) as formats:
        yield formats


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("registry") / "tissue.tiff"
    write_synthetic_slide(path, 1536, 1536, seed=3, kind="pathology")
    return path


def test_formats_added_to_the_registry_are_chosen_like_the_built_in_ones(toy_formats):
    assert parse_formats("npy-heatmap, counts,geojson") == ("geojson", "counts", "npy-heatmap")
    assert output_files(["counts", "npy-heatmap"], heatmap=False) == ["detections.counts.json", "summary.json"]


def test_the_entries_are_gone_after_the_block_that_added_them():
    with registered(*TOY_FORMATS):
        assert parse_formats("counts") == ("counts",)
    assert "counts" not in FORMATS and "npy-heatmap" not in FORMATS
    with pytest.raises(ConfigError, match="unknown format 'counts'"):
        parse_formats("counts")


def test_a_run_writes_the_formats_added_to_the_registry_and_lists_them(toy_formats, slide_path, tmp_path):
    """The detections file is written by a writer process (its function pickled there), the heatmap file
    by its sink as the rows are blended; both are in ``summary.json``'s ``files``."""
    with Pipeline(backend="ort", formats="counts,npy-heatmap,ome-tiff", writer_processes=1) as pipe:
        result = pipe.run(slide_path, out_dir=tmp_path / "run")
    out = tmp_path / "run"
    files = ["heatmap.ome.tif", "detections.counts.json", "heatmap.npy", "summary.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"] == files
    assert summary["parameters"]["formats"] == ["ome-tiff", "counts", "npy-heatmap"]

    counts = json.loads((out / "detections.counts.json").read_text())
    assert counts == {"nucleus": len(result.detections)} and len(result.detections) > 0
    heat = np.load(out / "heatmap.npy")
    assert heat.shape == result.heatmap.shape and not np.isnan(heat).any()  # every row arrived
    # The same rows as the OME-TIFF holds (stored there as uint8: value = stored / 255).
    np.testing.assert_allclose(heat, np.asarray(result.heatmap), atol=0.5 / 255 + 1e-6)


def test_a_heatmap_format_without_a_reader_leaves_the_run_no_heatmap_file_to_read(toy_formats, slide_path, tmp_path):
    with Pipeline(backend="ort", formats="geojson,npy-heatmap", writer_processes=0) as pipe:
        result = pipe.run(slide_path, out_dir=tmp_path / "run")
    out = tmp_path / "run"
    assert json.loads((out / "summary.json").read_text())["files"] == [
        "detections.geojson",
        "heatmap.npy",
        "summary.json",
    ]
    assert result.heatmap is None
    assert np.load(out / "heatmap.npy").shape[0] == 2
