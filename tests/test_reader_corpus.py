"""The readers against OpenSlide on files laid out as other writers lay them out.

Every layout of :mod:`helpers.slide_corpus` (Aperio and generic TIFF as scanners, converters and
anonymisers write them) and every JPEG stream flavour is written, opened by the project's reader
and by OpenSlide, and compared: the same levels, downsamples, mpp and associated image names, and
each level's pixels within 2 levels on 99.9 % of pixels. The streams the GPU decoders are handed
(``raw_tiles_jpeg``) decode, by a decoder that follows the streams' own markers as nvJPEG does, to
the CPU reader's pixels. Damage (a truncated or overwritten tile) is seen in every flavour.
"""

from __future__ import annotations

import cv2
import numpy as np
import openslide
import pytest
import simplejpeg
import tifffile
from helpers import write_dicom_wsi
from helpers.slide_corpus import FLAVOURS, aperio_layouts, encode_tile, generic_layouts, write_layout

from wsi_pipeline.errors import TileReadError
from wsi_pipeline.slide import open_slide

LAYOUTS = {lay.name: lay for lay in aperio_layouts() + generic_layouts()}
# Where OpenSlide refuses the file, the project reads it: its levels (largest first) and the notes
# on the pages it set apart.
OPENSLIDE_REFUSES = {
    "aperio-tiled-label": (((1000, 760), (250, 190)), "not a level"),
    "aperio-tiled-thumbnail": (((1000, 760), (250, 190), (125, 95)), None),
    "aperio-levels-out-of-order": (((1000, 760), (250, 190), (63, 48)), None),
    "aperio-page-larger-than-level-0": (((1000, 760), (250, 190)), "larger than level 0"),
}
# Pyramids in page 0's SubIFDs: OpenSlide sees level 0 alone; the project the same level 0 and the
# SubIFDs that are reduced copies of it as levels, the others set apart with the note given.
SUBIFD_LEVELS = {
    "generic-subifds": (((1000, 760), (500, 380), (250, 190)), "levels taken from page 0's SubIFDs"),
    "generic-subifds-unflagged": (((1000, 760), (500, 380), (250, 190)), "levels taken from page 0's SubIFDs"),
    "generic-subifds-rgb": (((1000, 760), (500, 380), (250, 190)), "levels taken from page 0's SubIFDs"),
    "generic-subifds-bigtiff": (((1000, 760), (500, 380), (250, 190)), "SubIFDs"),
    "generic-subifds-larger": (((1000, 760), (250, 190)), "larger than level 0"),
    "generic-subifds-stripped": (((1000, 760), (250, 190)), "not tiled"),
    "generic-subifds-page": (((1000, 760), (250, 190)), "NewSubfileType is 2"),
}


def _close_enough(got: np.ndarray, want: np.ndarray) -> float:
    """The share of pixels whose channels differ by more than 2 levels."""
    return float((np.abs(got.astype(int) - want.astype(int)).max(axis=-1) > 2).mean())


def _assert_levels_are_level_0_shrunk(
    slide, levels: tuple, from_level_above: bool = False, mean_levels: float = 4.0
) -> None:
    """Each level the image shrunk: level 0, or (``from_level_above``, as a writer that halves
    level by level makes them) the level above."""
    base = slide.read_region((0, 0), 0, levels[0])
    for level, (w, h) in enumerate(levels[1:], 1):
        shrunk = cv2.resize(base, (w, h), interpolation=cv2.INTER_AREA)
        if from_level_above:
            base = slide.read_region((0, 0), level, (w, h))
        got = slide.read_region((0, 0), level, (w, h))
        assert np.abs(got.astype(int) - shrunk).mean() < mean_levels, f"level {level}"


