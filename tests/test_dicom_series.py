"""A DICOM whole-slide image (a series of files in one folder) is one slide of a batch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openslide
import pydicom
import pytest
from helpers import write_dicom_wsi

from wsi_pipeline.batch import expand_inputs


@pytest.fixture
def dicom_folder(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "scans"
    folder.mkdir()
    image = (rng.random((512, 640, 3)) * 255).astype(np.uint8)
    a = write_dicom_wsi(folder, "a", image, levels=3)
    b = write_dicom_wsi(folder, "b", image[:256], levels=2)
    (folder / "junk.dcm").write_bytes(b"not dicom at all")
    return folder, a, b


def test_the_fixture_is_a_dicom_wsi_openslide_reads(dicom_folder):
    _, a, _ = dicom_folder
    assert (
        pydicom.dcmread(a[1], stop_before_pixels=True).SeriesInstanceUID
        == pydicom.dcmread(a[0], stop_before_pixels=True).SeriesInstanceUID
    )
    for path in a:  # OpenSlide opens the whole series from any of its files
        with openslide.OpenSlide(str(path)) as s:
            assert s.level_count == 3 and s.dimensions == (640, 512)


def test_a_series_expands_to_one_slide(dicom_folder):
    folder, a, b = dicom_folder
    assert expand_inputs([folder]) == [a[0], b[0], folder / "junk.dcm"]
    assert expand_inputs([a[2], *a, b[1]]) == [a[2], b[1]]


def test_a_dicom_folder_runs_once_per_series(dicom_folder, tmp_path):
    folder, a, b = dicom_folder
    (folder / "junk.dcm").unlink()
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", str(folder), "--out", str(out), "--backend", "ort"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slides = json.loads((out / "manifest.json").read_text())["slides"]
    assert sorted(slides) == ["a_0", "b_0"]
    assert all(rec["status"] == "done" for rec in slides.values())
    summary = json.loads((out / "slides" / "a_0" / "summary.json").read_text())
    assert summary["dimensions_level0"] == [640, 512]
