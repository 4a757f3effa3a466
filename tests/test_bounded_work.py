"""Memory and work that follow what a slide stores and what a run asks for, not what a file claims.

A grid far coarser than the level it reads, a pyramid page of the wrong shape, a sparse DICOM level
claiming a huge matrix, a level of one-pixel tiles: each is read within bounds or refused, and the
bounds are checked with counters and traced allocations, never with a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import cv2
import numpy as np
import pytest
import tifffile
from fuzz_slides import sparse_tiff, tiny_tile_tiff
from helpers import smooth_rgb, write_sparse_dicom_level

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ConfigError, SlideError, SlideOpenError
from wsi_pipeline.geometry import MAX_SHRINK
from wsi_pipeline.slide import open_slide
from wsi_pipeline.slide.area import BAND_BYTES, shrink_banded, shrink_sparse
from wsi_pipeline.slide.base import Slide, level_shape_agrees
from wsi_pipeline.slide.dicom_backend import DicomSlide
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.slide.stored_tiles import TileCache
from wsi_pipeline.slide.tiff_backend import TiffSlide
from wsi_pipeline.stitch import blend
from wsi_pipeline.tiling.grid import (
    TileGrid,
    fill_past_edge,
    read_tile,
    read_tile_banded,
    reads_whole,
    tile_origin_at_level,
)
from wsi_pipeline.tiling.tissue import tissue_mask


def _whole_read(slide: Slide, tile) -> np.ndarray:
    """A tile as read before bands: its whole region, the edge reflected, then ``cv2.INTER_AREA``."""
    lw, lh = slide.level_dimensions[tile.level]
    x0, y0 = tile_origin_at_level(slide, tile)
    region = slide.read_region((tile.x0_level0, tile.y0_level0), tile.level, (tile.read_size, tile.read_size))
    region = fill_past_edge(region, x0, y0, lw, lh)
    return cv2.resize(region, (tile.size, tile.size), interpolation=cv2.INTER_AREA)


def _single_level_tiff(path, side: int = 1024, seed: int = 5):
    image = smooth_rgb(side, side, seed=seed)
    tifffile.imwrite(
        path,
        image,
        tile=(256, 256),
        photometric="rgb",
        compression="jpeg",
        resolution=(4e4, 4e4),
        resolutionunit="CENTIMETER",
    )
    return path


# -- a grid far coarser than its level ------------------------------------------------


@pytest.mark.parametrize("band_bytes", [1 << 14, 1 << 20, BAND_BYTES])
@pytest.mark.parametrize(("src", "dst"), [((640, 480), (40, 30)), ((700, 500), (90, 70)), ((333, 90), (50, 20))])
def test_a_banded_shrink_is_opencvs_of_the_region_it_maps(band_bytes, src, dst):
    """Maps with background (-1) and reflections, bands of every size: integer factors are
    OpenCV's pixels exactly; other factors within one grey level in a few pixels."""
    rng = np.random.default_rng(sum(src) + band_bytes)
    source = rng.integers(0, 256, (200, 150, 3), dtype=np.uint8)
    xmap = np.r_[np.full(7, -1), np.arange(150), np.arange(148, -1, -1), np.arange(1, 150)][: src[0]]
    xmap = np.r_[xmap, np.full(src[0] - len(xmap), -1)]
    ymap = np.r_[np.arange(40, 200), np.arange(198, -1, -1), np.arange(1, 200), np.arange(198, 0, -1)][: src[1]]
    region = np.where((xmap[None, :, None] < 0) | (ymap[:, None, None] < 0), (10, 200, 30), source[ymap][:, xmap])
    want = cv2.resize(region.astype(np.uint8), dst, interpolation=cv2.INTER_AREA)
    reads = []

    def read_rows(y0, y1, x0, x1):
        reads.append((y1 - y0) * (x1 - x0) * 3)
        return source[y0:y1, x0:x1]

    got = shrink_banded(read_rows, xmap, ymap, *dst, (10, 200, 30), band_bytes)
    diff = np.abs(got.astype(int) - want)
    exact = src[0] % dst[0] == 0 and src[1] % dst[1] == 0
    assert diff.max() <= (0 if exact else 1) and (diff > 0).mean() < 1e-3
    assert max(reads) <= max(band_bytes, 150 * 3)  # a band, or one row of the source at least