def _assert_same_as_openslide(path: str) -> None:
    with open_slide(path, "tifffile") as ours, openslide.OpenSlide(path) as ref:
        assert ours.level_dimensions == tuple(ref.level_dimensions)
        np.testing.assert_allclose(ours.level_downsamples, ref.level_downsamples, rtol=1e-9)
        mpp = ref.properties.get(openslide.PROPERTY_NAME_MPP_X)
        assert ours.mpp == (None if mpp is None else pytest.approx((float(mpp), float(mpp))))
        assert sorted(ours.associated_image_names) == sorted(ref.associated_images)
        for level, (w, h) in enumerate(ours.level_dimensions):
            want = np.asarray(ref.read_region((0, 0), level, (w, h)))[..., :3]
            assert _close_enough(ours.read_region((0, 0), level, (w, h)), want) <= 0.001, f"level {level}"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_read_as_openslide_reads_them(tmp_path, name):
    path = str(tmp_path / f"{name}.svs")
    write_layout(path, LAYOUTS[name])
    if name in OPENSLIDE_REFUSES:
        levels, note = OPENSLIDE_REFUSES[name]
        with pytest.raises(openslide.OpenSlideError):
            openslide.OpenSlide(path)
        with open_slide(path, "tifffile") as ours:
            assert ours.level_dimensions == levels
            assert note is None or any(note in n for n in ours.level_notes)
            _assert_levels_are_level_0_shrunk(ours, levels)
        return
    if name in SUBIFD_LEVELS:
        levels, note = SUBIFD_LEVELS[name]
        with open_slide(path, "tifffile") as ours, openslide.OpenSlide(path) as ref:
            assert ref.level_count == 1 and ours.level_dimensions == levels
            assert any(note in n for n in ours.level_notes), ours.level_notes
            mpp = ref.properties.get(openslide.PROPERTY_NAME_MPP_X)
            assert ours.mpp == (None if mpp is None else pytest.approx((float(mpp), float(mpp))))
            want = np.asarray(ref.read_region((0, 0), 0, levels[0]))[..., :3]
            assert _close_enough(ours.read_region((0, 0), 0, levels[0]), want) <= 0.001
            _assert_levels_are_level_0_shrunk(ours, levels)
        return
    _assert_same_as_openslide(path)


def test_an_ome_pyramid_has_openslides_level_0_and_its_subifds_as_levels(tmp_path):
    """OpenSlide reads an OME-TIFF as a generic TIFF: its level 0 alone (the reduced levels are
    SubIFDs). The project reads the same level 0 and the SubIFDs as its levels (a decision:
    docs/ARCHITECTURE.md), each the level above shrunk."""
    from helpers import smooth_rgb, write_pyramid_tiff

    path = str(tmp_path / "s.ome.tiff")
    image = smooth_rgb(760, 1000, seed=4)
    write_pyramid_tiff(path, image, levels=3, tile=128, subifds=True, mpp=0.5)
    with open_slide(path, "tifffile") as ours, openslide.OpenSlide(path) as ref:
        assert ref.level_count == 1 and ours.level_dimensions[0] == ref.level_dimensions[0]
        assert ours.level_dimensions == ((1000, 760), (500, 380), (250, 190))
        want = np.asarray(ref.read_region((0, 0), 0, (1000, 760)))[..., :3]
        assert _close_enough(ours.read_region((0, 0), 0, (1000, 760)), want) <= 0.001
        shrunk = image
        for level in (1, 2):  # each SubIFD the one above halved, as the file's writer made it
            w, h = ours.level_dimensions[level]
            shrunk = cv2.resize(shrunk, (w, h), interpolation=cv2.INTER_AREA)
            # JPEG 4:2:0 at quality 90 on this busy image: level 0 itself is 3.1 levels off its source.
            assert np.abs(ours.read_region((0, 0), level, (w, h)).astype(int) - shrunk).mean() < 4


