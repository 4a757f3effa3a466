"""A DICOM whole-slide image (a series of files in one folder) is one slide of a batch."""

from __future__ import annotations

import json
import re
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


def _set_container(paths, barcode):
    for path in paths:
        ds = pydicom.dcmread(path)
        ds.ContainerIdentifier = barcode
        ds.save_as(path)


def test_a_dicom_slide_is_named_after_its_folder_or_its_container(tmp_path):
    """A series alone in its folder takes the folder's name; series sharing a folder their
    ContainerIdentifier (else their file's stem); names that meet are told apart as any others."""
    from wsi_pipeline.batch.folder import output_names

    image = np.random.default_rng(1).integers(0, 255, (256, 256, 3), np.uint8)
    for name in ("case-17", "shared", "x/scan", "y/scan"):
        (tmp_path / name).mkdir(parents=True)
    alone = write_dicom_wsi(tmp_path / "case-17", "1.2.826.0.1.3680043.8.498.1234567890", image)
    first = write_dicom_wsi(tmp_path / "shared", "1.2.3.1", image)
    second = write_dicom_wsi(tmp_path / "shared", "1.2.3.2", image)
    _set_container(first, "S-001")
    twins = [write_dicom_wsi(tmp_path / d, "1.2.9", image) for d in ("x/scan", "y/scan")]
    slides = expand_inputs([tmp_path / "case-17", tmp_path / "shared", tmp_path / "x", tmp_path / "y"])
    assert slides == [alone[0], first[0], second[0], twins[0][0], twins[1][0]]
    names = output_names(slides)
    assert names[:3] == ["case-17", "S-001", "1.2.3.2_0"]
    assert names[3] != names[4] and all(re.fullmatch(r"scan-[0-9a-f]{8}", n) for n in names[3:])
    assert output_names([alone[0]], held={"earlier": str(alone[0])}) == ["earlier"]  # a name held stays
