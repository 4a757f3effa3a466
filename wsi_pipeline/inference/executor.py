"""The executor: one backend run over a stream of tile batches by N concurrent workers.

On CUDA (a :class:`~.torch_backend.TorchBackend` or
:class:`~.tensorrt_backend.TensorRTBackend` on a GPU) every worker owns a
CUDA stream, a pinned host input buffer, the backend's per-stream runner
(device input buffer, CUDA graphs or TensorRT execution context) and pinned
host output buffers. A worker's batch goes: asynchronous H2D copy straight
from the loader's buffer, page-locked once per pooled buffer (or, where that
is not possible, a host copy into the worker's pinned buffer first); the
loader's buffer is released as soon as the copy has finished -> model ->
output reduction on the device (score threshold, sort, counts, heatmap
activation) -> asynchronous D2H copy of the small results -> event.
Different workers' batches overlap copies and compute on the GPU. The
worker is :class:`~.cuda_worker.CudaWorker`, the device step
:class:`~.device_decode.DeviceDecoder`.

On the CPU (ONNX Runtime, or the torch backend on ``cpu``) workers are
threads calling ``backend.infer``; ONNX Runtime runs concurrent calls and
releases the GIL. For the best CPU throughput give each worker its own
session with the intra-op threads split between them
(:meth:`Executor.from_card` does that).
"""

from __future__ import annotations

import os
import queue
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ClosedError, ConfigError, InferenceError, WSIPipelineError
from .backend import Backend
from .card import load_card
from .card_spec import ModelCard
from .cuda_worker import CudaWorker
from .decoders import decode_batch
from .device_decode import DeviceDecoder
from .tile_detections import BatchDetections, TileDetections

if TYPE_CHECKING:  # the executor reads only a tile's ``index``
    from ..tiling.grid import Tile


class TileBatch(Protocol):
    """What :meth:`Executor.run` takes: a loader's batch of tiles.

    ``images``: ``N x H x W x 3`` uint8 RGB, a numpy array or a CUDA tensor;
    ``tiles``: their grid tiles, in order; ``sequence``: the batch's position
    in its loader's output; ``ready``: a CUDA event to wait on before reading
    ``images`` (None: readable now); ``release()`` gives the pixels back to
    the loader once they are copied.
    """

    images: Any
    tiles: Sequence[Tile]
    sequence: int
    ready: Any

    def release(self) -> None: ...


DEFAULT_CUDA_STREAMS = 4
DEFAULT_CPU_WORKERS = 2
_POLL_S = 0.1


@dataclass
class BatchResult:
    """One batch's detections as arrays (``batch``, tile pixels), in the order of ``tiles``."""

    tiles: list[Tile]
    batch: BatchDetections
    sequence: int

    @property
    def detections(self) -> list[TileDetections]:
        """Per tile: ``detections[i]`` belongs to ``tiles[i]``."""
        return self.batch.tiles()


def _is_cuda_backend(backend: Any) -> bool:
    device = getattr(backend, "device", None)
    return getattr(device, "type", None) == "cuda" and hasattr(backend, "create_runner")


# -- workers ----------------------------------------------------------------------