def test_a_plain_tiff_with_subifds_has_openslides_level_0_and_its_subifds_as_levels(tmp_path):
    """Reduced levels in SubIFDs without OME metadata, written by tifffile's own writer as its
    documentation shows (``subifds=``, JPEG RGB in, YCbCr stored): OpenSlide reads the main chain's
    page alone, level 0; the project reads the same level 0 and the SubIFDs as levels, noted."""
    from helpers import smooth_rgb

    image = smooth_rgb(760, 1000, seed=5)
    half = cv2.resize(image, (500, 380), interpolation=cv2.INTER_AREA)
    quarter = cv2.resize(half, (250, 190), interpolation=cv2.INTER_AREA)
    kw = dict(tile=(128, 128), compression="jpeg", photometric="rgb", metadata=None)
    kw["compressionargs"] = {"level": 90, "outcolorspace": "ycbcr"}
    path = str(tmp_path / "subifds.tif")
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        tw.write(image, subifds=2, resolution=(4e4, 4e4), resolutionunit="CENTIMETER", **kw)
        for level in (half, quarter):
            tw.write(level, subfiletype=1, **kw)
    with openslide.OpenSlide(path) as ref, open_slide(path, "tifffile") as ours:
        assert ref.level_count == 1
        assert ours.level_dimensions == ((1000, 760), (500, 380), (250, 190))
        assert ours.mpp == pytest.approx((0.25, 0.25))
        assert any("0/SubIFD 0, 0/SubIFD 1" in n for n in ours.level_notes), ours.level_notes
        want = np.asarray(ref.read_region((0, 0), 0, (1000, 760)))[..., :3]
        assert _close_enough(ours.read_region((0, 0), 0, (1000, 760)), want) <= 0.001
        _assert_levels_are_level_0_shrunk(ours, ours.level_dimensions)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("kind", ["aperio-reduced-flagged", "generic-pyramid"])
def test_stream_flavours_read_as_openslide_reads_them(tmp_path, flavour, kind):
    layouts = aperio_layouts(flavour) if kind.startswith("aperio") else generic_layouts(flavour)
    path = str(tmp_path / f"{kind}.tif")
    source = write_layout(path, next(lay for lay in layouts if lay.name == kind))
    _assert_same_as_openslide(path)
    with open_slide(path, "tifffile") as ours:  # and the pixels are the scene's, not a colour-space mix-up
        assert np.abs(ours.read_region((0, 0), 0, (1000, 760)).astype(int) - source).mean() < 6


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_gpu_streams_decode_to_the_cpu_readers_pixels(tmp_path, flavour):
    """Streams handed to a decoder that is told no colour space (nvJPEG follows the markers, as
    libjpeg does untold) decode to what the CPU reader gives, mixed flavours in a level included."""
    path = str(tmp_path / "s.tif")
    layout = next(lay for lay in aperio_layouts(flavour) if lay.name == "aperio-mixed-streams")
    write_layout(path, layout)
    with open_slide(path, "tifffile") as s:
        _, _, across, down = s.tile_grid_shape(0)
        tiles = [(tx, ty) for ty in range(down) for tx in range(across)]
        buf, lengths = s.raw_tiles_jpeg(0, tiles)
        ends = np.cumsum(lengths)
        for (tx, ty), end, n in zip(tiles, ends, lengths, strict=True):
            untold = simplejpeg.decode_jpeg(buf[end - n : end].tobytes(), strict=True)
            want = s.decode_stored_tile(0, tx, ty, np.empty_like(untold))
            assert np.array_equal(untold, want), (tx, ty)
            assert np.array_equal(simplejpeg.decode_jpeg(s.raw_tile_jpeg(0, tx, ty)), want)


