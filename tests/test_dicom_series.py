"""A DICOM whole-slide image (a series of files in one folder) is one slide of a batch; other
DICOM objects beside it never take its place, and thousands of files cost one short read each."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import openslide
import pydicom
import pytest
from helpers import write_dicom_wsi, write_many_level_series, write_secondary_capture

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


def _series_uids(path) -> dict[str, str]:
    ds = pydicom.dcmread(path, stop_before_pixels=True)
    return {"StudyInstanceUID": ds.StudyInstanceUID, "SeriesInstanceUID": ds.SeriesInstanceUID}


def test_dicom_objects_that_are_no_slide_are_left_out_of_a_folder_not_taken_for_its_slide(dicom_folder, caplog):
    folder, a, b = dicom_folder
    # A Secondary Capture of slide a's own series, sorting before its files.
    capture = folder / "0_capture.dcm"
    write_secondary_capture(capture, _series_uids(a[0]))
    with caplog.at_level(logging.WARNING, "wsi_pipeline"):
        assert expand_inputs([folder]) == [a[0], b[0], folder / "junk.dcm"]
    assert "scans: 1 DICOM file(s) that are not whole-slide images skipped (0_capture.dcm" in caplog.text
    assert "Secondary Capture Image Storage" in caplog.text
    # Named, it stays a slide of its own (to fail saying what it is), and does not hide the series.
    assert expand_inputs([capture, a[1]]) == [capture, a[1]]


def test_a_dicom_folder_runs_once_per_series(dicom_folder, tmp_path):
    folder, a, b = dicom_folder
    (folder / "junk.dcm").unlink()
    write_secondary_capture(folder / "0_capture.dcm", _series_uids(a[0]))
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


def test_thousands_of_other_dicom_objects_sorting_first_never_hide_a_slide_s_levels(tmp_path):
    from wsi_pipeline.slide import open_slide

    folder = tmp_path / "crowded"
    folder.mkdir()
    levels = write_dicom_wsi(folder, "z", np.zeros((256, 256, 3), np.uint8), levels=3, tile=64, jpeg="YBR_FULL_422")
    write_secondary_capture(tmp_path / "capture.dcm", _series_uids(levels[0]))
    for i in range(4200):  # more than the reader looks at for a series' levels
        shutil.copyfile(tmp_path / "capture.dcm", folder / f"a{i:04d}.dcm")
    for path in (folder, levels[2]):
        with open_slide(path) as slide:
            assert (slide.backend, slide.level_count, slide.dimensions) == ("dicom", 3, (256, 256))


def _run_limited(code: str, open_files: int) -> str:
    """``code`` run by a new interpreter allowed ``open_files`` open files; its output."""
    script = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({open_files}, {open_files}))\n" + code
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_thousands_of_dicom_files_are_grouped_with_one_short_read_each_and_few_files_open(tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    level = write_dicom_wsi(tmp_path, "one", np.zeros((64, 64, 3), np.uint8), levels=1, tile=64)[0]
    capture = tmp_path / "capture.dcm"
    write_secondary_capture(capture, _series_uids(level))
    for i in range(2500):  # Secondary Captures of the slide's series, sorting first, and its files
        shutil.copyfile(capture, folder / f"a{i:04d}.dcm")
        shutil.copyfile(level, folder / f"b{i:04d}.dcm")
    out = _run_limited(
        textwrap.dedent(f"""
            import wsi_pipeline.slide.dicom_headline as dicom_headline
            from wsi_pipeline.batch import expand_inputs
            reads, read = [], dicom_headline.read_headline
            def counted(path):
                reads.append(path)
                return read(path)
            dicom_headline.read_headline = counted
            paths = expand_inputs([{str(folder)!r}])
            print(len(paths), paths[0].name, len(reads), len(set(reads)))
        """),
        open_files=32,
    )
    assert out.split() == ["1", "b0000.dcm", "5000", "5000"]


def test_a_series_of_more_level_files_than_files_may_be_open_is_read(tmp_path):
    """Its level files are opened as they are read, not all at open."""
    paths = write_many_level_series(tmp_path, 1536)
    out = _run_limited(
        textwrap.dedent(f"""
            import os
            from wsi_pipeline.slide import open_slide
            with open_slide({str(paths[0])!r}) as slide:
                last = slide.level_count - 1
                pixels = [slide.read_region((0, 0), level, (8, 8)).mean() for level in (0, last)]
                print(slide.backend, slide.level_count, slide.level_dimensions[last], len(os.listdir("/proc/self/fd")))
        """),
        open_files=1024,
    )
    backend, levels, *_, open_fds = out.split()
    assert (backend, int(levels)) == ("dicom", 1536)
    assert int(open_fds) < 64


def _set_uids(paths, **values):
    for path in paths:
        ds = pydicom.dcmread(path)
        for name, value in values.items():
            if value is None:
                delattr(ds, name)
            else:
                setattr(ds, name, value)
        ds.save_as(path)


@pytest.mark.parametrize("differs_by", ["PyramidUID", "ContainerIdentifier"])
def test_two_slides_sharing_a_series_uid_are_two_slides_never_levels_of_one(tmp_path, differs_by):
    """A scan whose SeriesInstanceUID is another's but whose PyramidUID (or, without one, whose
    ContainerIdentifier) differs is a slide of its own: never read as a level of the other."""
    from wsi_pipeline.errors import SlideOpenError
    from wsi_pipeline.slide import open_slide

    rng = np.random.default_rng(3)
    folder = tmp_path / "scans"
    folder.mkdir()
    image = (rng.random((512, 640, 3)) * 255).astype(np.uint8)
    a = write_dicom_wsi(folder, "a", image, levels=3, jpeg="YBR_FULL_422")
    grey = np.full((256, 640, 3), 200, np.uint8)
    b = write_dicom_wsi(folder, "b", grey, levels=2, jpeg="YBR_FULL_422", associated=("LABEL",))
    series = pydicom.dcmread(a[0], stop_before_pixels=True).SeriesInstanceUID
    label = folder / "b_label.dcm"
    if differs_by == "PyramidUID":
        _set_uids([*b, label], SeriesInstanceUID=series)
    else:
        _set_uids([*a, *b, label], PyramidUID=None)
        _set_uids(a, ContainerIdentifier="S-A")
        _set_uids([*b, label], SeriesInstanceUID=series, ContainerIdentifier="S-B")
    assert expand_inputs([folder]) == [a[0], b[0]]  # b's label goes with b
    for files, dims in ((a, [(640, 512), (320, 256), (160, 128)]), (b, [(640, 256), (320, 128)])):
        for path in files:
            with open_slide(path) as slide:
                assert (slide.backend, list(slide.level_dimensions)) == ("dicom", dims)
    with open_slide(label) as slide:
        assert list(slide.level_dimensions) == [(640, 256), (320, 128)]
        assert slide.read_region((0, 0), 1, (64, 64)).mean() == pytest.approx(200, abs=2)
    with pytest.raises(SlideOpenError, match="scans: folder holds 2 DICOM WSI slides"):
        open_slide(folder)


def test_info_on_a_folder_of_many_dicom_files_reads_each_header_once(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    levels = write_dicom_wsi(folder, "z", np.zeros((256, 256, 3), np.uint8), levels=3, tile=64, jpeg="YBR_FULL_422")
    write_secondary_capture(tmp_path / "capture.dcm", _series_uids(levels[0]))
    for i in range(300):
        shutil.copyfile(tmp_path / "capture.dcm", folder / f"a{i:04d}.dcm")
    out = _run_limited(
        textwrap.dedent(f"""
            import pydicom
            import wsi_pipeline.slide.dicom_headline as dicom_headline
            from wsi_pipeline.commands.info import describe
            heads, full, read, dcmread = [], [], dicom_headline.read_headline, pydicom.dcmread
            def counted(path):
                heads.append(path)
                return read(path)
            def counted_full(f, *args, **kwargs):
                full.append(f)
                return dcmread(f, *args, **kwargs)
            dicom_headline.read_headline = counted
            pydicom.dcmread = counted_full
            info = describe({str(levels[0])!r})
            print(info["backend"], info["level_count"], len(heads), len(set(heads)), len(full))
        """),
        open_files=64,
    )
    # Each file's first elements once (a whole run asked about it several times), each level's header once.
    assert out.split() == ["dicom", "3", "303", "303", "3"]