class _CpuWorker:
    """A thread calling ``backend.infer`` (its own backend, or one shared)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.card = backend.card
        self.lock = threading.Lock()

    def process(
        self, images: np.ndarray, release: Any = None, ready: Any = None, heatmaps_on_device: bool = False
    ) -> BatchDetections:
        try:
            outs = self.backend.infer(images)
        finally:
            if release is not None:
                release()
        return decode_batch(outs, self.card)

    def close(self) -> None:
        pass


_DONE = object()
_END = object()  # in the input queue after the last batch: the worker taking it ends


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Executor:
    """Run a backend over batches of tiles with ``streams`` concurrent workers.

    ``backend``: a backend (ort, torch, tensorrt), or a list of CPU backends
    (one per worker, e.g. ONNX Runtime sessions with split intra-op threads).
    ``streams``: workers (CUDA streams on a GPU backend; threads on the CPU);
    default 4 on CUDA, 2 on the CPU. ``register_host``: page-lock the host
    buffers batches arrive in (once per buffer, see :class:`~.cuda_worker.HostRegistry`) so the
    H2D copy reads them directly; otherwise each stream copies the batch
    into its own pinned buffer first.

    :meth:`run` takes loader batches and yields :class:`BatchResult` s;
    :meth:`infer_tiles` runs an array of tiles directly. The executor keeps
    its streams, buffers and CUDA graphs between calls; :meth:`close` frees
    them.
    """

    def __init__(self, backend: Backend, streams: int | None = None, register_host: bool = True):
        backends = list(backend) if isinstance(backend, list | tuple) else [backend]
        if not backends:
            raise ConfigError("Executor: expected a backend, found an empty list")
        self.backend = backends[0]
        self.card: ModelCard = self.backend.card
        self.is_cuda = _is_cuda_backend(self.backend)
        if streams is None:
            streams = (
                len(backends) if len(backends) > 1 else (DEFAULT_CUDA_STREAMS if self.is_cuda else DEFAULT_CPU_WORKERS)
            )
        if streams < 1:
            raise ConfigError(f"streams: expected >= 1, found {streams}")
        self.streams = int(streams)
        if self.is_cuda:
            if len(backends) > 1:
                raise ConfigError("Executor: a CUDA backend makes its own per-stream runners; pass one")
            decoder = DeviceDecoder(self.card)
            self._workers: list[Any] = [CudaWorker(self.backend, decoder, register_host) for _ in range(self.streams)]
        else:
            self._workers = [_CpuWorker(backends[i % len(backends)]) for i in range(self.streams)]
        self.max_batch = int(getattr(self._workers[0], "max_batch", getattr(self.backend, "max_batch", 16)))
        self._closed = False
        self._rr = 0
        self._rr_lock = threading.Lock()

    @classmethod
    def from_card(
        cls, card: ModelCard | str | os.PathLike[str], backend: str = "ort", streams: int | None = None, **opts: Any
    ) -> Executor:
        """An executor with a backend made from ``card``.

        For ``ort`` each of the ``streams`` workers (default 2) gets its own
        session with ``intra_op_threads`` = CPU cores / workers (unless given).
        """
        from .backend import create_backend

        if not isinstance(card, ModelCard):
            card = load_card(card)
        if backend == "ort":
            workers = streams or DEFAULT_CPU_WORKERS
            if "intra_op_threads" not in opts:
                opts["intra_op_threads"] = max(1, (os.cpu_count() or 1) // workers)
            return cls([create_backend(card, "ort", **opts) for _ in range(workers)], streams=workers)
        return cls(create_backend(card, backend, **opts), streams=streams)

    # -- direct calls ------------------------------------------------------------
    def infer_tiles(self, images: np.ndarray) -> list[TileDetections]:
        """Detections of ``images`` (``N x H x W x 3 uint8`` RGB, H, W the card's), in order.

        Runs in the calling thread on a free worker (low latency, no queues):
        several threads calling at once use different workers (streams or
        sessions) where there are enough, and wait for one otherwise.
        """
        self._check_open()
        from .ort_backend import check_tile_batch

        if not (self.is_cuda and _is_torch_tensor(images)):
            images = check_tile_batch(images, self.card)
        if images.shape[0] == 0:
            return []
        for w in self._workers:
            if w.lock.acquire(blocking=False):
                try:
                    return w.process(images).tiles()
                finally:
                    w.lock.release()
        with self._rr_lock:
            w = self._workers[self._rr % len(self._workers)]
            self._rr += 1
        with w.lock:
            return w.process(images).tiles()

    # -- streaming ---------------------------------------------------------------
    def run(
        self, batches: Iterable[TileBatch], ordered: bool = False, heatmaps_on_device: bool = False
    ) -> Iterator[BatchResult]:
        """Yield a :class:`BatchResult` per batch of ``batches``.

        ``batches``: loader :class:`~..tiling.loader.Batch` es (``images``
        ``n x H x W x 3 uint8``, ``tiles``, ``sequence``, ``release()``), from
        a loader made with ``auto_release=False``; each is released as soon as
        its pixels are copied. Batches whose ``images`` is a CUDA tensor
        (:mod:`~wsi_pipeline.tiling.gpu_loader`) are copied device to device after their
        ``ready`` event. Results come in COMPLETION order, which may differ
        from input order with several streams; ``ordered=True`` yields them
        in input order instead (holding finished ones back).

        An error in a batch stops the run: the workers and the feeding thread
        are stopped and joined, held batches released, and the error raised
        as :class:`~wsi_pipeline.errors.InferenceError` naming the batch's tile indices (a
        loader's own TileReadError passes through unchanged). Leaving the loop
        early stops the run the same way.

        ``heatmaps_on_device``: on a CUDA executor, each result's
        ``batch.heatmaps`` is left on the device, a CUDA tensor
        ``n x C x H x W float32`` complete when yielded, for a consumer that
        blends it there (a :class:`~wsi_pipeline.stitch.stitcher.Stitcher`
        with ``heatmap_device``); otherwise, and on the CPU, a numpy array.
        """
        self._check_open()
        stream = _BatchStream(self._workers, heatmaps_on_device)
        yield from stream.results(batches, ordered)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("executor is closed")

    def close(self) -> None:
        """Synchronise and free the streams, buffers and graphs (the backend stays open)."""
        if not self._closed:
            for w in self._workers:
                try:
                    w.close()
                except Exception as exc:  # a sticky CUDA error: nothing left to free
                    warnings.warn(f"executor: closing a worker failed: {exc}", stacklevel=2)
            self._closed = True

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _BatchStream:
    """One :meth:`Executor.run`: a feeding thread, one thread per worker, and the queues between them.

    The feeder puts ``(sequence, batch)`` on the input queue, then one end mark per worker;
    each worker thread processes batches and puts ``(sequence, BatchResult)``, or a
    :class:`_Failure`, on the output queue, then ``_DONE``. The caller's thread takes the results
    (:meth:`results`). ``stop`` ends every thread at its next poll.
    """

    def __init__(self, workers: list[Any], heatmaps_on_device: bool):
        self.workers = workers
        self.heatmaps_on_device = heatmaps_on_device
        self.in_q: queue.Queue = queue.Queue(maxsize=len(workers))
        self.out_q: queue.Queue = queue.Queue(maxsize=2 * len(workers) + 2)
        self.stop = threading.Event()
        self.feeding_done = threading.Event()

    def _put(self, q: queue.Queue, item: Any) -> bool:
        """Put ``item`` on ``q`` once there is room; False where the run stopped first."""
        while not self.stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def feed(self, batches: Iterable[TileBatch]) -> None:
        """The feeding thread: every batch onto the input queue, then one end mark per worker."""
        it = iter(batches)
        try:
            for seq, batch in enumerate(it):
                if self.stop.is_set():
                    _release(batch)
                    break
                if not self._put(self.in_q, (seq, batch)):
                    _release(batch)
        except BaseException as exc:  # a loader error ends the run; the consumer raises it
            self.stop.set()
            self.out_q.put(_Failure(exc))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass
            self.feeding_done.set()
            # One end mark per worker after the last batch: each ends as soon as it takes one,
            # not at its next poll of an empty queue (up to _POLL_S at the end of every run).
            for _ in range(len(self.workers)):
                self._put(self.in_q, _END)

    def work(self, worker: Any) -> None:
        """A worker's thread: batches from the input queue to results on the output queue."""
        try:
            while True:
                try:
                    item = self.in_q.get(timeout=_POLL_S)
                except queue.Empty:
                    if self.feeding_done.is_set() or self.stop.is_set():
                        if self.in_q.empty():
                            break
                    continue
                if item is _END:
                    break
                seq, batch = item
                if self.stop.is_set():
                    _release(batch)
                    continue
                result = self._process(worker, batch)
                if isinstance(result, _Failure):
                    self.out_q.put(result)
                    break
                self._put(self.out_q, (seq, result))
        finally:
            self.out_q.put(_DONE)

    def _process(self, worker: Any, batch: TileBatch) -> BatchResult | _Failure:
        """One batch's result, or the failure (naming its tiles) that stops the run."""
        tiles = list(batch.tiles)
        try:
            with worker.lock:
                dets = worker.process(
                    batch.images,
                    release=batch.release,
                    ready=batch.ready,
                    heatmaps_on_device=self.heatmaps_on_device,
                )
            if len(dets) != len(tiles) and tiles:
                raise WSIPipelineError(f"{len(dets)} results for {len(tiles)} tiles")
        except BaseException as exc:
            _release(batch)
            self.stop.set()
            indices = [t.index for t in tiles]
            err = InferenceError(f"{type(exc).__name__}: {exc}", indices, batch.sequence)
            err.__cause__ = exc
            return _Failure(err)
        return BatchResult(tiles, dets, batch.sequence)

    def results(self, batches: Iterable[TileBatch], ordered: bool) -> Iterator[BatchResult]:
        """Start the threads and yield the results (see :meth:`Executor.run`); raise the run's failure."""
        feeder = threading.Thread(target=self.feed, args=(batches,), name="executor-feed", daemon=True)
        threads = [
            threading.Thread(target=self.work, args=(w,), name=f"executor-{i}", daemon=True)
            for i, w in enumerate(self.workers)
        ]
        feeder.start()
        for t in threads:
            t.start()
        failure: BaseException | None = None
        finished = 0
        pending: dict[int, BatchResult] = {}
        next_seq = 0
        try:
            while finished < len(self.workers):
                try:
                    item = self.out_q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is _DONE:
                    finished += 1
                    continue
                if isinstance(item, _Failure):
                    if failure is None:
                        failure = item.exc
                    self.stop.set()
                    continue
                if failure is not None:
                    continue
                seq, result = item
                if not ordered:
                    yield result
                    continue
                pending[seq] = result
                while next_seq in pending:
                    yield pending.pop(next_seq)
                    next_seq += 1
            # The workers are gone; batches still queued would keep the feeder
            # waiting in the loader for a free buffer: release them until it ends.
            failure = self.drain_and_join([feeder, *threads]) or failure
            if failure is None:
                for seq in sorted(pending):
                    yield pending.pop(seq)
        finally:
            self.stop.set()
            self.drain_and_join([feeder, *threads])
        if failure is not None:
            raise failure

    def drain_and_join(self, threads: list[threading.Thread]) -> BaseException | None:
        """Release queued batches until every thread has ended; return the first failure seen."""
        failure = None

        def drain() -> None:
            nonlocal failure
            for q in (self.in_q, self.out_q):
                try:
                    while True:
                        item = q.get_nowait()
                        if isinstance(item, _Failure) and failure is None:
                            failure = item.exc
                        elif q is self.in_q and item is not _END:
                            _release(item[1])
                except queue.Empty:
                    pass

        while any(t.is_alive() for t in threads):
            drain()
            for t in threads:
                t.join(timeout=_POLL_S / 4)
        drain()
        return failure


def _release(batch: TileBatch) -> None:
    batch.release()


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch")
