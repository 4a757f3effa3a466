import os
import struct
import subprocess
import sys
import warnings
import zlib

import cv2
import numpy as np
import pytest
import tifffile
from helpers import smooth_rgb, write_pyramid_tiff

from wsi_pipeline import SlideError, open_slide
from wsi_pipeline.errors import TileReadError
from wsi_pipeline.slide import detect_backend
from wsi_pipeline.slide.image import ImageSlide

# Regions at positions aligned to each level's pixel grid, edges and outside included.
REGIONS = [
    ((0, 0), (512, 512)),
    ((1792, 896), (512, 512)),
    ((3840, 2816), (512, 512)),
    ((4000, 100), (300, 300)),
    ((-64, -128), (256, 256)),
    ((448, 2688), (700, 500)),
]


@pytest.mark.parametrize("level", [0, 1, 2])
def test_tifffile_reader_equals_openslide(pyramid_tiff, level):
    with open_slide(pyramid_tiff, "openslide") as ref, open_slide(pyramid_tiff, "tifffile") as fast:
        assert fast.level_dimensions == ref.level_dimensions
        assert fast.level_downsamples == pytest.approx(ref.level_downsamples)
        ds = int(ref.level_downsamples[level])
        for (x, y), size in REGIONS:
            loc = (x // ds * ds, y // ds * ds)
            a = ref.read_region(loc, level, size)
            b = fast.read_region(loc, level, size)
            assert a.shape == b.shape == (size[1], size[0], 3)
            assert a.dtype == b.dtype == np.uint8 and b.flags.c_contiguous
            np.testing.assert_array_equal(a, b, err_msg=f"level {level} at {loc}")


def test_metadata_and_auto_backend(pyramid_tiff):
    with open_slide(pyramid_tiff) as s:
        assert s.backend == "tifffile"
        assert s.dimensions == (4100, 3000)
        assert s.level_count == 3
        assert s.mpp == pytest.approx((0.25, 0.25))
        assert s.best_level_for_downsample(3.0) == 1
        assert s.best_level_for_downsample(0.5) == 0
        assert s.best_level_for_downsample(100) == 2
        thumb = s.get_thumbnail((512, 512))
        assert thumb.shape == (375, 512, 3)
    with open_slide(pyramid_tiff, "openslide") as s:
        assert s.mpp == pytest.approx((0.25, 0.25))
        assert s.vendor == "generic-tiff"


def test_outside_is_background_white(pyramid_tiff):
    for backend in ("openslide", "tifffile"):
        with open_slide(pyramid_tiff, backend) as s:
            out = s.read_region((5000, 5000), 0, (64, 64))
            assert (out == 255).all(), backend


def test_ome_subifd_pyramid(tmp_path):
    path = str(tmp_path / "pyr.ome.tif")
    write_pyramid_tiff(path, smooth_rgb(1500, 2100, seed=3), levels=3, subifds=True, mpp=0.5)
    with open_slide(path) as s:
        assert s.backend == "tifffile"
        assert s.level_count == 3
        assert s.level_dimensions[2] == (525, 375)
        assert s.mpp == pytest.approx((0.5, 0.5))
        assert s.read_region((1024, 512), 2, (128, 128)).shape == (128, 128, 3)


@pytest.mark.parametrize("photometric", ["ycbcr", "rgb"])
def test_raw_tile_is_a_standalone_jpeg(tmp_path, photometric):
    path = str(tmp_path / "t.tif")
    write_pyramid_tiff(path, smooth_rgb(600, 700, seed=4), levels=1, photometric=photometric)
    with open_slide(path, "tifffile") as s:
        assert s.tile_grid_shape(0) == (256, 256, 3, 3)
        data = s.raw_tile_jpeg(0, 1, 1)
        assert data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"
        decoded = s.read_region((256, 256), 0, (256, 256))
        if photometric == "ycbcr":
            # A standalone decoder gets the same pixels as the TIFF codec.
            alone = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            assert np.abs(alone.astype(int) - decoded).max() <= 2


def test_plain_image_backend(tmp_path):
    img = smooth_rgb(300, 400, seed=5)
    p = str(tmp_path / "frame.png")
    cv2.imwrite(p, cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    with open_slide(p) as s:
        assert s.backend == "image" and s.dimensions == (400, 300) and s.mpp is None
        np.testing.assert_array_equal(s.read_region((10, 20), 0, (50, 40)), img[20:60, 10:60])
    untiled = str(tmp_path / "frame.tif")
    tifffile.imwrite(untiled, img, photometric="rgb")
    assert detect_backend(untiled) == "image"
    with open_slide(untiled) as s:
        np.testing.assert_array_equal(s.read_region((0, 0), 0, (400, 300)), img)
    arr = ImageSlide.from_array(img, mpp=(5.0, 5.0))
    assert arr.mpp == (5.0, 5.0)


def test_implausible_mpp_warns_and_is_dropped(tmp_path):
    path = str(tmp_path / "dpi72.tif")
    tifffile.imwrite(
        path, smooth_rgb(512, 512), tile=(256, 256), photometric="rgb", resolution=(72, 72), resolutionunit="INCH"
    )
    with pytest.warns(UserWarning, match="implausible resolution"):
        s = open_slide(path)
    assert s.mpp is None
    assert "dpi72.tif" in str(s.path)


# -- bad input ----------------------------------------------------------------


def test_missing_file():
    with pytest.raises(SlideError, match="no such file"):
        open_slide("/nonexistent/slide.svs")


def test_zero_byte_file(tmp_path):
    p = tmp_path / "empty.svs"
    p.write_bytes(b"")
    with pytest.raises(SlideError, match=r"empty.svs: file is empty"):
        open_slide(p)


def test_garbage_file(tmp_path):
    p = tmp_path / "garbage.ndpi"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(SlideError, match="no reader recognises"):
        open_slide(p)


def test_truncated_tiff(tmp_path, pyramid_tiff):
    p = tmp_path / "truncated.tif"
    with open(pyramid_tiff, "rb") as f:
        p.write_bytes(f.read(os.path.getsize(pyramid_tiff) // 2))
    with pytest.raises(SlideError, match="truncated.tif"):
        with open_slide(p) as s:
            s.read_region((0, 0), 0, (4100, 3000))


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")


def test_absurd_claimed_size(tmp_path):
    p = tmp_path / "huge.png"
    p.write_bytes(_png_header_only(200_000, 200_000))
    with pytest.raises(SlideError, match=r"huge.png: image claims 200000x200000"):
        open_slide(p)


def test_corrupt_tile_in_the_middle(tmp_path, pyramid_tiff):
    p = str(tmp_path / "corrupt.tif")
    with open(pyramid_tiff, "rb") as f:
        data = bytearray(f.read())
    with tifffile.TiffFile(pyramid_tiff) as tif:
        page = tif.pages[0]
        i = 3 * 17 + 8  # row 3, col 8 of 17 x 12 stored tiles
        off, n = page.dataoffsets[i], page.databytecounts[i]
    data[off : off + n] = b"\xff\xd8" + b"\x00" * (n - 2)
    with open(p, "wb") as f:
        f.write(data)
    with open_slide(p, "tifffile") as s:
        s.read_region((0, 0), 0, (512, 512))  # intact tiles still read
        with pytest.raises(TileReadError, match=r"corrupt.tif: cannot decode stored tile \(8, 3\)"):
            s.read_region((2048, 768), 0, (256, 256))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "wsi_pipeline", *args], capture_output=True, text=True, timeout=120)


def test_cli_info(pyramid_tiff):
    r = _cli("info", pyramid_tiff, "--json")
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    assert info["dimensions"] == [4100, 3000] and info["level_count"] == 3
    assert info["mpp"] == pytest.approx([0.25, 0.25]) and info["backend"] == "tifffile"
    r = _cli("info", pyramid_tiff)
    assert r.returncode == 0 and "downsample 4" in r.stdout


@pytest.mark.parametrize("content", [None, b"", b"not a slide at all"])
def test_cli_bad_input_one_line_no_traceback(tmp_path, content):
    p = tmp_path / "bad.svs"
    if content is not None:
        p.write_bytes(content)
    r = _cli("info", str(p))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "bad.svs" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_closed_slide_refuses_reads(pyramid_tiff):
    s = open_slide(pyramid_tiff)
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.read_region((0, 0), 0, (10, 10))


def test_no_warnings_on_good_slide(pyramid_tiff):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_slide(pyramid_tiff) as s:
            s.read_region((0, 0), 0, (10, 10))


def test_stored_tiles_read_at_once_equal_each_read_alone(tmp_path):
    """TiffSlide.raw_tiles_jpeg (one read of the span) against the per-tile definition, every level."""
    from wsi_pipeline.slide.base import Slide
    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.synthetic import write_synthetic_slide

    path = tmp_path / "s.tiff"
    write_synthetic_slide(path, 2048, 1536, seed=3, kind="pathology")
    with TiffSlide(path) as slide:
        for level in range(slide.level_count):
            _, _, across, down = slide.tile_grid_shape(level)
            coords = [(x, y) for y in range(down) for x in range(across)]
            for pick in (coords, coords[::3], coords[::-1], coords[:1]):
                buf, lengths = slide.raw_tiles_jpeg(level, pick)
                each = [slide.raw_tile_jpeg(level, x, y) for x, y in pick]
                assert lengths.tolist() == [len(b) for b in each]
                assert buf.tobytes() == b"".join(each)
                ref_buf, ref_lengths = Slide.raw_tiles_jpeg(slide, level, pick)
                assert ref_buf.tobytes() == buf.tobytes() and ref_lengths.tolist() == lengths.tolist()


def test_stored_tiles_past_the_files_end_are_an_error_naming_it(tmp_path):
    from wsi_pipeline.errors import SlideError
    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.synthetic import write_synthetic_slide

    path = tmp_path / "s.tiff"
    write_synthetic_slide(path, 1024, 1024, seed=3, kind="pathology")
    with TiffSlide(path) as slide:
        _, _, across, down = slide.tile_grid_shape(0)
        coords = [(x, y) for y in range(down) for x in range(across)]
        with tifffile.TiffFile(path) as tif:  # where the file stores level 0's tiles
            page = tif.series[0].levels[0].keyframe
            end = max(o + n for o, n in zip(page.dataoffsets, page.databytecounts, strict=True))
        os.truncate(path, end - 10)  # the opened file loses its last stored tile's end
        with pytest.raises(SlideError, match=r"s\.tiff.*ends inside its stored tiles"):
            slide.raw_tiles_jpeg(0, coords)
