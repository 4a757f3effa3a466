"""A DICOM whole-slide image (a series of files in one folder) is one slide of a batch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openslide
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, VLWholeSlideMicroscopyImageStorage, generate_uid

from wsi_pipeline.batch import expand_inputs


def write_dicom_level(path, image: np.ndarray, uids: dict[str, str], level: int, mpp: float, tile: int = 256) -> None:
    """One pyramid level of a DICOM WSI: uncompressed RGB frames, TILED_FULL, as OpenSlide reads them."""
    h, w = image.shape[:2]
    frames = []
    for y in range(0, h, tile):
        for x in range(0, w, tile):
            frame = np.zeros((tile, tile, 3), np.uint8)
            part = image[y:y + tile, x:x + tile]
            frame[:part.shape[0], :part.shape[1]] = part
            frames.append(frame)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = VLWholeSlideMicroscopyImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = VLWholeSlideMicroscopyImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    for name, uid in uids.items():
        setattr(ds, name, uid)
    ds.Modality = "SM"
    ds.ImageType = ["ORIGINAL" if level == 0 else "DERIVED", "PRIMARY", "VOLUME", "NONE" if level == 0 else "RESAMPLED"]
    ds.InstanceNumber = level + 1
    ds.DimensionOrganizationType = "TILED_FULL"
    ds.SamplesPerPixel = 3
    ds.PhotometricInterpretation = "RGB"
    ds.PlanarConfiguration = 0
    ds.NumberOfFrames = len(frames)
    ds.Rows = ds.Columns = tile
    ds.BitsAllocated = ds.BitsStored = 8
    ds.HighBit = 7
    ds.PixelRepresentation = 0
    ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = w, h
    ds.TotalPixelMatrixFocalPlanes = ds.NumberOfOpticalPaths = 1
    measures = Dataset()
    measures.PixelSpacing = [mpp / 1000, mpp / 1000]  # mm
    measures.SliceThickness = 0
    shared = Dataset()
    shared.PixelMeasuresSequence = [measures]
    ds.SharedFunctionalGroupsSequence = [shared]
    optical = Dataset()
    optical.OpticalPathIdentifier = "0"
    ds.OpticalPathSequence = [optical]
    ds.PixelData = np.stack(frames).tobytes()
    ds.save_as(path, enforce_file_format=True)


def write_dicom_wsi(folder, stem: str, image: np.ndarray, levels: int = 2, mpp: float = 0.25) -> list:
    """A DICOM WSI of ``levels`` files ``stem_N.dcm`` in ``folder`` (one series); returns the paths."""
    uids = {name: generate_uid() for name in
            ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID", "PyramidUID")}
    paths = []
    for level in range(levels):
        path = folder / f"{stem}_{level}.dcm"
        write_dicom_level(path, np.ascontiguousarray(image[::2 ** level, ::2 ** level]), uids, level,
                          mpp * 2 ** level)
        paths.append(path)
    return paths


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
    assert pydicom.dcmread(a[1], stop_before_pixels=True).SeriesInstanceUID == \
        pydicom.dcmread(a[0], stop_before_pixels=True).SeriesInstanceUID
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
    proc = subprocess.run([sys.executable, "-m", "wsi_pipeline", "run", str(folder), "--out", str(out),
                           "--backend", "ort"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    slides = json.loads((out / "manifest.json").read_text())["slides"]
    assert sorted(slides) == ["a_0", "b_0"]
    assert all(rec["status"] == "done" for rec in slides.values())
    summary = json.loads((out / "slides" / "a_0" / "summary.json").read_text())
    assert summary["dimensions_level0"] == [640, 512]