def test_a_narrow_source_is_read_in_bands_of_columns():
    """A source 3 px wide reflected over a region 600 px wide: its lines are columns, each read once."""
    source = np.random.default_rng(5).integers(0, 256, (4000, 3, 3), dtype=np.uint8)
    xmap = np.r_[0, 1, 2, 1][np.arange(600) % 4]
    ymap = np.arange(1000, 3400)
    want = cv2.resize(source[ymap][:, xmap], (60, 240), interpolation=cv2.INTER_AREA)
    reads = []

    def read_rows(y0, y1, x0, x1):
        reads.append((y1 - y0, x1 - x0))
        return source[y0:y1, x0:x1]

    np.testing.assert_array_equal(shrink_banded(read_rows, xmap, ymap, 60, 240, (0, 0, 0)), want)
    assert sum(w for _, w in reads) == 3 and all(h == 2400 for h, _ in reads)


def test_a_tile_64_times_coarser_than_a_one_level_slide_is_read_in_bands(tmp_path):
    """A 512 px tile of a 1,024 px slide at 16 um/px covers 32,768 px of its 0.25 um/px level: 3.2 GB
    read whole. Read in bands: a few MB traced, and the pixels OpenCV gives the whole region."""
    with open_slide(_single_level_tiff(tmp_path / "one_level.tiff")) as slide:
        (tile,) = TileGrid(slide, 512, 64, mpp=16.0)
        assert tile.read_size == 32768 and not reads_whole(tile)
        slide.clear_cache()
        tracemalloc.start()
        try:
            got = read_tile(slide, tile)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2 * BAND_BYTES + 64 * 2**20  # bands and the level's decoded tiles, not 3.2 GB
        # The same pixels as the region read whole, on a tile small enough to read so.
        (small,) = TileGrid(slide, 128, 16, mpp=0.25 * 40)
        assert not reads_whole(small)
        np.testing.assert_array_equal(read_tile(slide, small), _whole_read(slide, small))
    assert got.shape == (512, 512, 3)


@pytest.mark.parametrize("mpp", [2.5, 2.6, 8.0])
def test_banded_tiles_equal_whole_reads_inside_a_slide_and_across_its_edges(mpp):
    image = smooth_rgb(2300, 3100, seed=2)
    slide = ImageSlide.from_array(image)
    slide._mpp = (0.25, 0.25)
    grid = TileGrid(slide, 128, 16, mpp=mpp)
    for tile in grid:
        diff = np.abs(read_tile_banded(slide, tile).astype(int) - _whole_read(slide, tile))
        assert diff.max() <= (0 if (mpp / 0.25).is_integer() else 1), (mpp, tile)


def test_a_grid_shrinking_its_level_more_than_the_limit_is_refused_naming_the_resolutions(tmp_path):
    path = _single_level_tiff(tmp_path / "one_level.tiff", side=512)
    with open_slide(path) as slide:
        TileGrid(slide, 512, 64, mpp=0.25 * MAX_SHRINK)  # the limit itself is read
        with pytest.raises(ConfigError) as err:
            TileGrid(slide, 512, 64, mpp=20.0)
    message = str(err.value)
    assert str(path) in message and "20 um/px" in message and "0.25 um/px" in message and "80 times" in message


def test_the_gpu_loader_leaves_grids_it_would_gather_whole_to_the_cpu_reader(tmp_path):
    pytest.importorskip("torchvision")
    from wsi_pipeline.tiling.gpu_decode import gpu_decode_plan

    with open_slide(_single_level_tiff(tmp_path / "one_level.tiff")) as slide:
        decoder, why = gpu_decode_plan(slide, list(TileGrid(slide, 512, 64, mpp=16.0)))
        assert decoder is None and "a band at a time" in why
        decoder, _ = gpu_decode_plan(slide, list(TileGrid(slide, 512, 64, mpp=1.0)))
        assert decoder is not None  # 4 x: gathered whole on the device, as the CPU reads it whole


# -- pyramid pages of another shape ----------------------------------------------------