def _damage(path: str, how: str, tile: int = 5) -> None:
    with tifffile.TiffFile(path) as tif:
        off, n = tif.pages[0].dataoffsets[tile], tif.pages[0].databytecounts[tile]
    with open(path, "r+b") as f:
        if how == "truncated":  # the tile's second half zeroed, its EOI gone (as a short write leaves it)
            f.seek(off + n // 2)
            f.write(b"\0" * (n - n // 2))
        else:  # a sector in the middle of the scan overwritten (a run short enough to leave a valid
            # code sequence of the same length goes unseen by libjpeg, and so by OpenSlide too)
            f.seek(off + n // 2 - 256)
            f.write(bytes(np.random.default_rng(3).integers(0, 255, 512, dtype=np.uint8)))


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_damage_is_seen_in_every_flavour(tmp_path, flavour, how):
    path = str(tmp_path / "s.tif")
    write_layout(path, next(lay for lay in generic_layouts(flavour) if lay.name == "generic-one-level"))
    _damage(path, how)
    tx, ty = 5 % 5, 5 // 5  # tile 5 of 5 x 4 stored tiles
    with open_slide(path, "tifffile") as s:
        try:
            s.read_region((0, 0), 0, (1000, 760))
        except TileReadError as exc:  # not decodable at all: the read fails naming the tile
            assert f"({tx}, {ty})" in str(exc)
        else:
            assert [(t.col, t.row) for t in s.damaged_tiles] == [(tx, ty)]
    with open_slide(path, "tifffile") as s:
        s.on_damaged_tile = "fail"
        with pytest.raises(TileReadError, match=rf"\({tx}, {ty}\)"):
            s.read_region((0, 0), 0, (1000, 760))
    if how == "truncated":  # the streams for the GPU report it too
        with open_slide(path, "tifffile") as s:
            s.on_damaged_tile = "fail"
            with pytest.raises(TileReadError, match=rf"\({tx}, {ty}\).*truncated"):
                s.raw_tiles_jpeg(0, [(tx, ty)])


def test_jpegtables_cut_in_half_fail_the_read(tmp_path):
    path = str(tmp_path / "s.tif")
    write_layout(path, next(lay for lay in aperio_layouts("rgb-012+tables") if lay.name == "aperio-one-level"))
    with tifffile.TiffFile(path) as tif:
        tag = tif.pages[0].tags[347]
        off, n = tag.valueoffset, tag.count
    with open(path, "r+b") as f:
        f.seek(off + n // 2)
        f.write(b"\0" * (n - n // 2))
    with open_slide(path, "tifffile") as s:  # every tile decodes with a warning: all counted
        s.read_region((0, 0), 0, (1000, 760))
        assert len(s.damaged_tiles) == 20
    with open_slide(path, "tifffile") as s, pytest.raises(TileReadError, match=r"stored tile \(0, 0\).*damaged"):
        s.on_damaged_tile = "fail"
        s.read_region((0, 0), 0, (512, 512))


def _twelve_bit(stream: bytes) -> bytes:
    """``stream`` whose frame header claims 12-bit samples (a 12-bit stream in an 8-bit page)."""
    at = stream.index(b"\xff\xc0") + 4
    return stream[:at] + b"\x0c" + stream[at + 1 :]


def test_a_12_bit_stream_in_an_8_bit_page_is_refused_naming_the_tile(tmp_path):
    path = str(tmp_path / "s.tif")
    write_layout(path, next(lay for lay in generic_layouts("ycbcr-jfif") if lay.name == "generic-one-level"))
    with tifffile.TiffFile(path) as tif:
        off, n = tif.pages[0].dataoffsets[1], tif.pages[0].databytecounts[1]
    with open(path, "r+b") as f:
        f.seek(off)
        stream = f.read(n)
        f.seek(off)
        f.write(_twelve_bit(stream))
    with open_slide(path, "tifffile") as s:
        s.read_region((0, 0), 0, (200, 200))  # tile (0, 0) is 8-bit
        with pytest.raises(TileReadError, match=r"stored tile \(1, 0\) of level 0: a 12-bit JPEG stream"):
            s.read_region((0, 0), 0, (1000, 760))
        with pytest.raises(TileReadError, match=r"12-bit"):
            s.raw_tiles_jpeg(0, [(1, 0)])


@pytest.mark.parametrize(
    ("photometric", "flavour"),
    [("RGB", "rgb-012"), ("RGB", "rgb-jfif"), ("RGB", "rgb-123"), ("YBR_FULL_422", "ycbcr-adobe0")],
)
def test_dicom_frames_of_every_flavour_read_as_openslide_reads_them(tmp_path, monkeypatch, photometric, flavour):
    import helpers

    def frame_bytes(frame, _photometric):
        return encode_tile(frame, flavour)

    monkeypatch.setattr(helpers, "_dicom_frame_bytes", frame_bytes)
    image = helpers.smooth_rgb(700, 900, seed=5)
    extra = ("LABEL", "OVERVIEW", "THUMBNAIL")[: 1 + len(flavour) % 3]
    paths = write_dicom_wsi(tmp_path, "s", image, levels=2, jpeg=photometric, associated=extra)
    with open_slide(str(paths[0]), "dicom") as ours, openslide.OpenSlide(str(paths[0])) as ref:
        assert ours.level_dimensions == tuple(ref.level_dimensions)
        assert sorted(ours.associated_image_names) == sorted(ref.associated_images)
        for level, (w, h) in enumerate(ours.level_dimensions):
            want = np.asarray(ref.read_region((0, 0), level, (w, h)))[..., :3]
            assert _close_enough(ours.read_region((0, 0), level, (w, h)), want) <= 0.001
        assert np.abs(ours.read_region((0, 0), 0, (900, 700)).astype(int) - image).mean() < 6


@pytest.mark.parametrize("tile", [128, 512])
@pytest.mark.parametrize("photometric", ["YBR_FULL_422", "RGB"])
def test_dicom_series_of_other_frame_sizes_read_as_openslide_reads_them(tmp_path, photometric, tile):
    import helpers

    image = helpers.smooth_rgb(700, 900, seed=5)
    paths = write_dicom_wsi(tmp_path, "s", image, levels=3, jpeg=photometric, tile=tile, associated=("THUMBNAIL",))
    with open_slide(str(paths[0]), "dicom") as ours, openslide.OpenSlide(str(paths[0])) as ref:
        assert ours.level_dimensions == tuple(ref.level_dimensions)
        assert sorted(ours.associated_image_names) == sorted(ref.associated_images)
        for level, (w, h) in enumerate(ours.level_dimensions):
            want = np.asarray(ref.read_region((0, 0), level, (w, h)))[..., :3]
            assert _close_enough(ours.read_region((0, 0), level, (w, h)), want) <= 0.001, f"level {level}"


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif("not __import__('torch').cuda.is_available()")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["aperio-reduced-flagged", "aperio-mixed-streams"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_gpu_loader_gives_the_cpu_readers_pixels_in_every_flavour(tmp_path, flavour, layout, device):
    """The decoder the GPU path picks for the level (nvJPEG for YCbCr, nvImageCodec for RGB on CUDA;
    torchvision's CPU decoder on the CPU device), on a level of one flavour and on one whose every
    other tile is of another (YCbCr 4:2:0 streams in an RGB page: nvImageCodec decodes no
    subsampled RGB, and its batch falls back to the CPU reader, the pixels the same)."""
    pytest.importorskip("torchvision")
    from wsi_pipeline.tiling.gpu_decode import gpu_decode_plan
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader
    from wsi_pipeline.tiling.grid import TileGrid, read_tile

    path = str(tmp_path / "s.tif")
    write_layout(path, next(lay for lay in aperio_layouts(flavour) if lay.name == layout))
    with open_slide(path, "tifffile") as s:
        tiles = list(TileGrid(s, 512, 64, level=0))
        decoder = gpu_decode_plan(s, tiles)[0] if device == "cuda" else "nvjpeg"
        if decoder is None:
            pytest.skip(f"no GPU decoder for {flavour} here: {gpu_decode_plan(s, tiles)[1]}")
        with GpuTileLoader(s, tiles, batch_size=4, device=device, jpeg_decoder=decoder) as loader:
            got = {t.index: img for b in loader for t, img in zip(b.tiles, b.images.cpu().numpy(), strict=True)}
        for t in tiles:  # another libjpeg build's upsampling and IDCT: close, not equal
            assert np.abs(got[t.index].astype(int) - read_tile(s, t)).mean() < 2, (flavour, t.index)
        subsampled_rgb = layout == "aperio-mixed-streams" and decoder == "nvimgcodec"
        assert subsampled_rgb or loader.decoder.cpu_fallback_batches == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_truncated_tile_fails_the_gpu_loader_under_the_fail_policy(tmp_path, device):
    pytest.importorskip("torchvision")
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader
    from wsi_pipeline.tiling.grid import TileGrid

    path = str(tmp_path / "s.tif")
    write_layout(path, next(lay for lay in generic_layouts("ycbcr-jfif") if lay.name == "generic-one-level"))
    _damage(path, "truncated")
    with open_slide(path, "tifffile") as s:
        s.on_damaged_tile = "fail"
        tiles = list(TileGrid(s, 512, 64, level=0))
        with GpuTileLoader(s, tiles, batch_size=4, device=device, jpeg_decoder="nvjpeg") as loader:
            with pytest.raises(TileReadError, match=r"\(0, 1\)"):
                for _ in loader:
                    pass


def test_an_ome_subifd_larger_than_page_0_is_set_apart_not_level_0(tmp_path):
    """An OME-TIFF whose first SubIFD is larger than page 0 (other content): page 0 stays level 0,
    as OpenSlide reads it, and the larger page is not a level, with a note saying why."""
    from helpers import smooth_rgb

    image = smooth_rgb(380, 500, seed=6)
    larger = smooth_rgb(760, 1000, seed=8)
    quarter = cv2.resize(image, (125, 95), interpolation=cv2.INTER_AREA)
    kw = dict(tile=(128, 128), compression="jpeg", photometric="rgb")
    path = str(tmp_path / "larger.ome.tif")
    with tifffile.TiffWriter(path, ome=True) as tw:
        tw.write(image, subifds=2, metadata={"axes": "YXS"}, **kw)
        for level in (larger, quarter):
            tw.write(level, subfiletype=1, **kw)
    with openslide.OpenSlide(path) as ref, open_slide(path, "tifffile") as ours:
        assert ours.level_dimensions[0] == ref.level_dimensions[0] == (500, 380)
        assert ours.level_dimensions == ((500, 380), (125, 95))
        assert any("larger than level 0" in n for n in ours.level_notes), ours.level_notes
        want = np.asarray(ref.read_region((0, 0), 0, (500, 380)))[..., :3]
        assert _close_enough(ours.read_region((0, 0), 0, (500, 380)), want) <= 0.001


@pytest.mark.parametrize("compression", ["jpeg", "deflate"])
def test_a_libvips_subifd_pyramid_has_openslides_level_0_and_every_stored_level(tmp_path, compression):
    """``vips tiffsave --pyramid --subifd`` (libvips' own writer, as a user converting a slide
    would call it): OpenSlide sees level 0 alone; the project the same level 0 and every level."""
    pyvips = pytest.importorskip("pyvips", reason="pip install pyvips pyvips-binary (the dev extra)")
    from helpers import smooth_rgb

    image = smooth_rgb(1536, 2048, seed=9)  # halved evenly: libvips rounds odd sizes its own way
    path = str(tmp_path / "vips.tif")
    vips_image = pyvips.Image.new_from_array(image).copy(xres=4000.0, yres=4000.0)  # px/mm: 0.25 um/px
    vips_image.tiffsave(path, tile=True, pyramid=True, subifd=True, compression=compression, Q=90, resunit="cm")
    with openslide.OpenSlide(path) as ref, open_slide(path, "tifffile") as ours:
        assert ref.level_count == 1
        assert ours.level_dimensions == ((2048, 1536), (1024, 768), (512, 384), (256, 192), (128, 96))
        assert ours.mpp == pytest.approx((0.25, 0.25))
        assert any("SubIFD" in n for n in ours.level_notes)
        want = np.asarray(ref.read_region((0, 0), 0, (2048, 1536)))[..., :3]
        assert _close_enough(ours.read_region((0, 0), 0, (2048, 1536)), want) <= 0.001
        _assert_levels_are_level_0_shrunk(ours, ours.level_dimensions, from_level_above=True)
