"""Hostile and damaged slide files: no hang, no unbounded allocation, only the project's errors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg
import tifffile
from fuzz_slides import _parse_tiff, _put_uint, png_bomb
from helpers import smooth_rgb, write_pyramid_tiff

from wsi_pipeline import Pipeline, open_slide
from wsi_pipeline.errors import SlideOpenError, TileReadError
from wsi_pipeline.slide import base as slide_base
from wsi_pipeline.slide.tiff_backend import TiffSlide
from wsi_pipeline.synthetic import write_synthetic_slide


def _cli(*args, limit_bytes: int | None = None):
    """``wsi-pipeline ARGS`` in a subprocess, under an address-space limit if given."""
    pre = ""
    if limit_bytes:
        pre = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes})); "
    code = pre + "import sys; from wsi_pipeline.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def _assert_one_line_error(r, name: str, *words: str) -> None:
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert name in r.stderr and all(w in r.stderr for w in words), r.stderr


def _tiff(tmp_path, name="s.tif", levels=3, bigtiff=False, compression="jpeg"):
    path = tmp_path / name
    write_pyramid_tiff(path, smooth_rgb(768, 1024, seed=4), levels=levels, tile=256, compression=compression)
    if bigtiff:  # the same pages in a BigTIFF
        with tifffile.TiffFile(path) as tif:
            pages = [p.asarray() for p in tif.pages]
        with tifffile.TiffWriter(path, bigtiff=True) as tw:
            for i, p in enumerate(pages):
                tw.write(p, tile=(256, 256), compression=compression, photometric="rgb", subfiletype=1 if i else 0)
    return path


def _edit_tag(path, tag: int, value: int, ifd: int = 0, element: int = 0) -> None:
    """Overwrite one value of a tag in place (for an array tag, its ``element``)."""
    buf = bytearray(path.read_bytes())
    big, ifds = _parse_tiff(bytes(buf))
    e = next(e for e in ifds[ifd].entries if e.tag == tag)
    size = {3: 2, 4: 4, 16: 8}[e.type]
    inline = 8 if big else 4
    pos = e.pos + (12 if big else 8)
    if size * e.count > inline:
        pos = int.from_bytes(buf[pos : pos + inline], "little")
    _put_uint(buf, pos + element * size, size, value)
    path.write_bytes(bytes(buf))


# -- hangs -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bigtiff", [False, True])
def test_a_looping_page_chain_is_refused_not_followed(tmp_path, bigtiff):
    path = _tiff(tmp_path, "loop.tif", bigtiff=bigtiff)
    buf = bytearray(path.read_bytes())
    big, ifds = _parse_tiff(bytes(buf))
    assert big == bigtiff and len(ifds) == 3
    _put_uint(buf, ifds[2].next_pos, 8 if big else 4, ifds[0].offset)  # page 2 -> page 0
    path.write_bytes(bytes(buf))
    with pytest.raises(SlideOpenError, match=r"loop\.tif: TIFF page chain loops: page 2 points back to page 0"):
        open_slide(path)
    for backend in ("tifffile", "image", "openslide"):
        with pytest.raises(SlideOpenError, match="loop.tif"):
            open_slide(path, backend)
    _assert_one_line_error(_cli("info", str(path)), "loop.tif", "loops")


# -- memory --------------------------------------------------------------------------


@pytest.mark.parametrize("tag,value", [(322, 65535), (323, 65535), (322, 15_000_000)])
def test_forged_tile_size_is_refused_before_allocating(tmp_path, tag, value):
    path = _tiff(tmp_path, "forged.tif", levels=1, compression="zlib")
    buf = bytearray(path.read_bytes())
    _, ifds = _parse_tiff(bytes(buf))
    e = next(e for e in ifds[0].entries if e.tag == tag)
    _put_uint(buf, e.pos + 2, 2, 4)  # as LONG, so any value fits
    _put_uint(buf, e.pos + 8, 4, value)
    path.write_bytes(bytes(buf))
    with pytest.raises(SlideOpenError, match=r"forged\.tif: page 0: tiles claim .* at most 64 MiB"):
        open_slide(path)


def test_tile_offset_beyond_any_file_is_refused(tmp_path):
    path = _tiff(tmp_path, "far.tif", bigtiff=True)
    _edit_tag(path, 324, 2**64 - 16, ifd=0, element=1)
    with pytest.raises(SlideOpenError, match=r"far\.tif: page 0: file is truncated or claims an impossible size"):
        open_slide(path)


@pytest.mark.timeout(120)
def test_a_png_bomb_is_described_from_its_header_and_refused_before_decoding(tmp_path):
    path = tmp_path / "bomb.png"
    png_bomb(path, 30000, 30000, 1, 0)  # 110 kB of file, 900 Mpx
    assert path.stat().st_size < 200_000
    r = _cli("info", "--json", str(path), limit_bytes=1536 << 20)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dimensions"] == [30000, 30000]
    with (
        open_slide(path) as s,
        pytest.raises(
            SlideOpenError,
            match=r"bomb\.png: a 30000x30000 plain image needs "
            r"about .* GiB .* over the 2 GiB limit",
        ),
    ):
        s.read_region((0, 0), 0, (16, 16))


def test_the_thumbnail_of_a_large_level_is_read_in_bounded_bands(tmp_path, monkeypatch):
    path = tmp_path / "single.tif"
    image = smooth_rgb(1536, 2048, seed=7)
    write_pyramid_tiff(path, image, levels=1, tile=256)
    with open_slide(path) as s:
        whole = s.get_thumbnail(256)
        band_limit = 2048 * 3 * 200
        monkeypatch.setattr(slide_base, "THUMBNAIL_BAND_BYTES", band_limit)
        reads = []
        read_region = s.read_region

        def recording(location, level, size):
            reads.append(size[0] * size[1] * 3)
            return read_region(location, level, size)

        monkeypatch.setattr(s, "read_region", recording)
        banded = s.get_thumbnail(256)
    assert banded.shape == whole.shape == (192, 256, 3)
    assert len(reads) > 1 and max(reads) <= band_limit
    assert np.abs(banded.astype(int) - whole.astype(int)).mean() < 1.0


# -- tracebacks ----------------------------------------------------------------------


def test_unsupported_compression_is_refused_at_open(tmp_path):
    path = _tiff(tmp_path, "odd.tif", levels=1, compression="zlib")
    _edit_tag(path, 259, 52479)
    with pytest.raises(SlideOpenError, match=r"odd\.tif: .*compression 52479"):
        open_slide(path, "tifffile")
    _assert_one_line_error(_cli("info", str(path)), "odd.tif")


def test_malformed_resolution_is_unknown_not_an_error(tmp_path):
    path = _tiff(tmp_path, "res.tif", levels=1)
    buf = bytearray(path.read_bytes())
    _, ifds = _parse_tiff(bytes(buf))
    e = next(e for e in ifds[0].entries if e.tag == 282)
    _put_uint(buf, e.pos + 4, 4, 2)  # XResolution: two rationals where one is expected
    path.write_bytes(bytes(buf))
    with pytest.warns(UserWarning, match=r"res\.tif: malformed resolution tags"), open_slide(path) as s:
        assert s.mpp is None and s.dimensions == (1024, 768)


def test_an_unreadable_ome_pixel_size_is_unknown_not_an_error(tmp_path):
    path = tmp_path / "ome.ome.tif"
    write_pyramid_tiff(path, smooth_rgb(512, 512, seed=5), levels=2, subifds=True)
    buf = path.read_bytes()
    assert buf.count(b'PhysicalSizeX="0.25"') == 1
    path.write_bytes(buf.replace(b'PhysicalSizeX="0.25"', b'PhysicalSizeX="abc "'))
    with pytest.warns(UserWarning, match=r"ome\.ome\.tif: unreadable mpp"), open_slide(path) as s:
        assert s.mpp is None and s.level_count == 2


def test_what_a_reader_library_raises_becomes_a_project_error(tmp_path, monkeypatch):
    path = _tiff(tmp_path, "lib.tif", levels=1)

    def broken(self, *args):
        raise IndexError("list index out of range")

    monkeypatch.setattr(TiffSlide, "_init_levels", broken)
    with pytest.raises(SlideOpenError, match=r"lib\.tif: cannot be opened as a tifffile slide \(IndexError"):
        open_slide(path)
    monkeypatch.undo()
    with open_slide(path) as s:
        monkeypatch.setattr(TiffSlide, "_assemble", broken)
        with pytest.raises(TileReadError, match=r"lib\.tif: cannot read it \(IndexError.* at level-0 \(5, 6\)"):
            s.read_region((5, 6), 0, (10, 10))
        with pytest.raises(TileReadError, match="IndexError"):
            s.read_region_into((5, 6), 0, (10, 10), np.empty((10, 10, 3), np.uint8))


# -- silent corruption --------------------------------------------------------------


def _damage_a_tile(path, level: int = 0) -> tuple[int, int]:
    """Overwrite bytes inside one stored JPEG tile so it still decodes, with a corrupt-data warning.

    Returns the tile's (col, row).
    """
    with TiffSlide(path) as s:
        _, _, across, down = s.tile_grid_shape(level)
    col, row = across // 2, down // 2
    with tifffile.TiffFile(path) as tif:  # where the file stores the tile, and its shared JPEG tables
        page = tif.series[0].levels[level].keyframe
        i = row * across + col
        offset, count = int(page.dataoffsets[i]), int(page.databytecounts[i])
        tables = page.jpegtables
    buf = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    for _ in range(200):
        trial = bytearray(buf)
        for p in rng.integers(offset + count // 2, offset + count - 2, 4):
            trial[int(p)] = int(rng.integers(256))
        tile = bytes(trial[offset : offset + count])
        jpeg = tile[:2] + tables[2:-2] + tile[2:] if tables else tile
        try:
            simplejpeg.decode_jpeg(jpeg, strict=True)
        except ValueError:
            try:
                simplejpeg.decode_jpeg(jpeg, strict=False)
            except ValueError:
                continue
            path.write_bytes(bytes(trial))
            return col, row
    raise AssertionError("no damage found that still decodes")


def test_a_damaged_jpeg_tile_is_reported_or_fails_the_slide(tmp_path, caplog):
    path = _tiff(tmp_path, "damaged.tif", levels=1)
    col, row = _damage_a_tile(path)
    with caplog.at_level(logging.WARNING), open_slide(path) as s:
        assert s.on_damaged_tile == "warn"
        s.read_region((0, 0), 0, s.dimensions)
        s.read_region((0, 0), 0, s.dimensions)  # a tile is reported once
        [d] = s.damaged_tiles
        assert (d.level, d.col, d.row, d.x0_level0, d.y0_level0) == (0, col, row, col * 256, row * 256)
        assert "Corrupt JPEG data" in d.message
    assert f"damaged.tif: stored tile ({col}, {row}) of level 0 is damaged" in caplog.text
    with open_slide(path) as s:
        s.on_damaged_tile = "fail"
        with pytest.raises(TileReadError, match=rf"damaged\.tif: stored tile \({col}, {row}\) of level 0 is damaged"):
            s.read_region((0, 0), 0, s.dimensions)


def test_damaged_tiles_reach_the_summary_and_the_fail_setting_fails_the_run(tmp_path):
    path = tmp_path / "tissue.tiff"
    write_synthetic_slide(path, 1024, 1024, seed=3, kind="pathology")
    col, row = _damage_a_tile(path)
    with Pipeline.from_card(backend="ort", tissue="all") as p:
        summary = p.run(path).summary["damaged_tiles"]
    assert summary["count"] == 1 and summary["policy"] == "warn"
    assert (summary["tiles"][0]["col"], summary["tiles"][0]["row"]) == (col, row)
    with (
        Pipeline.from_card(backend="ort", tissue="all", on_damaged_tile="fail") as p,
        pytest.raises(TileReadError, match="is damaged"),
    ):
        p.run(path)


# -- a batch ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_batch_goes_past_hostile_slides(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for name in ("a_good.tiff", "c_good.tiff"):
        write_synthetic_slide(src / name, 768, 768, seed=5, kind="pathology")
    loop = _tiff(src, "b_loop.tiff")
    buf = bytearray(loop.read_bytes())
    _, ifds = _parse_tiff(bytes(buf))
    _put_uint(buf, ifds[1].next_pos, 4, ifds[0].offset)
    loop.write_bytes(bytes(buf))
    png_bomb(src / "d_bomb.png", 30000, 30000, 1, 0)
    out = tmp_path / "out"
    r = _cli("run", str(src), "--out", str(out), "--backend", "ort", "--no-progress")
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr
    slides = json.loads((out / "manifest.json").read_text())["slides"]
    status = {name: entry["status"] for name, entry in slides.items()}
    assert status == {"a_good": "done", "b_loop": "failed", "c_good": "done", "d_bomb": "failed"}, status
    assert "b_loop.tiff: TIFF page chain loops" in slides["b_loop"]["error"]
    assert "over the 2 GiB limit" in slides["d_bomb"]["error"]


@pytest.mark.parametrize("outcolorspace", ["YCCK", "CMYK"])
def test_four_component_jpeg_tiles_in_a_ycbcr_page_are_refused_not_shown_as_colours(tmp_path, outcolorspace):
    """A page of 3 samples (YCbCr) whose tiles are YCCK or CMYK JPEG streams: every pixel decoded
    from them would be wrong, so reading one is a TileReadError naming the tile (as OpenSlide's
    "Bogus JPEG colorspace"), never a "done" slide."""
    imagecodecs = pytest.importorskip("imagecodecs")
    ink = np.full((256, 256, 4), 60, np.uint8)
    stream = imagecodecs.jpeg8_encode(ink, level=90, colorspace="CMYK", outcolorspace=outcolorspace)
    path = tmp_path / "inks.tiff"
    with tifffile.TiffWriter(path) as tw:
        # Streams encoded here; these arguments only make tifffile write a YCbCr page's tags.
        tw.write(
            (stream for _ in range(4)),
            shape=(512, 512, 3),
            dtype=np.uint8,
            tile=(256, 256),
            photometric="rgb",
            compression="jpeg",
            subsampling=(2, 2),
            metadata=None,
        )
    with open_slide(path) as slide:
        assert slide.stored_tile_format(0)["photometric"] == "YCBCR"
        with pytest.raises(TileReadError, match=r"stored tile \(0, 0\) of level 0: Bogus JPEG colorspace"):
            slide.read_region((0, 0), 0, (64, 64))
        with pytest.raises(TileReadError, match="Bogus JPEG colorspace"):
            slide.read_region((256, 256), 0, (256, 256))
