import json
import threading
import time

import cv2
import numpy as np
import pytest
from helpers import smooth_rgb, write_pyramid_tiff

from wsi_pipeline import open_slide
from wsi_pipeline.errors import ConfigError, TileReadError
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.tiling import TileGrid, TileLoader, mask_from_file, tissue_mask


def _blank(h, w):
    return ImageSlide.from_array(np.full((h, w, 3), 255, np.uint8))


@pytest.mark.parametrize("w,h", [(512, 512), (513, 1000), (4100, 3000), (100, 50)])
def test_grid_covers_slide_last_tile_ends_at_the_border(w, h):
    grid = TileGrid(_blank(h, w), tile_size=512, overlap=64)
    tiles = list(grid)
    assert len(tiles) == grid.n_rows * grid.n_cols
    xs = sorted({t.x0_level0 for t in tiles})
    ys = sorted({t.y0_level0 for t in tiles})
    # On the lattice but the last, which ends at the border (or starts at 0 when the slide is smaller).
    assert xs[:-1] == [448 * i for i in range(grid.n_cols - 1)]
    assert ys[:-1] == [448 * i for i in range(grid.n_rows - 1)]
    assert xs[-1] == max(0, w - 512) and ys[-1] == max(0, h - 512)
    assert len(xs) == 1 or xs[-2] + 512 < w
    assert [t.index for t in tiles] == list(range(len(tiles)))


def test_grid_edge_tile_holds_image_pixels_only():
    img = smooth_rgb(700, 900)
    grid = TileGrid(ImageSlide.from_array(img), 512, 64)
    last = grid[len(grid) - 1]
    np.testing.assert_array_equal(grid.read(last), img[700 - 512 :, 900 - 512 :])


def test_slide_smaller_than_a_tile_is_one_tile_filled_by_reflection():
    img = smooth_rgb(100, 60)
    grid = TileGrid(ImageSlide.from_array(img), 512, 64)
    assert len(grid) == 1
    patch = grid.read(grid[0])
    np.testing.assert_array_equal(patch, cv2.copyMakeBorder(img, 0, 412, 0, 452, cv2.BORDER_REFLECT_101))


def test_grid_at_level_and_target_mpp(pyramid_tiff):
    with open_slide(pyramid_tiff) as s:
        g1 = TileGrid(s, level=1)
        assert g1.downsample == 2.0 and g1.read_size == 512
        t = g1.tile(1, 2)
        assert (t.x0_level0, t.y0_level0) == (2 * 448 * 2, 448 * 2) and t.extent_level0 == 1024
        np.testing.assert_array_equal(g1.read(t), s.read_region((t.x0_level0, t.y0_level0), 1, (512, 512)))
        # 0.75 um/px: no level has it; level 1 (0.5 um/px) is read and resized.
        g = TileGrid(s, mpp=0.75)
        assert g.level == 1 and g.downsample == pytest.approx(3.0) and g.read_size == 768
        assert g.read(g[0]).shape == (512, 512, 3)
        assert g.n_cols == int(np.ceil((np.ceil(4100 / 3) - 64) / 448))
        with pytest.raises(ConfigError, match="finer than the slide"):
            TileGrid(s, mpp=0.1)


def test_grid_rejects_bad_geometry():
    s = _blank(100, 100)
    with pytest.raises(ConfigError, match="overlap"):
        TileGrid(s, tile_size=512, overlap=512)
    with pytest.raises(ConfigError, match="overlap"):
        TileGrid(s, tile_size=512, overlap=-1)
    with pytest.raises(ConfigError, match="resolution is unknown"):
        TileGrid(s, mpp=0.5)


def _slide_with_tissue(h=2000, w=3000):
    img = np.full((h, w, 3), 242, np.uint8)
    img[500:1500, 1000:2600] = (200, 110, 170)  # stained tissue: 1000 x 1600 px
    return ImageSlide.from_array(img)


