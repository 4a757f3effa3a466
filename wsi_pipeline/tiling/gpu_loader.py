"""The GPU tile loader: a slide's tiles as :class:`DeviceBatch` es decoded on the GPU, in grid order.

:class:`GpuTileLoader` decodes each stored tile once per slide where it
can: batches in grid order share stored tile rows, and a batch copies the
stored tiles it shares with the previous batch from that batch's mosaic on
the device instead of decoding them again (the previous mosaic is handed
over in sequence order; only one is held at a time).

How one batch is assembled (stored JPEG tiles decoded once into a mosaic,
patches gathered from it) is :mod:`.gpu_decode`; the decoder calls are
:mod:`.gpu_codecs`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .gpu_codecs import (
    decode_stream,
)
from .gpu_decode import (
    GpuTileDecoder,
    StoredTiles,
)
from .grid import Tile
from .jpeg_processes import JpegHelpers

try:
    import torch
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc

__all__ = ["DeviceBatch", "GpuTileLoader"]


@dataclass
class DeviceBatch:
    """A batch of tiles already on the device.

    ``images``: ``n x size x size x 3`` uint8 CUDA tensor (RGB); ``ready``:
    an event recorded after it was written (consumers on other streams wait
    on it; None on a CPU device); ``tiles``, ``sequence``: as in
    :class:`~..tiling.loader.Batch`.
    """

    images: Any
    tiles: list[Tile]
    sequence: int
    ready: Any = None
    _release: Any = field(default=None, repr=False)

    def release(self) -> None:
        """Drop the reference to the pixels (the caching allocator reuses them once unused)."""
        self.images = None

    def __len__(self) -> int:
        return len(self.tiles)


class HandOff:
    """Each batch's :class:`StoredTiles` passed to the next batch, in sequence order.

    Holds one batch's at a time: the next batch takes it, then publishes its
    own. A failed batch publishes None at once (its successor then decodes
    everything; a predecessor publishing after it is ignored); :meth:`stop`
    wakes any waiting thread, which then raises CancelledError.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = -1  # the latest batch published
        self._stored: StoredTiles | None = None
        self._stopped = False

    def publish(self, seq: int, stored: StoredTiles | None) -> None:
        with self._cond:
            if seq > self._seq:  # else a later batch failed first: nobody takes this one
                self._seq, self._stored = seq, stored
            self._cond.notify_all()

    def take(self, seq: int) -> StoredTiles | None:
        """Batch ``seq - 1``'s stored tiles, once published (None where it or a later batch failed)."""
        with self._cond:
            while self._seq < seq - 1:
                if self._stopped:
                    raise CancelledError("the loader is closing")
                self._cond.wait(0.1)
            if self._seq != seq - 1:
                return None
            stored, self._stored = self._stored, None
            return stored

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._stored = None
            self._cond.notify_all()


class GpuTileLoader:
    """Yield :class:`DeviceBatch` es of ``tiles`` decoded on the GPU, in grid order.

    ``decode_threads`` batches are assembled at once, each thread on its own
    CUDA stream (``jpeg_decoder``, ``jpeg_threads``: see :class:`GpuTileDecoder`);
    ``prefetch`` batches are decoded ahead of the consumer
    (device memory: about ``(prefetch + 2) * batch_size`` tiles plus the
    stored-tile mosaics). Each batch decodes the stored tiles it does not
    share with the previous batch, then waits for that batch's mosaic and
    copies the shared ones from it on the device (its stream waits on the
    previous batch's event): with tiles in grid order each stored tile is
    decoded about once per slide (counted in ``decoder.stored_tiles_decoded``
    and ``decoder.stored_tiles_reused``). One previous mosaic is held at a
    time. Errors stop the loader and are raised from the iteration; breaking
    out of the loop shuts the threads down. On a CPU device (tests) there
    are no CUDA streams and ``DeviceBatch.ready`` is None.
    """

    def __init__(
        self,
        slide: Any,
        tiles: Sequence[Tile],
        batch_size: int = 64,
        device: str = "cuda",
        prefetch: int = 3,
        decode_threads: int = 2,
        jpeg_decoder: str = "nvjpeg",
        jpeg_threads: int | None = None,
        helpers: JpegHelpers | None = None,
    ):
        if batch_size < 1 or prefetch < 1 or decode_threads < 1:
            raise ValueError("batch_size, prefetch and decode_threads must be at least 1")
        self.decoder = GpuTileDecoder(slide, device, jpeg_decoder=jpeg_decoder, threads=jpeg_threads, helpers=helpers)
        self.tiles = list(tiles)
        if self.tiles:
            self.decoder._check(self.tiles)
        self.batch_size = int(batch_size)
        self.prefetch = int(prefetch)
        self.decode_threads = int(decode_threads)
        self._local = threading.local()
        self._slots_lock = threading.Lock()
        self._next_slot = 0
        self._pool: ThreadPoolExecutor | None = None
        self._handoff: HandOff | None = None

    @property
    def n_batches(self) -> int:
        return (len(self.tiles) + self.batch_size - 1) // self.batch_size

    def _stream(self) -> Any:
        """This thread's CUDA stream (a null context on a CPU device).

        The loader's threads are the run's, but their streams are the process's
        (:func:`decode_stream`): blocks the caching allocator holds for a stream are reused only
        by allocations on that stream, so with new streams every run would allocate its batches'
        mosaics, canvases and patches from the driver again.
        """
        if not self.decoder.cuda:
            return contextlib.nullcontext()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._slots_lock:
                slot = self._next_slot
                self._next_slot += 1
            stream = self._local.stream = decode_stream(self.decoder.device, slot)
        return torch.cuda.stream(stream)

    def _decode_batch(self, seq: int, start: int, handoff: HandOff) -> DeviceBatch:
        tiles = self.tiles[start : start + self.batch_size]
        previous = self.tiles[max(0, start - self.batch_size) : start]
        try:
            with self._stream():
                images, stored = self.decoder.decode_after(tiles, previous, lambda: handoff.take(seq))
                ready = None
                if self.decoder.cuda:
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(self.decoder.device))
        except BaseException:
            handoff.publish(seq, None)  # the next batch decodes what it shares with this one
            raise
        handoff.publish(seq, stored if seq + 1 < self.n_batches else None)
        return DeviceBatch(images, tiles, seq, ready)

    def __iter__(self) -> Iterator[DeviceBatch]:
        self._pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="gpu-decode")
        handoff = self._handoff = HandOff()
        pending: deque[Future] = deque()
        starts = iter(enumerate(range(0, len(self.tiles), self.batch_size)))

        def submit() -> None:
            item = next(starts, None)
            if item is not None:
                seq, start = item
                pending.append(self._pool.submit(self._decode_batch, seq, start, handoff))

        try:
            for _ in range(self.prefetch):
                submit()
            while pending:
                batch = pending.popleft().result()  # raises the batch's error
                submit()
                yield batch
        finally:
            handoff.stop()
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self.decoder.close()

    def close(self) -> None:
        if self._handoff is not None:
            self._handoff.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.decoder.close()

    def __enter__(self) -> GpuTileLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
