"""Dynamic batching: tiles from many callers share one model.

A :class:`TileService` owns an inference function (a backend's ``infer``
followed by decoding, or an executor's ``infer_tiles``) and ``workers``
threads that run it. Callers ``submit`` arrays of tiles from any thread and
get a future; queued requests are packed into batches of up to
``max_batch`` tiles, waiting at most ``max_wait_s`` for a batch to fill, so
four cameras calling at once share batches instead of queueing whole runs
behind each other. Each caller's future resolves to its own tiles' results,
in its own order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ..errors import ClosedError, InferenceError, WSIPipelineError
from .tile_detections import TileDetections

InferFn = Callable[[np.ndarray], list[TileDetections]]


class _Request:
    __slots__ = ("tiles", "future", "results", "done", "tile_ids", "batch", "caller")

    def __init__(self, tiles: np.ndarray, tile_ids: list[int] | None, batch: int | None):
        self.tiles = tiles
        self.batch = batch
        self.caller = threading.get_ident()
        self.future: Future = Future()
        self.results: list[TileDetections | None] = [None] * len(tiles)
        self.done = 0
        self.tile_ids = tile_ids


class TileService:
    """Run ``infer`` (``N x H x W x 3 uint8 -> list of N TileDetections``) for concurrent callers."""

    def __init__(self, infer: InferFn, max_batch: int = 16, workers: int = 1, max_wait_s: float = 0.005):
        if max_batch < 1 or workers < 1:
            raise ValueError("max_batch and workers must be at least 1")
        self._infer = infer
        self.max_batch = int(max_batch)
        self.max_wait_s = float(max_wait_s)
        self._queue: deque[tuple[_Request, int]] = deque()  # (request, first tile not yet taken)
        self._cv = threading.Condition()
        self._closed = False
        self.batches_run = 0  # batches handed to ``infer``
        self.mixed_batches = 0  # of which held tiles of more than one caller
        self._threads = [
            threading.Thread(target=self._work, name=f"tile-service-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, tiles: np.ndarray, tile_ids: list[int] | None = None, batch: int | None = None) -> Future:
        """Queue ``tiles`` (copied: the caller may reuse its buffer at once).

        The future's result is a list of one :class:`TileDetections` per tile. ``batch``: while no
        other thread's tiles are queued, the batch these start holds this many (default
        ``max_batch``): with ``batch=len(tiles)`` a caller's requests run as it cut them, none
        waiting to be filled up by the next. Other callers' tiles queued meanwhile share batches.
        """
        tiles = np.array(tiles, dtype=np.uint8, copy=True, order="C")
        if tiles.ndim != 4 or tiles.shape[-1] != 3:
            raise ValueError(f"expected N x H x W x 3 uint8 tiles, found shape {tiles.shape}")
        req = _Request(tiles, tile_ids, batch)
        if len(tiles) == 0:
            req.future.set_result([])
            return req.future
        with self._cv:
            if self._closed:
                raise ClosedError("inference service is closed")
            self._queue.append((req, 0))
            self._cv.notify_all()  # idle workers, and one waiting for its batch to fill
        return req.future

    def infer(self, tiles: np.ndarray) -> list[TileDetections]:
        """Submit and wait."""
        return self.submit(tiles).result()

    def _take_batch(self) -> list[tuple[_Request, int, int]] | None:
        """Pop up to max_batch tiles from the queue: [(request, start, stop)]."""
        with self._cv:
            while True:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return None
                # Let a partial batch fill for a moment: other callers may be about to submit.
                target = self._batch_target()
                queued = sum(len(r.tiles) - s for r, s in self._queue)
                if queued < target and self.max_wait_s > 0:
                    deadline = time.monotonic() + self.max_wait_s
                    while self._queue and sum(len(r.tiles) - s for r, s in self._queue) < self._batch_target():
                        left = deadline - time.monotonic()
                        if left <= 0 or self._closed:
                            break
                        self._cv.wait(left)
                if self._queue:  # another worker may have taken everything meanwhile
                    break
            parts: list[tuple[_Request, int, int]] = []
            room = self._batch_target()
            while self._queue and room:
                req, start = self._queue.popleft()
                stop = min(len(req.tiles), start + room)
                parts.append((req, start, stop))
                room -= stop - start
                if stop < len(req.tiles):
                    self._queue.appendleft((req, stop))
            return parts

    def _batch_target(self) -> int:
        """The size of the next batch: the first queued request's ``batch`` while one thread's
        requests alone are queued, else ``max_batch`` (callers share batches)."""
        head = self._queue[0][0] if self._queue else None
        if head is None or head.batch is None or any(r.caller != head.caller for r, _ in self._queue):
            return self.max_batch
        return max(1, min(self.max_batch, head.batch))

    def _work(self) -> None:
        while True:
            parts = self._take_batch()
            if parts is None:
                return
            batch = (
                parts[0][0].tiles[parts[0][1] : parts[0][2]]
                if len(parts) == 1
                else np.concatenate([r.tiles[a:b] for r, a, b in parts])
            )
            with self._cv:
                self.batches_run += 1
                self.mixed_batches += len({id(r) for r, _, _ in parts}) > 1
            try:
                results = self._infer(batch)
                if len(results) != len(batch):
                    raise WSIPipelineError(f"model returned {len(results)} results for {len(batch)} tiles")
            except BaseException as exc:  # surfaces in every caller whose tiles were in the batch
                for req, a, b in parts:
                    if not req.future.done():
                        ids = req.tile_ids[a:b] if req.tile_ids else list(range(a, b))
                        err = InferenceError(f"{type(exc).__name__}: {exc}", ids)
                        err.__cause__ = exc
                        req.future.set_exception(err)
                continue
            k = 0
            for req, a, b in parts:
                req.results[a:b] = results[k : k + (b - a)]
                k += b - a
                with self._cv:
                    req.done += b - a
                    finished = req.done == len(req.tiles)
                if finished and not req.future.done():
                    req.future.set_result(req.results)

    def close(self) -> None:
        """Finish queued work and stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> TileService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
