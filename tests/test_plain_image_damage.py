"""A damaged plain image (PNG, JPEG) says what is wrong, naming the file once: "truncated" for a
file cut short, and what the C decoder printed attached to the message, not on stderr."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from wsi_pipeline import Pipeline, open_slide
from wsi_pipeline.errors import SlideError, SlideOpenError
from wsi_pipeline.slide import image as image_reader


@pytest.fixture
def images(tmp_path):
    rgb = (np.random.default_rng(0).random((300, 400, 3)) * 255).astype(np.uint8)
    paths = {}
    for ext in ("png", "jpg"):
        paths[ext] = tmp_path / f"frame.{ext}"
        cv2.imwrite(str(paths[ext]), rgb)
    return paths


def _error(path) -> str:
    with pytest.raises(SlideOpenError) as info, open_slide(path) as slide:
        slide.read_region((0, 0), 0, (16, 16))
    return str(info.value)


@pytest.mark.parametrize("ext, fraction", [("png", 0.5), ("png", 0.999), ("jpg", 0.5), ("jpg", 0.99)])
def test_a_truncated_image_says_truncated_and_names_the_file_once(images, tmp_path, capfd, ext, fraction):
    data = images[ext].read_bytes()
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(data[: int(len(data) * fraction)])
    message = _error(cut)
    assert message.startswith(f"{cut}: truncated {'PNG' if ext == 'png' else 'JPEG'}: "), message
    assert message.count(str(cut)) == 1 and message.count(cut.name) == 1
    assert capfd.readouterr().err == ""  # no decoder line without the file's name


def test_what_the_decoder_prints_is_attached_to_the_files_message(images, tmp_path, capfd):
    """libpng reports a CRC error on stderr; the message carries it, stderr stays clean."""
    data = bytearray(images["png"].read_bytes())
    data[100] ^= 0xFF  # inside the first IDAT chunk
    bad = tmp_path / "crc.png"
    bad.write_bytes(bytes(data))
    message = _error(bad)
    assert message.startswith(f"{bad}: not a decodable image"), message
    assert "the decoder said: libpng error: IDAT: CRC error" in message
    assert message.count(str(bad)) == 1
    assert capfd.readouterr().err == ""


def test_a_decoder_warning_on_a_decoded_image_is_logged_with_the_file(images, monkeypatch, caplog, capfd):
    real = cv2.imdecode

    def warns(data, flags):
        os.write(2, b"libjpeg: Corrupt JPEG data: 3 extraneous bytes before marker 0xd9\n")
        return real(data, flags)

    monkeypatch.setattr(image_reader.cv2, "imdecode", warns)
    caplog.set_level("INFO", logger="wsi_pipeline")
    with open_slide(images["jpg"]) as slide:
        assert slide.read_region((0, 0), 0, (16, 16)).shape == (16, 16, 3)
    assert capfd.readouterr().err == ""
    said = [r.getMessage() for r in caplog.records if "the decoder said" in r.getMessage()]
    assert said == [
        f"{images['jpg']}: decoded; the decoder said: libjpeg: Corrupt JPEG data: 3 extraneous bytes before marker 0xd9"
    ]
    # The process's stderr is its own again.
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_a_premature_end_the_decoder_reports_is_a_truncation(images, monkeypatch):
    """A libjpeg that decodes a cut file, greying what is missing, says "Premature end": an error."""
    real = cv2.imdecode

    def premature(data, flags):
        os.write(2, b"Premature end of JPEG file\n")
        return real(data, flags)

    monkeypatch.setattr(image_reader.cv2, "imdecode", premature)
    message = _error(images["jpg"])
    said = "(the decoder said: Premature end of JPEG file)"
    assert message == f"{images['jpg']}: truncated JPEG: the file ends before its last scan {said}"


@pytest.mark.parametrize("shape", [(0, 0, 3), (0, 10, 3), (10, 0)])
def test_an_empty_array_is_a_slide_error_not_a_config_error(shape):
    with pytest.raises(SlideError, match=r"<array>: the array holds no pixels"):
        Pipeline(backend="ort").run(np.zeros(shape, np.uint8))
