"""An Aperio slide's MPP is read as OpenSlide reads it, and a truncated TIFF says that it is one."""

from __future__ import annotations

import numpy as np
import openslide
import pytest
import tifffile

from wsi_pipeline.errors import SlideOpenError
from wsi_pipeline.slide import open_slide
from wsi_pipeline.slide.resolution import aperio_field, openslide_double

# Texts around every branch of g_ascii_strtod and OpenSlide's checks: commas, hexadecimal floats,
# words, white space, signs, infinities and NaN, overflow, underflow (rounded and exact).
MPP_TEXTS = [
    "0.25", "0,25", "0x1p-2", "0X1P-2", "0x.8", "0x1.8p-1", "True", "1", "1.", ".5", "+0.5", "-0.25", "1e-1",
    " 0.25 ", "\t0.25\t", "0.25\v", "\v0.25", "0.25um", "", "1,5,3", "0, 25", "1.5e", "1_0", "1p-2", "0x",
    "inf", "-INFINITY", "infinit", "nan", "nan(1)", "1e400", "1e-400", "4e-320", "0x1p-1070", "0e-999",
    "0x1P+1000000", "1e999999999", "2.225073858507201e-308",
]  # fmt: skip


def _svs(path, mpp_text: str, size: int = 16) -> str:
    description = f"Aperio Image Library v10.0.50\r\n{size}x{size} -> {size}x{size} - |AppMag = 20|MPP = {mpp_text}"
    tile = 16
    image = np.full((size, size, 3), 200, np.uint8)
    tifffile.imwrite(path, image, description=description, tile=(tile, tile), photometric="rgb", metadata=None,
                     compression="jpeg")  # fmt: skip
    return description


def test_the_mpp_text_is_a_number_exactly_where_openslide_finds_one(tmp_path):
    for i, text in enumerate(MPP_TEXTS):
        path = tmp_path / f"s{i}.svs"
        description = _svs(path, text)
        with openslide.OpenSlide(str(path)) as osr:
            assert osr.properties.get("openslide.vendor") == "aperio"
            found = osr.properties.get(openslide.PROPERTY_NAME_MPP_X)
        want = None if found is None else float(found)
        got = openslide_double(aperio_field(description, "MPP"))
        assert got == pytest.approx(want, rel=1e-15) if want is not None else got is None, (text, found, got)


@pytest.mark.parametrize(("text", "mpp"), [("0,25", (0.25, 0.25)), ("0x1p-2", (0.25, 0.25)), ("True", None)])
def test_both_readers_give_the_slide_openslide_s_mpp(tmp_path, text, mpp):
    path = tmp_path / "slide.svs"
    _svs(path, text, size=64)
    for backend in ("tifffile", "openslide"):
        with open_slide(path, backend) as slide:
            assert slide.mpp == (pytest.approx(mpp) if mpp else None), backend


def test_a_word_for_the_mpp_warns_naming_the_file(tmp_path):
    path = tmp_path / "word.svs"
    _svs(path, "True", size=64)
    with pytest.warns(UserWarning, match=r"word\.svs: Aperio MPP 'True' is not a number"), open_slide(path) as slide:
        assert slide.mpp is None


def test_the_last_of_a_repeated_field_counts_and_the_name_is_matched_whole():
    assert aperio_field("Aperio|MPP = 0.3|MPP=0.25 |AppMag = 40", "MPP") == "0.25"
    assert aperio_field("Aperio|mpp = 0.25|XMPP = 0.5", "MPP") is None
    assert aperio_field("Aperio|MPP = 0.25 = 3", "MPP") == "0.25 = 3"


@pytest.mark.parametrize("cut_at", ["header", "first IFD", "second IFD"])
def test_a_truncated_svs_says_it_is_a_truncated_tiff_naming_the_file(tmp_path, cut_at):
    whole = tmp_path / "whole.svs"
    image = np.random.default_rng(0).integers(0, 255, (384, 512, 3), np.uint8)
    with tifffile.TiffWriter(whole) as tw:
        for level in (image, image[::2, ::2]):
            tw.write(np.ascontiguousarray(level), tile=(128, 128), photometric="rgb", compression="zlib",
                     description="Aperio Image Library v10.0.0\n512x384|MPP = 0.25", metadata=None)  # fmt: skip
    data = whole.read_bytes()
    cut = tmp_path / "cut.svs"
    with tifffile.TiffFile(whole) as tif:
        second_ifd = tif.pages[1].offset
    end, page = {"header": (8, 0), "first IFD": (30, 0), "second IFD": (second_ifd + 10, 1)}[cut_at]
    cut.write_bytes(data[:end])
    message = rf"cut\.svs: truncated TIFF: page {page}'s IFD at byte \d+ .*past the end"
    with pytest.raises(SlideOpenError, match=message):
        open_slide(cut)
