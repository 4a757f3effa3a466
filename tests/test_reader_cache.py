"""The tifffile backend's decoded-tile cache, direct JPEG decoding and region assembly."""

import threading

import numpy as np
import pytest
import tifffile
from helpers import smooth_rgb, write_pyramid_tiff

from wsi_pipeline import open_slide
from wsi_pipeline.slide.stored_tiles import TileCache
from wsi_pipeline.slide.tiff_backend import TiffSlide
from wsi_pipeline.tiling import TileGrid, read_tile

TILE_BYTES = 256 * 256 * 3


def _level_pixels(path, level):
    with tifffile.TiffFile(path) as tif:
        return tif.series[0].levels[level].asarray()


@pytest.mark.parametrize("photometric", ["ycbcr", "rgb"])
def test_direct_jpeg_decode_matches_tifffile(tmp_path, monkeypatch, photometric):
    import simplejpeg

    path = str(tmp_path / "t.tif")
    write_pyramid_tiff(path, smooth_rgb(700, 900, seed=2), levels=2, photometric=photometric)
    decode_jpeg, direct = simplejpeg.decode_jpeg, []

    def counting(*args, **kwargs):
        direct.append(1)
        return decode_jpeg(*args, **kwargs)

    monkeypatch.setattr(simplejpeg, "decode_jpeg", counting)
    with TiffSlide(path) as s:
        direct.clear()  # opening tries a tile of each level
        for level in range(2):
            ref = _level_pixels(path, level)
            h, w = ref.shape[:2]
            np.testing.assert_array_equal(s.read_region((0, 0), level, (w, h)), ref)
        # every stored tile decoded straight by libjpeg-turbo (simplejpeg), none by the page's codec
        assert len(direct) == s.cache_info().misses == 4 * 3 + 2 * 2


def test_small_cache_evicts_reuses_slots_and_stays_exact(pyramid_tiff):
    ref = _level_pixels(pyramid_tiff, 0)
    limit = 5 * TILE_BYTES  # far fewer tiles than one grid row touches
    with TiffSlide(pyramid_tiff, cache_bytes=limit) as s:
        grid = TileGrid(s, 512, 64)
        for t in grid:
            got = read_tile(s, t)
            x, y = t.x0_level0, t.y0_level0
            want = np.full((512, 512, 3), 255, np.uint8)
            part = ref[y : y + 512, x : x + 512]
            want[: part.shape[0], : part.shape[1]] = part
            np.testing.assert_array_equal(got, want, err_msg=f"tile {t.index}")
        info = s.cache_info()
        assert info.allocated_bytes <= limit
        assert info.tiles <= 5
        assert info.misses > len(list(grid))  # tiles were evicted and decoded again


