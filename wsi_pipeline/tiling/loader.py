"""The streaming tile loader: parallel read + decode into reusable batch buffers.

Worker threads read tiles straight into slots of a small pool of batch
buffers (``N x size x size x 3`` uint8), each worker a contiguous run of a
batch's tiles (a whole batch unless there are more workers than batches in
flight). At most ``prefetch`` batches are in
flight, so memory is ``(prefetch + 1) * batch_size`` tiles whatever the
slide's size, and a slow consumer holds the readers back. Batches come out
in grid order. Threads suffice (no processes): OpenSlide, the TIFF codecs
and OpenCV all release the GIL while they decode.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import ClosedError, TileReadError
from ..slide.base import Slide
from .grid import Tile, read_tile, tile_origin_at_level


@dataclass
class Batch:
    """Tiles read together.

    ``images``: ``n x size x size x 3`` uint8, a view of a pooled buffer that
    is reused once the batch is released; ``tiles``: their grid tiles, in order;
    ``sequence``: the batch's position in the loader's output.
    """

    images: np.ndarray
    tiles: list[Tile]
    sequence: int
    _release: Callable[[], None] | None = field(default=None, repr=False)
    ready: None = None  # host memory: readable at once

    def release(self) -> None:
        """Give the buffer back to the loader (idempotent)."""
        if self._release is not None:
            rel, self._release = self._release, None
            rel()

    def __len__(self) -> int:
        return len(self.tiles)


def chunk_bounds(n: int, workers: int, prefetch: int) -> list[tuple[int, int]]:
    """Split a batch of ``n`` tiles into contiguous (start, stop) runs, one task each.

    One run per batch while the batches in flight (``prefetch``) already
    keep every worker busy: a worker then reads neighbouring tiles one
    after another (they share stored tiles, so the decode cache hits) and
    the hand-off costs one task per batch, not one per tile. With more
    ``workers`` than batches in flight, a batch is split so all can read.
    """
    parts = min(n, max(1, -(-workers // prefetch)))
    edges = [round(k * n / parts) for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts)]


class TileLoader:
    """Read ``tiles`` of ``slide`` in parallel and yield them as :class:`Batch` es.

    ``batch_size`` tiles a batch; ``workers`` reading threads; ``prefetch``
    batches read ahead of the consumer. With ``auto_release`` (the default)
    a batch's buffer is reused as soon as the next batch is asked for; pass
    False to keep batches until their :meth:`Batch.release` (an executor
    copying to the device asynchronously does this); it may then hold up to
    ``max_held`` batches at once before the loader waits for a release.

    An error reading a tile stops the loader and is raised from the
    iteration as :class:`TileReadError` naming the tile. Breaking out of the
    loop, an exception in the consumer, or Ctrl-C shut the workers down.
    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        slide: Slide,
        tiles: Sequence[Tile],
        batch_size: int = 16,
        workers: int = 2,
        prefetch: int = 2,
        auto_release: bool = True,
        max_held: int = 2,
        read: Callable[[Slide, Tile, np.ndarray], object] | None = None,
    ):
        if batch_size < 1 or workers < 1 or prefetch < 1:
            raise ValueError("batch_size, workers and prefetch must be at least 1")
        self.slide = slide
        self.tiles = list(tiles)
        self.batch_size = int(batch_size)
        self.workers = int(workers)
        self.prefetch = int(prefetch)
        self.auto_release = auto_release
        self._read = read or (lambda s, t, out: read_tile(s, t, out))
        size = self.tiles[0].size if self.tiles else 1
        self.tile_size = size
        # prefetch buffers being read + those the consumer holds.
        n_buffers = self.prefetch + (1 if auto_release else max(1, int(max_held)))
        self._free: deque[np.ndarray] = deque(
            np.empty((self.batch_size, size, size, 3), np.uint8) for _ in range(n_buffers)
        )
        self._free_cv = threading.Condition()
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._reserve_cache(n_buffers * self.batch_size + self.workers)
        # A slide whose reads wait on a network is told each batch's regions a batch before its reads.
        self._hints = type(slide).fetch_ahead is not Slide.fetch_ahead

    def _fetch_ahead(self, start: int) -> None:
        """Tell the slide the regions of the batch of tiles from ``start`` (:meth:`Slide.fetch_ahead`)."""
        tiles = self.tiles[start : start + self.batch_size]
        if not self._hints or not tiles:
            return
        boxes = []
        for t in tiles:
            x0, y0 = tile_origin_at_level(self.slide, t)
            boxes.append((x0, y0, x0 + t.read_size, y0 + t.read_size))
        self.slide.fetch_ahead(tiles[0].level, boxes)

    def _reserve_cache(self, tiles_in_flight: int) -> None:
        """Ask the slide's tile cache (where it has one) to hold the grid rows in flight."""
        if not self.tiles:
            return
        t = self.tiles[0]
        cols = len({tile.col for tile in self.tiles[: 4 * tiles_in_flight]}) or 1
        rows = -(-tiles_in_flight // cols) + 2  # the rows in flight, the next one's overlap
        level_ds = self.slide.level_downsamples[t.level]
        self.slide.reserve_cache_band(t.level, int(rows * t.extent_level0 / level_ds))

    @property
    def n_batches(self) -> int:
        return (len(self.tiles) + self.batch_size - 1) // self.batch_size

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the batch buffers (the loader's whole pixel memory)."""
        return sum(b.nbytes for b in self._free)

    def _acquire(self) -> np.ndarray:
        with self._free_cv:
            while not self._free:
                if self._stop.is_set():
                    raise ClosedError("tile loader closed")
                self._free_cv.wait(0.1)
            return self._free.popleft()

    def _give_back(self, buf: np.ndarray) -> None:
        with self._free_cv:
            self._free.append(buf)
            self._free_cv.notify()

    def _read_one(self, tile: Tile, out: np.ndarray) -> None:
        try:
            self._read(self.slide, tile, out)
        except TileReadError as exc:
            exc.tile = tile
            raise
        except Exception as exc:
            err = TileReadError(
                self.slide.path,
                f"cannot read tile {tile.index} (row {tile.row}, col {tile.col}): {exc}",
                (tile.x0_level0, tile.y0_level0),
                tile.level,
            )
            err.tile = tile
            raise err from exc

    def _read_chunk(self, tiles: Sequence[Tile], out: np.ndarray) -> None:
        """Read contiguous ``tiles`` into ``out[0], out[1], ...`` on one worker, in order."""
        for i, tile in enumerate(tiles):
            if self._stop.is_set():
                return
            self._read_one(tile, out[i])

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise ClosedError("tile loader already closed")
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tile-reader")
        pending: deque[tuple[int, np.ndarray, list[Tile], list[Future]]] = deque()
        starts = range(0, len(self.tiles), self.batch_size)
        next_start = iter(enumerate(starts))
        previous: Batch | None = None

        def submit_next() -> bool:
            item = next(next_start, None)
            if item is None:
                return False
            seq, start = item
            if seq == 0:
                self._fetch_ahead(start)
            self._fetch_ahead(start + self.batch_size)
            tiles = self.tiles[start : start + self.batch_size]
            buf = self._acquire()
            futures = [
                self._pool.submit(self._read_chunk, tiles[lo:hi], buf[lo:hi])
                for lo, hi in chunk_bounds(len(tiles), self.workers, self.prefetch)
            ]
            pending.append((seq, buf, tiles, futures))
            return True

        try:
            for _ in range(self.prefetch):
                if not submit_next():
                    break
            while pending:
                seq, buf, tiles, futures = pending.popleft()
                for f in futures:
                    f.result()  # raises the tile's error
                if previous is not None and self.auto_release:
                    previous.release()
                batch = Batch(buf[: len(tiles)], tiles, seq, _release=lambda b=buf: self._give_back(b))
                previous = batch
                # Read ahead while the consumer works on this batch.
                submit_next()
                yield batch
        finally:
            self._shutdown()
            if previous is not None and self.auto_release:
                previous.release()

    def _shutdown(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        """Stop the workers and wait for them (each finishes at most its current tile)."""
        self._shutdown()
        self._closed = True

    def __enter__(self) -> TileLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
