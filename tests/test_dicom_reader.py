"""The dicom reader: DICOM WSI series of JPEG Baseline frames read frame by frame, as OpenSlide reads them."""

from __future__ import annotations

import os

import numpy as np
import pydicom
import pytest
import simplejpeg
import tifffile
from helpers import smooth_rgb, write_dicom_wsi

from wsi_pipeline import Pipeline
from wsi_pipeline.cli import main as cli_main
from wsi_pipeline.errors import SlideOpenError, TileReadError
from wsi_pipeline.slide import detect_backend, open_slide
from wsi_pipeline.slide.dicom_backend import DicomSlide
from wsi_pipeline.synthetic import write_synthetic_slide

H, W = 1000, 1300


def _image() -> np.ndarray:
    image = smooth_rgb(H, W, seed=3)
    image[:300, :600] = 255  # the sparse levels' tiles (0, 0) and (1, 0) have no frame
    return image


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """``(jpeg, sparse) -> level files`` of one image stored each way, three levels, with label and overview."""
    root = tmp_path_factory.mktemp("dicom")
    image = _image()
    out = {}
    for jpeg in ("YBR_FULL_422", "YBR_FULL", "RGB"):
        for sparse in (False, True):
            folder = root / f"{jpeg}_{'sparse' if sparse else 'full'}"
            folder.mkdir()
            out[jpeg, sparse] = write_dicom_wsi(
                folder, "s", image, levels=3, jpeg=jpeg, sparse=sparse, associated=("LABEL", "OVERVIEW")
            )
    return out


def _within_2_levels(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got.astype(int) - want.astype(int)).max(axis=-1) <= 2).mean())


def _regions(level_w: int, level_h: int, downsample: float):
    """Regions in and across a level's edges: (level-0 location, size)."""
    for x, y, w, h in ((0, 0, level_w, level_h), (-40, -30, 300, 200), (level_w - 90, level_h - 70, 200, 150)):
        yield (round(x * downsample), round(y * downsample)), (w, h)
    yield (round(200 * downsample), round(100 * downsample)), (min(517, level_w), min(263, level_h))


@pytest.mark.parametrize("jpeg", ["YBR_FULL_422", "RGB"])
@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
def test_regions_equal_openslides(series, jpeg, sparse):
    path = series[jpeg, sparse][0]
    with open_slide(path) as got, open_slide(path, "openslide") as want:
        assert got.backend == "dicom"
        assert got.level_dimensions == want.level_dimensions == ((W, H), (650, 500), (325, 250))
        assert got.level_downsamples == pytest.approx(want.level_downsamples)
        for level, ((lw, lh), ds) in enumerate(zip(got.level_dimensions, got.level_downsamples, strict=True)):
            for loc, size in _regions(lw, lh, ds):
                assert _within_2_levels(got.read_region(loc, level, size), want.read_region(loc, level, size)) >= 0.999


def test_levels_mpp_and_what_is_skipped(series):
    paths = series["YBR_FULL_422", False]
    folder = paths[0].parent
    assert sorted(p.name for p in folder.iterdir()) == [
        "s_0.dcm",
        "s_1.dcm",
        "s_2.dcm",
        "s_label.dcm",
        "s_overview.dcm",
    ]
    for where in (folder, paths[2], paths[1]):  # the folder, or any level's file: the same slide
        with DicomSlide(where) as s:
            assert s.level_dimensions == ((W, H), (650, 500), (325, 250))
            assert s.mpp == pytest.approx((0.25, 0.25))
            assert s.vendor == "dicom"
            assert [s.tile_grid_shape(i) for i in range(3)] == [(256, 256, 6, 4), (256, 256, 3, 2), (256, 256, 2, 1)]


@pytest.mark.parametrize(
    ("jpeg", "photometric", "kind"),
    [("YBR_FULL_422", "YCBCR", "YCbCr 4:2:2"), ("YBR_FULL", "YCBCR", "YCbCr 4:4:4"), ("RGB", "RGB", "RGB")],
)
def test_stored_tile_format_names_the_photometric_and_jpeg_kind(series, jpeg, photometric, kind):
    with DicomSlide(series[jpeg, False][0]) as s:
        assert s.stored_tile_format(1) == {
            "jpeg_kind": kind,
            "jpeg_baseline": True,
            "compression": "JPEG",
            "photometric": photometric,
            "samples_per_pixel": 3,
            "planar": 1,
            "extra_samples": 0,
        }