def test_tissue_mask_on_known_tissue():
    s = _slide_with_tissue()
    tm = tissue_mask(s, thumbnail_size=600)
    assert tm.fraction == pytest.approx(1000 * 1600 / (2000 * 3000), abs=0.01)
    grid = TileGrid(s, 512, 64)
    frac = tm.tile_fractions(grid)
    assert frac.shape == (grid.n_rows, grid.n_cols)
    # Exact fraction of each tile inside the tissue rectangle (outside the slide counts empty).
    for t in grid:
        x0, y0, x1, y1 = t.bounds_level0
        ix = max(0, min(x1, 2600) - max(x0, 1000))
        iy = max(0, min(y1, 1500) - max(y0, 500))
        assert frac[t.row, t.col] == pytest.approx(ix * iy / 512**2, abs=0.03), (t.row, t.col)
    kept = grid.select(frac, 0.5)
    assert kept and all(frac[t.row, t.col] >= 0.5 for t in kept)


def test_tissue_mask_all_and_blank():
    s = _blank(1000, 1000)
    assert tissue_mask(s, thumbnail_size=256).fraction < 0.01
    all_mask = tissue_mask(s, method="all")
    frac = all_mask.tile_fractions(TileGrid(s))
    # Every tile counts, the edge tiles too: they end at the slide's border.
    np.testing.assert_allclose(frac, np.ones((3, 3)), atol=0.01)


def test_user_masks_image_and_geojson(tmp_path):
    s = _blank(2000, 3000)
    poly = [[1000, 500], [2600, 500], [2600, 1500], [1000, 1500], [1000, 500]]
    gj = tmp_path / "roi.geojson"
    gj.write_text(
        json.dumps(
            {
                "type": "FeatureCollection",
                "features": [
                    {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [poly]}, "properties": {}}
                ],
            }
        )
    )
    m1 = mask_from_file(s, gj, size=600)
    assert m1.fraction == pytest.approx(1600 * 1000 / 6e6, abs=0.01)
    png = tmp_path / "mask.png"
    m = np.zeros((200, 300), np.uint8)
    m[50:150, 100:260] = 255
    cv2.imwrite(str(png), m)
    m2 = tissue_mask(s, method="file", mask_path=png)
    assert m2.fraction == pytest.approx(m1.fraction, abs=0.01)
    with pytest.raises(ConfigError, match="not found"):
        mask_from_file(s, tmp_path / "nope.png")


# -- loader -------------------------------------------------------------------


def _tagged_slide(h=2200, w=2700):
    """Each pixel's value encodes nothing; tiles are checked against direct reads."""
    return ImageSlide.from_array(smooth_rgb(h, w, seed=7))


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tile-reader")]


def test_loader_yields_all_tiles_in_grid_order():
    s = _tagged_slide()
    grid = TileGrid(s)
    seen = []
    with TileLoader(s, grid, batch_size=4, workers=2) as loader:
        for batch in loader:
            assert batch.images.dtype == np.uint8 and batch.images.shape[1:] == (512, 512, 3)
            for img, t in zip(batch.images, batch.tiles, strict=True):
                np.testing.assert_array_equal(img, grid.read(t))
                seen.append(t.index)
    assert seen == list(range(len(grid)))
    assert not _reader_threads()


def test_loader_memory_is_bounded_and_applies_back_pressure():
    s = _tagged_slide()
    grid = list(TileGrid(s)) * 10  # many tiles: memory must not follow
    started = []
    lock = threading.Lock()

    def read(slide, tile, out):
        with lock:
            started.append(tile.index)
        out[...] = 0

    small = TileLoader(s, grid[:8], batch_size=4, workers=2, prefetch=2, read=read)
    big = TileLoader(s, grid, batch_size=4, workers=2, prefetch=2, read=read)
    assert small.buffer_bytes == big.buffer_bytes == 3 * 4 * 512 * 512 * 3
    it = iter(big)
    next(it)
    time.sleep(0.3)  # a slow consumer: readers must stop after the prefetch window
    with lock:
        ahead = len(started)
    assert ahead <= (2 + 1) * 4
    big.close()