def _pyramid(w0: int, h0: int, sizes: list[tuple[int, int]]) -> ImageSlide:
    """An image of 0.25 um/px with made-up pyramid levels of ``sizes`` (their downsamples as the
    stored-tile readers make them: the mean of the two axes' ratios); for choosing levels only."""
    slide = ImageSlide.from_array(np.zeros((h0, w0, 3), np.uint8))
    slide._level_dimensions = [(w0, h0), *sizes]
    slide._level_downsamples = [1.0, *((w0 / w + h0 / h) / 2 for w, h in sizes)]
    slide._mpp = (0.25, 0.25)
    return slide


def test_a_level_of_another_shape_than_level_0_is_never_picked_for_a_resolution():
    slide = _pyramid(1024, 1024, [(512, 128), (64, 64)])
    assert slide.level_downsamples == (1.0, 5.0, 16.0)
    assert slide.best_level_for_downsample(8.0) == 0  # not the 512 x 128 page (downsample 5)
    assert slide.best_level_for_downsample(16.0) == 2
    assert TileGrid(slide, 128, 16, mpp=2.0).level == 0
    rounded = _pyramid(1001, 999, [(501, 499), (251, 250)])
    assert rounded.best_level_for_downsample(2.01) == 1 and rounded.best_level_for_downsample(4.01) == 2


@pytest.mark.parametrize(
    ("level0", "level", "agrees"),
    [
        ((1024, 1024), (512, 512), True),
        ((1001, 999), (500, 500), True),
        ((1000, 10), (1, 1), True),
        ((1024, 1024), (512, 128), False),
        ((1000, 1000), (500, 498), False),
        ((3, 1000), (3, 10), False),
    ],
)
def test_level_shapes_agree_up_to_the_rounding_of_their_sides(level0, level, agrees):
    assert level_shape_agrees(*level0, *level) is agrees


def test_a_tiff_page_of_another_shape_is_not_read_at_a_resolution(tmp_path):
    image = smooth_rgb(1024, 1024, seed=6)
    path = tmp_path / "skewed.tiff"
    with tifffile.TiffWriter(path) as tw:
        kw = dict(tile=(64, 64), photometric="rgb", metadata=None)
        tw.write(image, resolution=(4e4, 4e4), resolutionunit="CENTIMETER", **kw)
        for w, h in ((512, 128), (64, 64)):
            tw.write(cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA), subfiletype=1, **kw)
    want = cv2.resize(image, (200, 200), interpolation=cv2.INTER_AREA)
    with open_slide(path, "openslide") as slide:
        assert (512, 128) in slide.level_dimensions  # OpenSlide lists the page as a level
        grid = TileGrid(slide, 128, 16, mpp=2.0)  # downsample 8: the page's is 5, the next level's 16
        assert grid.level == 0
        assert np.abs(slide.get_thumbnail(200).astype(int) - want).mean() < 2


# -- a sparse DICOM level claiming a huge matrix ----------------------------------------


def _sparse_tiles(n: int, at: tuple[int, int], seed: int = 7) -> dict:
    image = smooth_rgb(256 * n, 256 * n, seed=seed)
    return {
        (at[0] + i, at[1] + j): image[j * 256 : (j + 1) * 256, i * 256 : (i + 1) * 256]
        for i in range(n)
        for j in range(n)
    }


def test_a_sparse_dicom_claiming_400000_px_costs_its_frames_not_its_matrix(tmp_path, monkeypatch):
    path = tmp_path / "giant.dcm"
    write_sparse_dicom_level(path, 400_000, 400_000, _sparse_tiles(8, (1000, 700)))
    assert path.stat().st_size < 2 * 2**20
    decoded, regions = [], []
    decode, read_level = DicomSlide._decode_tile, DicomSlide._read_level
    monkeypatch.setattr(DicomSlide, "_decode_tile", lambda s, *a, **k: decoded.append(a[:3]) or decode(s, *a, **k))
    monkeypatch.setattr(DicomSlide, "_read_level", lambda s, *a: regions.append(a) or read_level(s, *a))
    with open_slide(path) as slide:
        assert slide.backend == "dicom" and slide.dimensions == (400_000, 400_000)
        mask = tissue_mask(slide, "otsu")
        assert len(decoded) == 64 and regions == []  # each stored frame once, no band of the matrix
        assert 0 < mask.mask.sum() < 400
        grid = TileGrid(slide, 512, 64)
        tiles = grid.select(mask.tile_fractions(grid), 0.5)
        assert 0 < len(tiles) < 100  # the tiles over the stored frames alone
        decoded.clear()
        coarse = TileGrid(slide, 512, 64, mpp=16.0)  # each tile covers 32,768 px of the level
        tiles = coarse.select(mask.tile_fractions(coarse), 0.0)
        for tile in tiles:
            read_tile(slide, tile)
        assert 0 < len(decoded) <= 64 * len(tiles) and regions == []  # stored frames, no band