@pytest.mark.parametrize("jpeg", ["YBR_FULL_422", "YBR_FULL", "RGB"])
@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
def test_raw_frames_decode_to_the_readers_tiles(series, jpeg, sparse):
    with DicomSlide(series[jpeg, sparse][0]) as s:
        for level in range(s.level_count):
            tw, th, across, down = s.tile_grid_shape(level)
            lw, lh = s.level_dimensions[level]
            pixels = s.read_region((0, 0), level, (across * tw, down * th))
            tiles = [(tx, ty) for ty in range(down) for tx in range(across)]
            buf, lengths = s.raw_tiles_jpeg(level, tiles)
            assert lengths.sum() == len(buf)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            for (tx, ty), start, n in zip(tiles, starts, lengths, strict=True):
                stream = buf[start : start + n].tobytes()
                assert stream == s.raw_tile_jpeg(level, tx, ty)
                want = pixels[ty * th : (ty + 1) * th, tx * tw : (tx + 1) * tw]
                if sparse and level == 0 and ty == 0 and tx < 2:
                    assert n == 0 and (want == 255).all()  # no frame: background
                    continue
                got = simplejpeg.decode_jpeg(stream)
                inside = (slice(0, lh - ty * th), slice(0, lw - tx * tw))
                np.testing.assert_array_equal(got[inside], want[inside])
                decoded = s.decode_stored_tile(level, tx, ty, np.empty((th, tw, 3), np.uint8))
                np.testing.assert_array_equal(decoded[inside], want[inside])


def test_444_frames_openslide_refuses_are_read(series):
    """OpenSlide refuses JPEG frames in YBR_FULL (no chroma subsampling); this reader reads them."""
    image = _image()
    with DicomSlide(series["YBR_FULL", False][0]) as s:
        for level in range(3):
            got = s.read_region((0, 0), level, s.level_dimensions[level])
            want = image[:: 2**level, :: 2**level]
            assert np.abs(got.astype(int) - want).mean() < 3


def test_detect_backend_picks_the_dicom_reader_and_openslide_for_the_rest(series, tmp_path):
    paths = series["RGB", True]
    assert detect_backend(str(paths[0])) == detect_backend(str(paths[1])) == "dicom"
    assert detect_backend(str(paths[0].parent)) == "dicom"
    raw = tmp_path / "raw"
    raw.mkdir()
    uncompressed = write_dicom_wsi(raw, "u", _image()[:512, :512], levels=2)
    assert detect_backend(str(uncompressed[0])) == "openslide"  # not JPEG: OpenSlide reads it
    with pytest.raises(SlideOpenError, match=r"u_0\.dcm: its frames are Explicit VR Little Endian"):
        DicomSlide(uncompressed[0])
    write_dicom_wsi(raw, "v", _image()[:256, :256], levels=1, jpeg="YBR_FULL_422")
    with pytest.raises(SlideOpenError, match="folder holds 2 DICOM WSI slides"):
        detect_backend(str(raw))


def test_info_names_the_reader(series, capsys):
    assert cli_main(["info", str(series["YBR_FULL_422", False][1])]) == 0
    assert "(read with dicom)" in capsys.readouterr().out


# -- crafted files -------------------------------------------------------------------------------
def _copy_level(series, tmp_path, **header):
    """A copy of a one-level series' file with ``header`` values replaced."""
    src = series["YBR_FULL_422", False][2]
    path = tmp_path / "crafted.dcm"
    ds = pydicom.dcmread(src)
    for name, value in header.items():
        setattr(ds, name, value)
    ds.save_as(path)
    return path


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"NumberOfFrames": 10**9},
            r"claims 1000000000 frames; a 2x1 tile grid and a file of \d+ bytes hold at most 2",
        ),
        ({"Rows": 65535, "Columns": 65535}, "frames claim 65535x65535 pixels"),
        (
            {"TotalPixelMatrixColumns": 2**31, "TotalPixelMatrixRows": 2**31},
            r"2147483648x2147483648 pixels in 256x256 frames is \d+ tiles",
        ),
        ({"DimensionOrganizationType": "TILED_SPARSE"}, "TILED_SPARSE with 2 frames but 0 per-frame positions"),
    ],
)
def test_forged_headers_are_refused_naming_the_file(series, tmp_path, header, message):
    path = _copy_level(series, tmp_path, **header)
    with pytest.raises(SlideOpenError, match=rf"crafted\.dcm: {message}"):
        open_slide(path)


