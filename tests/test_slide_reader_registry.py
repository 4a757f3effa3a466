"""The slide readers' registry: a reader added with one entry opens its files through open_slide."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import smooth_rgb

import wsi_pipeline
from wsi_pipeline import SlideError
from wsi_pipeline.slide import detect_backend, isolated, open_slide
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.slide.readers import (
    PlainImageReader,
    SlideReader,
    reader_names,
    register_reader,
    slide_suffixes,
    unregister_reader,
)


class RawRgbReader(SlideReader):
    """``.rawrgb``: width and height (little-endian uint32), then the RGB pixels row by row."""

    name = "rawrgb"
    suffixes = (".rawrgb",)

    @classmethod
    def reads(cls, path, probe):
        return probe.extension == ".rawrgb"

    @classmethod
    def open(cls, path):
        data = np.fromfile(path, np.uint8)
        w, h = (int(v) for v in np.frombuffer(data[:8].tobytes(), "<u4"))
        return ImageSlide.from_array(data[8:].reshape(h, w, 3), name=path)


def _write_rawrgb(path, pixels: np.ndarray) -> str:
    h, w, _ = pixels.shape
    path.write_bytes(np.array([w, h], "<u4").tobytes() + pixels.tobytes())
    return str(path)


@pytest.fixture
def raw_reader():
    register_reader(RawRgbReader)
    yield RawRgbReader
    unregister_reader(RawRgbReader)


def test_a_registered_reader_opens_its_files(tmp_path, raw_reader):
    pixels = smooth_rgb(60, 80, seed=3)
    path = _write_rawrgb(tmp_path / "frame.rawrgb", pixels)
    assert detect_backend(path) == "rawrgb"
    assert reader_names()[-1] == "rawrgb"
    with wsi_pipeline.open_slide(path) as s:
        assert s.dimensions == (80, 60)
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (80, 60)), pixels)
    with open_slide(path, "rawrgb") as s:
        np.testing.assert_array_equal(s.read_region((10, 5), 0, (20, 30)), pixels[5:35, 10:30])


def test_without_its_reader_the_file_is_read_by_none(tmp_path):
    path = _write_rawrgb(tmp_path / "frame.rawrgb", smooth_rgb(60, 80, seed=3))
    assert "rawrgb" not in reader_names()
    with pytest.raises(SlideError, match="no reader recognises"):
        open_slide(path)
    with pytest.raises(ValueError, match="unknown slide backend 'rawrgb'"):
        open_slide(path, "rawrgb")


def test_a_reader_registered_before_another_is_asked_first(tmp_path):
    class PngAsRaw(RawRgbReader):
        @classmethod
        def reads(cls, path, probe):
            return probe.extension == ".png"

    path = _write_rawrgb(tmp_path / "frame.png", smooth_rgb(60, 80, seed=3))
    register_reader(PngAsRaw, before=PlainImageReader)
    try:
        assert detect_backend(path) == "rawrgb"
    finally:
        unregister_reader(PngAsRaw)
    assert detect_backend(path) == "image"


def test_openslides_vendor_is_asked_once_per_file(tmp_path, monkeypatch):
    openslide = pytest.importorskip("openslide")
    calls = []

    def detect_format(path):
        calls.append(path)
        return None

    monkeypatch.setattr(openslide.OpenSlide, "detect_format", staticmethod(detect_format))
    monkeypatch.setattr(isolated, "_isolating", False)  # asked here, where the stand-in counts the calls
    path = tmp_path / "garbage.ndpi"
    path.write_bytes(bytes(range(256)) * 16)
    for _ in range(2):  # remembered for the file, not only for one choice of its reader
        with pytest.raises(SlideError, match="no reader recognises"):
            detect_backend(str(path))
    assert calls == [str(path)]


def test_a_folders_slides_are_the_files_the_readers_list(tmp_path):
    """The readers' suffixes decide which files of a folder are slides, as they decide which reader
    opens a file named directly: a WebP image is both, a registered reader's files join them."""
    from PIL import Image

    from wsi_pipeline.batch.runner import expand_inputs

    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(smooth_rgb(40, 50, seed=2)).save(folder / "photo.webp")
    _write_rawrgb(folder / "frame.rawrgb", smooth_rgb(60, 80, seed=3))
    (folder / "notes.txt").write_text("not a slide")
    assert detect_backend(str(folder / "photo.webp")) == "image"
    assert [p.name for p in expand_inputs([folder])] == ["photo.webp"]
    register_reader(RawRgbReader)
    try:
        assert ".rawrgb" in slide_suffixes()
        assert [p.name for p in expand_inputs([folder])] == ["frame.rawrgb", "photo.webp"]
    finally:
        unregister_reader(RawRgbReader)