def test_a_tiff_of_empty_tiles_claiming_400000_px_costs_its_stored_tiles(tmp_path, monkeypatch):
    """TileByteCounts 0 (tiles OpenSlide reads as background): the tifffile reader's level answers
    which tiles it stores, and the thumbnail, tissue mask and coarse reads decode those alone."""
    path = tmp_path / "giant.tiff"
    stored = {(300 + i, 400 + j): smooth_rgb(512, 512, seed=3 * i + j) for i in range(3) for j in range(3)}
    sparse_tiff(path, 400_000, 400_000, stored)
    decoded, regions = [], []
    decode, read_level = TiffSlide._decode_tile, TiffSlide._read_level
    monkeypatch.setattr(TiffSlide, "_decode_tile", lambda s, *a, **k: decoded.append(a[:3]) or decode(s, *a, **k))
    monkeypatch.setattr(TiffSlide, "_read_level", lambda s, *a: regions.append(a) or read_level(s, *a))
    with open_slide(path) as slide:
        assert slide.backend == "tifffile" and slide.dimensions == (400_000, 400_000)
        assert slide.stored_tiles_present(0).sum() == 9
        mask = tissue_mask(slide, "otsu")
        assert len(decoded) == 9 and regions == []  # each stored tile once, no band of the level
        assert 0 < mask.mask.sum() < 400
        decoded.clear()
        coarse = TileGrid(slide, 512, 64, mpp=16.0)  # each tile covers 32,768 px of the level
        tiles = coarse.select(mask.tile_fractions(coarse), 0.0)
        for tile in tiles:
            read_tile(slide, tile)
        assert 0 < len(decoded) <= 9 * len(tiles) and regions == []  # stored tiles, no band
    with open_slide(path) as slide:  # the stored tiles where they lie, background elsewhere
        thumb = slide.get_thumbnail(400_000 // 512)  # about 1 px per stored tile
        tissue_rows, tissue_cols = np.nonzero((thumb != slide.background_rgb).any(axis=2))
        assert set(range(400, 403)) <= set(tissue_rows) <= set(range(399, 405))
        assert set(range(300, 303)) <= set(tissue_cols) <= set(range(299, 305))


@pytest.mark.filterwarnings("ignore:.*resolution unknown")
def test_a_heatmap_over_its_pixel_limit_is_refused_when_the_slide_is_planned(monkeypatch):
    image = np.full((768, 1024, 3), 230, np.uint8)  # read at level 0: a 128 x 96 px heatmap at stride 8
    with Pipeline(backend="ort", tissue="all") as pipeline:
        monkeypatch.setattr(blend, "MAX_HEATMAP_PIXELS", 128 * 96)
        plan = pipeline.plan(image)
        assert (plan.geometry.heatmap_width, plan.geometry.heatmap_height) == (128, 96)
        plan.close()
        monkeypatch.setattr(blend, "MAX_HEATMAP_PIXELS", 128 * 96 - 1)
        with pytest.raises(SlideError, match=r"1024 x 768 px: its heatmap at stride 8 would be 128 x 96 px"):
            pipeline.plan(image)


def test_a_run_over_a_sparse_400000_px_slide_is_refused_before_its_tiles_run(tmp_path):
    """Its heatmap would be 50,000 px square: the run refuses each such slide, naming it, and ends."""
    slides = tmp_path / "in"
    slides.mkdir()
    write_sparse_dicom_level(slides / "giant.dcm", 400_000, 400_000, _sparse_tiles(2, (700, 900)))
    sparse_tiff(slides / "giant.tiff", 400_000, 400_000, {(300, 400): smooth_rgb(512, 512, seed=2)})
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--backend", "ort"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())["slides"]
    assert {rec["status"] for rec in manifest.values()} == {"failed"} and len(manifest) == 2, manifest
    errors = sorted(rec["error"] for rec in manifest.values())
    for error, name in zip(errors, ("giant.dcm", "giant.tiff"), strict=True):
        assert error.startswith(str(slides / name)), errors
        assert "level 0 claims 400000 x 400000 px: its heatmap at stride 8 would be 50000 x 50000 px" in error
    assert not any((out / "slides").iterdir())  # nothing written for either


def test_a_sparse_levels_thumbnail_is_opencvs_shrink_of_the_level(tmp_path):
    path = tmp_path / "sparse.dcm"
    tiles = _sparse_tiles(3, (1, 2))
    write_sparse_dicom_level(path, 1900, 1500, tiles)
    with open_slide(path) as slide:
        assert slide.stored_tiles_present(0).sum() == 9
        level = slide.read_region((0, 0), 0, (1900, 1500))
        for size in (300, 950, 1900):
            thumb = slide.get_thumbnail(size)
            want = cv2.resize(level, thumb.shape[1::-1], interpolation=cv2.INTER_AREA)
            assert np.abs(thumb.astype(int) - want).max() <= 1, size
        # Coarse tiles from the stored frames alone, the edges reflected, as a whole read gives them.
        for mpp in (2.5, 4.0):
            for tile in TileGrid(slide, 128, 16, mpp=mpp):
                diff = np.abs(read_tile_banded(slide, tile).astype(int) - _whole_read(slide, tile))
                assert diff.max() <= (0 if mpp == 4.0 else 1), (mpp, tile)


def test_a_sparse_shrink_adds_its_parts_to_the_background():
    rng = np.random.default_rng(3)
    canvas = np.full((700, 900, 3), (250, 240, 230), np.uint8)
    parts = []
    for x, y in ((0, 0), (100, 300), (800, 650), (450, 200)):
        part = rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)
        canvas[y : y + 100, x : x + 100] = part[: 700 - y, : 900 - x]
        parts.append((x, y, part))
    for dst in ((90, 70), (300, 233), (450, 350)):
        got = shrink_sparse(np.arange(900), np.arange(700), *dst, parts, (250, 240, 230))
        want = cv2.resize(canvas, dst, interpolation=cv2.INTER_AREA)
        assert np.abs(got.astype(int) - want).max() <= (0 if 900 % dst[0] == 0 and 700 % dst[1] == 0 else 1)