def test_frames_past_the_end_of_the_file_are_refused(series, tmp_path):
    path = _copy_level(series, tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(SlideOpenError, match=r"crafted\.dcm: pixel data: frame 1 claims \d+ bytes .* past the end"):
        open_slide(path)
    with open(path, "r+b") as f:  # a frame item's length forged to reach past the end
        data = f.read()
        at = data.rindex(b"\xfe\xff\x00\xe0")
        f.seek(at + 4)
        f.write((2**32 - 2).to_bytes(4, "little"))
    with pytest.raises(SlideOpenError, match=r"crafted\.dcm: pixel data: frame 1 claims 4294967294 bytes"):
        open_slide(path)


def test_a_damaged_frame_fails_the_read_naming_the_file(series, tmp_path):
    path = _copy_level(series, tmp_path)
    with DicomSlide(path) as s:
        frame = s.raw_tile(0, 1, 0)  # the stored bytes of frame (1, 0): found in the file
    with open(path, "rb") as f:
        offset, n = f.read().index(frame), len(frame)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * n)
    with DicomSlide(path) as s:
        s.read_region((0, 0), 0, (256, 250))  # the other frame reads
        with pytest.raises(TileReadError, match=r"crafted\.dcm: cannot decode frame \(1, 0\) of crafted\.dcm"):
            s.read_region((0, 0), 0, (325, 250))


# -- a run -------------------------------------------------------------------------------------
def _write_tiff_of(slide, path) -> None:
    """A tiled TIFF of every level of ``slide`` as it reads them (losslessly: the same pixels)."""
    mpp = slide.mpp[0]
    kw = dict(tile=(256, 256), compression="zlib", photometric="rgb")
    with tifffile.TiffWriter(path) as tw:
        for level, (w, h) in enumerate(slide.level_dimensions):
            pixels = slide.read_region((0, 0), level, (w, h))
            if level == 0:
                tw.write(pixels, resolution=(1e4 / mpp, 1e4 / mpp), resolutionunit="CENTIMETER", **kw)
            else:
                tw.write(pixels, subfiletype=1, **kw)


def test_a_run_on_a_dicom_wsi_finds_what_it_finds_in_a_tiff_of_its_pixels(tmp_path):
    write_synthetic_slide(tmp_path / "scene.tiff", 1536, 1280, seed=11, kind="pathology")
    with open_slide(tmp_path / "scene.tiff") as scene:
        image = scene.read_region((0, 0), 0, scene.dimensions)
    folder = tmp_path / "dicom"
    folder.mkdir()
    paths = write_dicom_wsi(folder, "scene", image, levels=3, jpeg="YBR_FULL_422", associated=("LABEL",))
    with DicomSlide(paths[0]) as s:
        _write_tiff_of(s, tmp_path / "same_pixels.tif")
    with Pipeline.from_card(backend="ort") as pipe:
        from_dicom = pipe.run(paths[0])
        from_tiff = pipe.run(tmp_path / "same_pixels.tif")
    assert from_dicom.summary["tiles"] == from_tiff.summary["tiles"]
    assert len(from_dicom.detections) > 20
    np.testing.assert_array_equal(from_dicom.detections, from_tiff.detections)


# -- the GPU loader, on the CPU device ---------------------------------------------------------
@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
@pytest.mark.parametrize("decoder", ["threads", "nvjpeg", "helpers"])
def test_the_gpu_loader_reads_the_frames_as_the_reader_does(series, sparse, decoder):
    """Frames decoded as stored tiles (by threads, torchvision's decoder, or the JPEG helper
    processes) give the reader's pixels; frames missing from a sparse level stay background."""
    pytest.importorskip("torchvision")
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader
    from wsi_pipeline.tiling.grid import TileGrid, read_tile
    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers

    with DicomSlide(series["YBR_FULL_422", sparse][0]) as s:
        tiles = list(TileGrid(s, 512, 64, level=0))
        helpers = JpegHelpers(1, 16, timeout_s=60) if decoder == "helpers" else None
        jpeg_decoder = "threads" if decoder == "threads" else "nvjpeg"
        try:
            loader = GpuTileLoader(s, tiles, batch_size=4, device="cpu", jpeg_decoder=jpeg_decoder, helpers=helpers)
            got = {t.index: img for b in loader for t, img in zip(b.tiles, b.images.numpy(), strict=True)}
        finally:
            if helpers is not None:
                helpers.close()
        for t in tiles:
            want = read_tile(s, t)
            if decoder == "nvjpeg":  # another libjpeg build's upsampling
                assert np.abs(got[t.index].astype(int) - want).mean() < 2
            else:
                np.testing.assert_array_equal(got[t.index], want)
        assert loader.decoder.cpu_fallback_batches == 0
        assert (loader.decoder.stored_tiles_by_helpers > 0) == (decoder == "helpers")