def test_loader_error_names_the_tile_and_stops_workers():
    s = _tagged_slide()
    grid = TileGrid(s)

    def read(slide, tile, out):
        if tile.index == 9:
            raise ValueError("bad JPEG data")
        out[...] = 1

    loader = TileLoader(s, grid, batch_size=2, workers=2, read=read)
    got = []
    with pytest.raises(TileReadError, match=r"tile 9 \(row 1, col 3\): bad JPEG data") as ei:
        for b in loader:
            got.extend(t.index for t in b.tiles)
    assert ei.value.tile.index == 9 and ei.value.location == (1344, 448)
    assert got == list(range(8))
    assert not _reader_threads()


def test_loader_stops_cleanly_on_interrupt_and_break():
    s = _tagged_slide()
    grid = TileGrid(s)
    loader = TileLoader(s, grid, batch_size=2, workers=2)
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            raise KeyboardInterrupt
    assert not _reader_threads()
    loader2 = TileLoader(s, grid, batch_size=2, workers=2)
    for _ in loader2:
        break
    loader2.close()
    assert not _reader_threads()


def test_loader_held_batches_are_not_overwritten():
    s = _tagged_slide()
    grid = TileGrid(s)
    loader = TileLoader(s, grid, batch_size=2, workers=2, prefetch=1, auto_release=False, max_held=2)
    held = []
    for batch in loader:
        held.append((batch, batch.images.copy()))
        if len(held) == 2:
            first, snapshot = held.pop(0)
            np.testing.assert_array_equal(first.images, snapshot)
            first.release()
    for b, _ in held:
        b.release()


@pytest.mark.parametrize("mpp", [None, 0.37])  # 0.37: a downsample that is not a whole number
def test_whole_grid_tiles_equal_the_tiles_made_one_by_one(mpp):
    slide = ImageSlide.from_array(np.zeros((1300, 2100, 3), np.uint8), mpp=(0.25, 0.25))
    grid = TileGrid(slide, 256, 32, mpp=mpp)
    one_by_one = [grid.tile(r, c) for r in range(grid.n_rows) for c in range(grid.n_cols)]
    assert list(grid) == one_by_one
    rng = np.random.default_rng(0)
    frac = rng.choice([0.0, 0.01, 0.2, 1.0, np.nan], (grid.n_rows, grid.n_cols))
    want = [t for t in one_by_one if frac[t.row, t.col] >= 0.05]
    assert grid.select(frac, 0.05) == want
    assert grid.select(frac, 0.0) == [t for t in one_by_one if frac[t.row, t.col] > 0]
    with pytest.raises(IndexError):
        grid.tiles_at(np.array([0]), np.array([grid.n_cols]))


@pytest.mark.parametrize(
    ("levels_4x", "largest", "side"),
    [
        (True, 600, 512),
        (False, 600, 512),
        (False, 1024, 1024),
        (False, 2048, 2048),
        (True, 400, 400),
        (False, 400, 256),
    ],
)
def test_the_mask_thumbnail_is_a_stored_level_within_half_its_largest_size(
    tmp_path, levels_4x, largest, side, monkeypatch
):
    from helpers.slide_corpus import aperio_layouts, write_layout

    from wsi_pipeline.tiling.tissue import thumbnail_side

    image = np.full((2048, 2048, 3), 242, np.uint8)
    image[500:1500, 300:1200] = (200, 110, 170)
    path = tmp_path / ("s.svs" if levels_4x else "s.tif")
    if levels_4x:  # levels 2048, 512, 128
        write_layout(
            path, next(lay for lay in aperio_layouts(width=2048, height=2048) if lay.name == "aperio-classic"), image
        )
    else:  # levels 2048, 1024, 512, 256
        write_pyramid_tiff(path, image, levels=4)
    with open_slide(path, "tifffile") as s:
        assert thumbnail_side(s, largest) == side
        levels_read = []
        read_region = s.read_region
        monkeypatch.setattr(
            s, "read_region", lambda loc, level, size: levels_read.append(level) or read_region(loc, level, size)
        )
        tm = tissue_mask(s, thumbnail_size=largest)
        assert max(tm.mask.shape) == side
        stored = [max(d) for d in s.level_dimensions]
        assert (
            stored[levels_read[0]] == side or side not in stored
        )  # the stored level read as it is, where there is one
    assert tm.fraction == pytest.approx(1000 * 900 / 2048**2, abs=0.01)