def test_threads_with_a_tiny_cache_read_exact_pixels(pyramid_tiff):
    """Pinned tiles are not overwritten while another thread copies from them."""
    ref = _level_pixels(pyramid_tiff, 0)
    rng = np.random.default_rng(3)
    spots = [(int(x), int(y)) for x, y in zip(rng.integers(0, 3600, 120), rng.integers(0, 2500, 120), strict=True)]
    errors = []
    with TiffSlide(pyramid_tiff, cache_bytes=4 * TILE_BYTES) as s:

        def work(part):
            for x, y in part:
                got = s.read_region((x, y), 0, (400, 400))
                if not np.array_equal(got, ref[y : y + 400, x : x + 400]):
                    errors.append((x, y))

        threads = [threading.Thread(target=work, args=(spots[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Over the bound by at most one slot per thread decoding at once.
        info = s.cache_info()
        assert info.allocated_bytes <= (4 + 4) * TILE_BYTES
        assert info.pinned == info.decoding == 0
    assert errors == []


def test_cache_never_hands_out_a_pinned_slot():
    cache = TileCache(2 * TILE_BYTES)
    a = cache.slot((256, 256))
    a[...] = 1
    with cache.lock:
        cache.put((0, 0), a)  # pinned by its decoder
    b = cache.slot((256, 256))
    with cache.lock:
        cache.put((0, 1), b)
    cache.unpin((0, 1))
    c = cache.slot((256, 256))  # the limit is reached: evicts (0, 1), not the pinned (0, 0)
    assert np.shares_memory(c, b) and not np.shares_memory(c, a)
    with cache.lock:
        assert cache.get((0, 0)) is a and cache.get((0, 1)) is None
    cache.unpin((0, 0))
    cache.unpin((0, 0))
    with cache.lock:
        cache.put((0, 2), c)
    cache.unpin((0, 2))
    d = cache.slot((256, 256))  # now (0, 0) is the oldest unpinned tile
    assert np.shares_memory(d, a)
    assert cache.allocated == 2 * TILE_BYTES


def test_read_region_into_fills_the_buffer(pyramid_tiff):
    with open_slide(pyramid_tiff, "tifffile") as s:
        out = np.zeros((16, 300, 200, 3), np.uint8)
        got = s.read_region_into((3950, 2900), 0, (200, 300), out[3])
        assert got is out[3] or np.shares_memory(got, out)
        np.testing.assert_array_equal(out[3], s.read_region((3950, 2900), 0, (200, 300)))
        assert (out[2] == 0).all() and (out[4] == 0).all()
        with pytest.raises(ValueError, match=r"pyramid\.tif.*expected \(300, 200, 3\) uint8"):
            s.read_region_into((0, 0), 0, (200, 300), np.zeros((200, 300, 3), np.uint8))


def test_coloured_background_fills_only_outside(pyramid_tiff):
    ref = _level_pixels(pyramid_tiff, 0)
    with open_slide(pyramid_tiff, "tifffile") as s:
        s.background_rgb = (10, 20, 30)
        got = s.read_region((-50, 2900), 0, (200, 150))
    np.testing.assert_array_equal(got[:100, 50:], ref[2900:3000, :150])
    assert (got[:, :50] == (10, 20, 30)).all() and (got[100:] == (10, 20, 30)).all()


def test_read_tile_into_buffer_matches_read_region(pyramid_tiff):
    with open_slide(pyramid_tiff, "tifffile") as s:
        grid = TileGrid(s, 512, 64)
        out = np.empty((512, 512, 3), np.uint8)
        for t in list(grid)[::7]:
            assert read_tile(s, t, out) is out
            np.testing.assert_array_equal(out, s.read_region((t.x0_level0, t.y0_level0), 0, (512, 512)))


def test_default_cache_is_a_band_of_rows_and_a_grid_decodes_each_tile_once(pyramid_tiff):
    with TiffSlide(pyramid_tiff) as s:
        across = s.tile_grid_shape(0)[2]  # 17 tiles of 256 px across 4100 px
        assert s.cache_info().limit_bytes == (1536 // 256 + 1) * across * TILE_BYTES
        for t in TileGrid(s, 512, 64):
            read_tile(s, t)
        info = s.cache_info()
        # The grid touches every stored tile: as many decodes as stored tiles is each once.
        assert info.misses == 17 * 12 and info.hits > 0
        assert info.allocated_bytes <= info.limit_bytes
    with TiffSlide(pyramid_tiff, cache_bytes=10 * TILE_BYTES) as s:
        assert s.cache_info().limit_bytes == 10 * TILE_BYTES


def test_loader_with_many_batches_in_flight_still_decodes_each_tile_once(pyramid_tiff):
    from wsi_pipeline.tiling import TileLoader

    with TiffSlide(pyramid_tiff) as s:
        default_limit = s.cache_info().limit_bytes
        grid = TileGrid(s, 512, 64)
        with TileLoader(s, list(grid), batch_size=8, workers=4, prefetch=4) as loader:
            assert s.cache_info().limit_bytes > default_limit  # the loader asked for the rows it keeps in flight
            n = sum(len(b) for b in loader)
        assert n == len(grid)
        assert s.cache_info().misses == 17 * 12  # every stored tile (the grid touches all), once


@pytest.mark.parametrize("cache_tiles", [4, 10_000])
def test_large_regions_decoded_by_several_threads_equal_one_thread(pyramid_tiff, monkeypatch, cache_tiles):
    """A region of many stored tiles (a thumbnail's level) is decoded by the region threads: the
    same pixels as tile by tile in the calling thread, with a cache smaller than the region too."""
    import wsi_pipeline.slide.stored_tiles as stored_tiles

    ref = _level_pixels(pyramid_tiff, 0)
    h, w = ref.shape[:2]
    regions = [((0, 0), (w, h)), ((-300, 130), (w, h - 50)), ((517, 263), (2100, 1300))]
    got = {}
    for tiles, name in ((10**9, "serial"), (1, "parallel")):
        monkeypatch.setattr(stored_tiles, "PARALLEL_REGION_TILES", tiles)
        with TiffSlide(pyramid_tiff, cache_bytes=cache_tiles * TILE_BYTES) as s:
            got[name] = [s.read_region(loc, 0, size) for loc, size in regions]
    for serial, parallel in zip(got["serial"], got["parallel"], strict=True):
        np.testing.assert_array_equal(parallel, serial)
    np.testing.assert_array_equal(got["parallel"][0], ref)


def _decoding_threads(monkeypatch) -> list:
    """Make every region of stored tiles go to the region threads where it may, and record the
    name of the thread each stored tile is decoded in (the region threads are ``region-decode_N``)."""
    import simplejpeg

    import wsi_pipeline.slide.stored_tiles as stored_tiles

    monkeypatch.setattr(stored_tiles, "PARALLEL_REGION_TILES", 1)
    names, decode_jpeg = [], simplejpeg.decode_jpeg

    def recording(*args, **kwargs):
        names.append(threading.current_thread().name)
        return decode_jpeg(*args, **kwargs)

    monkeypatch.setattr(simplejpeg, "decode_jpeg", recording)
    return names


def _by_region_threads(names: list) -> int:
    return sum(name.startswith("region-decode") for name in names)


def test_a_region_read_while_decoding_in_this_thread_is_decoded_by_it(pyramid_tiff, monkeypatch):
    """Inside ``decoding_in_this_thread`` a large region's tiles are decoded by the reading thread,
    to the same pixels as the region threads give; the setting ends with the block, nested too."""
    from wsi_pipeline.slide.base import decodes_in_this_thread, decoding_in_this_thread

    regions = [((0, 0), (1800, 1300)), ((-300, 130), (900, 700))]
    with TiffSlide(pyramid_tiff) as s:
        names = _decoding_threads(monkeypatch)
        by_pool = [s.read_region(loc, 0, size) for loc, size in regions]
        assert names and _by_region_threads(names) == len(names)
        s.clear_cache()
        names.clear()
        with decoding_in_this_thread():
            with decoding_in_this_thread():
                assert decodes_in_this_thread()
            assert decodes_in_this_thread()
            by_reader = [s.read_region(loc, 0, size) for loc, size in regions]
        assert not decodes_in_this_thread()
        assert names and set(names) == {threading.current_thread().name}
        s.clear_cache()
        names.clear()
        s.read_region(regions[0][0], 0, regions[0][1])
        assert names and _by_region_threads(names) == len(names)
    for a, b in zip(by_pool, by_reader, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("model_on_cpu", [True, False])
def test_the_reader_threads_decode_their_regions_where_the_model_is_on_the_cpu(pyramid_tiff, monkeypatch, model_on_cpu):
    """A run whose model is on the CPU has its reader threads decode their tiles' stored tiles
    themselves (every core is the model's and theirs); otherwise a large region goes to the region
    threads. The pixels are the same either way."""
    from wsi_pipeline.tiling.slide_loader import make_slide_loader

    with TiffSlide(pyramid_tiff) as s:
        tiles = TileGrid(s, tile_size=512, overlap=64, level=0)[:6]
        names = _decoding_threads(monkeypatch)
        loader, _ = make_slide_loader(
            s, tiles, "cpu", batch_size=4, streams=2, reader_workers=2, model_on_cpu=model_on_cpu
        )
        with loader:
            got = np.concatenate([b.images.copy() for b in loader])
        decoded_in = list(names)
        s.clear_cache()
        expected = np.stack([read_tile(s, t) for t in tiles])
    np.testing.assert_array_equal(got, expected)
    assert decoded_in
    if model_on_cpu:
        assert all(name.startswith("tile-reader") for name in decoded_in), decoded_in
    else:
        assert _by_region_threads(decoded_in) == len(decoded_in), decoded_in


def test_a_damaged_tile_in_a_large_region_fails_the_read_and_names_it(tmp_path, monkeypatch):
    """The region threads' failure is the read's: the caller gets it, naming the file and the tile,
    and the slide reads its other tiles afterwards."""
    from helpers import corrupt_stored_tile

    import wsi_pipeline.slide.stored_tiles as stored_tiles
    from wsi_pipeline.errors import TileReadError

    path = str(tmp_path / "t.tif")
    image = smooth_rgb(1500, 2000, seed=4)
    write_pyramid_tiff(path, image, levels=1)
    ref = _level_pixels(path, 0)
    corrupt_stored_tile(path, index=7)
    monkeypatch.setattr(stored_tiles, "PARALLEL_REGION_TILES", 1)
    with TiffSlide(path) as s:
        out = np.zeros((1500, 2000, 3), np.uint8)
        with pytest.raises(TileReadError, match=r"t\.tif: cannot decode stored tile \(7, 0\)"):
            s.read_region_into((0, 0), 0, (2000, 1500), out)
        np.testing.assert_array_equal(s.read_region((0, 256), 0, (2000, 1244)), ref[256:])
