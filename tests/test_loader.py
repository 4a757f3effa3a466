"""How the TileLoader splits batches into worker tasks."""

import threading

import pytest
from helpers import smooth_rgb

from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.tiling import TileGrid, TileLoader
from wsi_pipeline.tiling.loader import chunk_bounds


def _slide():
    return ImageSlide.from_array(smooth_rgb(2200, 2700, seed=7))


@pytest.mark.parametrize(
    "workers,prefetch,n,expected",
    [
        (1, 2, 16, [(0, 16)]),
        (2, 2, 16, [(0, 16)]),
        (2, 4, 16, [(0, 16)]),
        (4, 2, 16, [(0, 8), (8, 16)]),
        (14, 4, 64, [(0, 16), (16, 32), (32, 48), (48, 64)]),
        (5, 1, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_chunk_bounds_cover_the_batch(workers, prefetch, n, expected):
    assert chunk_bounds(n, workers, prefetch) == expected


def test_each_batch_is_read_by_one_worker_in_order():
    s = _slide()
    grid = TileGrid(s)
    who: dict[int, str] = {}
    order: list[int] = []
    lock = threading.Lock()

    def read(slide, tile, out):
        with lock:
            who[tile.index] = threading.current_thread().name
            order.append(tile.index)
        out[...] = tile.index

    seen = []
    with TileLoader(s, grid, batch_size=5, workers=2, prefetch=2, read=read) as loader:
        for batch in loader:
            assert len({who[t.index] for t in batch.tiles}) == 1
            for img, t in zip(batch.images, batch.tiles, strict=True):
                assert (img == t.index).all()
            seen.extend(t.index for t in batch.tiles)
    assert seen == list(range(len(grid)))
    # Within a batch, tiles are read in grid order.
    for start in range(0, len(grid), 5):
        idx = [i for i in order if start <= i < start + 5]
        assert idx == sorted(idx)


def test_more_workers_than_batches_in_flight_split_batches():
    s = _slide()
    tiles = list(TileGrid(s))[:16]
    names: set[str] = set()
    lock = threading.Lock()
    # Each chunk's first tile waits for the other three: this only returns if the
    # batch's four chunks run on four workers at once.
    barrier = threading.Barrier(4, timeout=10)

    def read(slide, tile, out):
        if tile.index in (0, 4, 8, 12):
            barrier.wait()
        with lock:
            names.add(threading.current_thread().name)
        out[...] = tile.index

    loader = TileLoader(s, tiles, batch_size=16, workers=4, prefetch=1, read=read)
    assert chunk_bounds(16, loader.workers, loader.prefetch) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    sizes = []
    for batch in loader:
        sizes.append(len(batch))
        assert [int(img[0, 0, 0]) for img in batch.images] == [t.index for t in batch.tiles]
    assert sizes == [16] and len(names) == 4
