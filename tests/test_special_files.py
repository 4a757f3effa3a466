"""No path the program opens for reading a slide's companion files or for writing its outputs is
a FIFO, socket or device: each is refused, naming it, before anything waits on it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import write_dicom_wsi

from wsi_pipeline.errors import ConfigError, SpecialFileError
from wsi_pipeline.io.atomic import atomic_write, partial_name
from wsi_pipeline.special_files import open_regular


@contextlib.contextmanager
def _within(seconds: int):
    """Fail (instead of hanging the test run) where the body waits on a FIFO past ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("mode", ["rb", "r", "wb", "ab", "r+b"])
def test_open_regular_refuses_what_is_no_regular_file_naming_it(tmp_path, mode):
    fifo, sock = tmp_path / "pipe", tmp_path / "sock"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    (tmp_path / "link").symlink_to(fifo)
    for path, kind in (
        (fifo, "a FIFO"),
        (sock, "a socket"),
        (tmp_path / "link", "a FIFO"),
        ("/dev/null", "a character device"),
    ):
        with _within(10), pytest.raises(SpecialFileError, match=f"{path}: {kind}.*not a regular file"):
            open_regular(path, mode)
    regular = tmp_path / "file"
    regular.write_bytes(b"abc")
    with open_regular(regular, mode) as f:  # a regular file opens as open() opens it
        assert sorted(f.mode) == sorted(mode) and f.readable() == ("r" in mode or "+" in mode)
        if "+" in mode or "r" in mode:
            assert f.read() in (b"abc", "abc")
    assert regular.read_bytes() == (b"" if mode == "wb" else b"abc")


def test_a_fifo_where_an_output_is_written_is_refused_not_waited_on(tmp_path):
    final = tmp_path / "detections.csv"
    os.mkfifo(tmp_path / f".detections.csv.partial-{os.getpid()}")
    with _within(10), pytest.raises(SpecialFileError, match=r"\.detections\.csv\.partial-\d+: a FIFO"):
        with atomic_write(final) as f:
            f.write("x")
    with pytest.raises(SpecialFileError):
        partial_name(final)
    assert not final.exists()


def test_a_fifo_beside_a_dicom_slide_is_named_by_the_dicom_outputs_not_waited_on(tmp_path):
    dicom_source = pytest.importorskip("wsi_pipeline.io.dicom_source", reason="the dicom extra")
    level0 = write_dicom_wsi(tmp_path, "a", np.zeros((64, 64, 3), np.uint8), levels=1, tile=64)[0]
    os.mkfifo(tmp_path / "zz.dcm")
    with _within(10), pytest.raises(SpecialFileError, match=r"zz\.dcm: a FIFO \(named pipe\), not a regular file"):
        dicom_source.dicom_source_image(level0)


def test_a_mask_that_is_a_fifo_is_a_config_error(tmp_path):
    from wsi_pipeline.slide.image import ImageSlide
    from wsi_pipeline.tiling.tissue import mask_from_file

    os.mkfifo(tmp_path / "mask.png")
    slide = ImageSlide.from_array(np.zeros((64, 64, 3), np.uint8))
    with _within(10), pytest.raises(ConfigError, match=r"mask\.png: the mask is a FIFO \(named pipe\), not a regular"):
        mask_from_file(slide, tmp_path / "mask.png")


def test_a_fifo_in_the_folder_of_a_dicom_slide_for_openslide_is_named_before_openslide_waits_on_it(tmp_path):
    from wsi_pipeline.errors import SlideOpenError
    from wsi_pipeline.slide import open_slide

    level0 = write_dicom_wsi(tmp_path, "a", np.zeros((64, 64, 3), np.uint8), levels=1, tile=64)[0]  # uncompressed
    os.mkfifo(tmp_path / "notes.txt")  # OpenSlide opens every file of the folder, whatever its name
    with _within(20), pytest.raises(SlideOpenError, match=r"a_0\.dcm: .*notes\.txt is a FIFO \(named pipe\)"):
        open_slide(level0)


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_a_run_with_dicom_outputs_fails_the_slide_at_once_naming_a_fifo_beside_it(tmp_path):
    pytest.importorskip("highdicom", reason="the dicom extra")
    folder = tmp_path / "scans"
    folder.mkdir()
    rng = np.random.default_rng(0)
    image = (rng.random((512, 640, 3)) * 255).astype(np.uint8)
    a = write_dicom_wsi(folder, "a", image, levels=2, jpeg="YBR_FULL_422")  # read by the dicom reader
    os.mkfifo(folder / "zz.dcm")  # no writer: opening it for reading waits for ever
    out = tmp_path / "out"
    proc = _cli("run", a[0], "--out", out, "--backend", "ort", "--formats", "geojson,dicom", "--slide-timeout", 120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    (record,) = json.loads((out / "manifest.json").read_text())["slides"].values()  # named after its folder
    assert record["status"] == "failed"
    # Refused as a FIFO, not failed at its time limit ("did not finish within 120 s") waiting on it.
    assert "zz.dcm: a FIFO (named pipe), not a regular file" in record["error"], record


def test_a_fifo_named_like_the_run_log_is_one_line_not_a_wait(tmp_path):
    from wsi_pipeline.synthetic import write_synthetic_slide

    slide = tmp_path / "s.tiff"
    write_synthetic_slide(slide, 300, 300, seed=1, kind="pathology")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "run.log")
    proc = _cli("run", slide, "--out", out, "--backend", "ort", timeout=120)
    assert proc.returncode != 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "run.log" in ln]
    assert lines and "a FIFO (named pipe), not a regular file" in lines[0] and "Traceback" not in proc.stderr