# -- tiles of a few pixels ------------------------------------------------------------


def test_a_tiff_of_one_pixel_tiles_is_refused_at_open_naming_the_tile_size(tmp_path):
    path = tmp_path / "tiles_1px.tiff"
    tiny_tile_tiff(path, 1024, 1024)
    for backend in ("auto", "tifffile", "openslide", "image"):
        with pytest.raises(SlideOpenError, match=r"tiles_1px\.tiff.*1x1 px tiles, 1048576 of them"):
            open_slide(path, backend)
    small = tmp_path / "small_1px.tiff"
    tiny_tile_tiff(small, 60, 60)  # 3,600 tiles: a small image in small tiles is read
    with open_slide(small) as slide:
        assert (slide.read_region((0, 0), 0, (60, 60)) == (200, 100, 50)).all()


def test_a_dicom_level_of_tiny_frames_is_refused_at_open(tmp_path):
    path = tmp_path / "frames_8px.dcm"
    write_sparse_dicom_level(path, 1024, 1024, {(0, 0): smooth_rgb(8, 8)}, tile=8)
    with pytest.raises(SlideOpenError, match=r"frames_8px\.dcm.*8x8 px tiles, 16384 of them"):
        DicomSlide(path)


def test_the_tile_cache_bounds_its_slots_as_well_as_its_bytes():
    cache = TileCache(1 << 30, max_tiles=64)
    for key in range(5000):
        slot = cache.slot((1, 1))
        with cache.lock:
            cache.put((0, key), slot)
        cache.unpin((0, key))
    info = cache.info()
    assert info.tiles <= 64 and cache.slots <= 64 and info.allocated_bytes <= 64 * 3
