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
Different workers' batches overlap copies and compute on the GPU.

On the CPU (ONNX Runtime, or the torch backend on ``cpu``) workers are
threads calling ``backend.infer``; ONNX Runtime runs concurrent calls and
releases the GIL. For the best CPU throughput give each worker its own
session with the intra-op threads split between them
(:meth:`Executor.from_card` does that).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ClosedError, ConfigError, InferenceError, WSIPipelineError
from .backend import Backend
from .card import ModelCard, load_card
from .decoders import (
    BatchDetections,
    TileDetections,
    check_heatmap_shape,
    decode_batch,
    decode_names,
    decoder_params,
)

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
_COUNT = "\0rows kept"  # the compacted row count per tile, beside the model outputs


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


# -- device-side output reduction -------------------------------------------------


class _DeviceDecoder:
    """Shrinks a batch's device outputs before the copy back; the CPU decoder does the rest.

    The card's decoder (:func:`~.decoders.decode`) is the only definition of
    what a detection is. On the device, ``centernet`` and
    ``boxes_scores_labels`` outputs are only compacted: rows below the score
    threshold (and, with ``num_detections``, rows past the count) are moved
    behind the others by a stable descending sort on the score and their
    scores set to -inf, which every decoder drops. The host then slices the
    rows up to the batch's largest count and runs the decoder on them, so
    thresholds, box formats, label offsets, per-tile NMS and
    ``max_detections`` are applied by exactly the code the CPU path runs
    (row order is kept: the decoder's own stable sort leaves sorted rows as
    they are). ``yolo`` outputs are copied back whole. The heatmap's
    activation is applied on the device (the host decoder is told so); the
    heatmap is copied back too, or, for a consumer that blends it on the
    device, left there (:meth:`finish` ``heatmaps=``).
    """

    def __init__(self, card: ModelCard):
        self.card = card
        self.kind = card.decoder.type
        self.p = decoder_params(card)
        self.compacts = self.kind in ("centernet", "boxes_scores_labels")
        self.host_card = _card_without_activation(card) if card.heatmap is not None else card
        self.boxes_card = dataclasses.replace(card, heatmap=None)  # what the host decodes when the heatmap stays

    def reduce(self, outs: dict[str, Any], n: int) -> dict[str, Any]:
        """Device tensors to copy back: ``{name: tensor [n, ...]}``, ``count`` when compacting."""
        import torch

        card, p = self.card, self.p
        red: dict[str, torch.Tensor] = {}
        if self.compacts:
            boxes, scores, labels = outs[p["boxes"]][:n], outs[p["scores"]][:n].float(), outs[p["labels"]][:n]
            if boxes.dim() == 2:
                boxes, scores, labels = boxes[None], scores[None], labels[None]
            # The rows the decoder keeps (decoders.detection_rows), so that the counts are its own.
            offset = int(p.get("label_offset", 0))
            keep = (
                (scores >= float(p["score_threshold"]))
                & (labels.long() + offset >= 0)
                & torch.isfinite(boxes.float()).all(dim=2)
            )
            if self.kind == "boxes_scores_labels" and p["num_detections"] is not None:
                counts = outs[p["num_detections"]][:n].reshape(-1).long()
                cols = torch.arange(scores.shape[1], device=scores.device)
                keep = keep & (cols[None, :] < counts[:, None])
            key = torch.where(keep, scores, torch.full_like(scores, -float("inf")))
            key, order = torch.sort(key, dim=1, descending=True, stable=True)
            red[p["boxes"]] = torch.gather(boxes, 1, order[:, :, None].expand(-1, -1, boxes.shape[2])).contiguous()
            red[p["scores"]] = key.contiguous()
            red[p["labels"]] = torch.gather(labels, 1, order).contiguous()
            red[_COUNT] = keep.sum(dim=1).to(torch.int32)
        else:
            for name in decode_names(card):
                if card.heatmap is None or name != card.heatmap.output:
                    red[name] = outs[name][:n].contiguous()
        if card.heatmap is not None:
            hm = outs[card.heatmap.output][:n]
            if card.heatmap.activation == "sigmoid":
                hm = torch.sigmoid(hm.float())
            elif card.heatmap.activation == "softmax":
                hm = torch.softmax(hm.float(), dim=1)
            else:  # its own memory: the runner's output buffer is rewritten by the next batch
                hm = hm.to(torch.float32, copy=True)
            red[card.heatmap.output] = hm.contiguous()
        return red

    def finish(self, host: dict[str, np.ndarray], n: int, heatmaps: Any = None) -> BatchDetections:
        """Host arrays (views of reused pinned buffers: the decoder copies what it keeps) -> detections.

        ``heatmaps``: the batch's heatmaps left on the device (:meth:`reduce`'s,
        not among ``host``): the detections carry that tensor as they are.
        """
        outputs = dict(host)
        dropped = None
        if self.compacts:
            counts = outputs.pop(_COUNT)[:n].astype(np.int64)
            # Past the card's cap only the count is taken: the rows are sorted, the first ones are kept.
            cap = self.card.detections_cap
            dropped = np.maximum(counts - cap, 0) if counts.max(initial=0) > cap else None
            k = max(1, min(int(counts.max(initial=0)), cap))
            for name in (self.p["boxes"], self.p["scores"], self.p["labels"]):
                outputs[name] = outputs[name][:, :k]
            if self.kind == "boxes_scores_labels" and self.p["num_detections"] is not None:
                outputs[self.p["num_detections"]] = np.full(n, k, np.int64)
        if heatmaps is None:
            batch = decode_batch(outputs, self.host_card)
        else:
            check_heatmap_shape(heatmaps.shape, self.card, n)
            batch = dataclasses.replace(decode_batch(outputs, self.boxes_card), heatmaps=heatmaps)
        return batch if dropped is None else dataclasses.replace(batch, over_cap=dropped)


def _card_without_activation(card: ModelCard) -> ModelCard:
    return dataclasses.replace(card, heatmap=dataclasses.replace(card.heatmap, activation="none"))


# -- page-locking the loader's buffers ---------------------------------------------


class _HostRegistry:
    """Page-locks (cudaHostRegister) the host arrays batches come in, once per buffer.

    A loader reuses a few pooled buffers, so registering each once lets the
    H2D copy read the loader's buffer directly: no extra host memcpy, whose
    memory bandwidth otherwise caps a many-stream executor. The registration
    is undone when the array is freed. Where registering fails (or for
    arrays that do not own contiguous memory) the caller copies through its
    own pinned buffer instead.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        self._refused: set[int] = set()

    @staticmethod
    def _root(arr: np.ndarray) -> np.ndarray | None:
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or not root.flags.c_contiguous or not root.flags.owndata:
            return None
        return root

    def ensure(self, arr: np.ndarray) -> bool:
        import torch

        root = self._root(arr)
        if root is None or root.nbytes < (1 << 20):
            return False
        ptr, size = int(root.ctypes.data), int(root.nbytes)
        with self._lock:
            if self._registered.get(ptr) == size:
                return True
            if ptr in self._refused:
                return False
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
                self._refused.add(ptr)
                clear = getattr(cudart, "cudaGetLastError", None)
                if clear is not None:  # leave no error behind for the next kernel launch check
                    clear()
                return False
            self._registered[ptr] = size
            weakref.finalize(root, self._unregister, ptr)
            return True

    def _unregister(self, ptr: int) -> None:
        import torch

        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                torch.cuda.cudart().cudaHostUnregister(ptr)


_HOST_REGISTRY = _HostRegistry()


# -- workers ----------------------------------------------------------------------


class _CudaWorker:
    """One CUDA stream with its pinned buffers and runner. Not thread-safe (``lock``)."""

    def __init__(self, backend: Any, decoder: _DeviceDecoder, register_host: bool = True):
        import torch

        self.torch = torch
        self.device = backend.device
        self.stream = torch.cuda.Stream(self.device)
        self.runner = backend.create_runner(self.stream)
        self.max_batch = int(self.runner.max_batch)
        self._input_hw = backend.card.input.size_hw
        self._pinned_in: Any = None  # made on the first host batch that needs it: device batches never do
        self.copied = torch.cuda.Event()  # H2D done: pinned_in may be overwritten
        self.done = torch.cuda.Event()  # D2H done: pinned_out may be read
        self.pinned_out: dict[str, Any] = {}
        self.decoder = decoder
        self.lock = threading.Lock()
        self._copied_recorded = False
        self.register_host = register_host
        prepare = getattr(self.runner, "prepare", None)
        if prepare is not None:
            prepare()

    @property
    def pinned_in(self) -> Any:
        """The pinned staging buffer of host batches that cannot be page-locked in place."""
        if self._pinned_in is None:
            h, w = self._input_hw
            self._pinned_in = self.torch.empty((self.max_batch, h, w, 3), dtype=self.torch.uint8, pin_memory=True)
        return self._pinned_in

    def _out_buffer(self, name: str, t) -> Any:
        buf = self.pinned_out.get(name)
        if buf is None or buf.dtype != t.dtype or tuple(buf.shape[1:]) != tuple(t.shape[1:]):
            buf = self.torch.empty((self.max_batch, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
            self.pinned_out[name] = buf
        return buf[: t.shape[0]]

    def process(
        self, images: Any, release: Any = None, ready: Any = None, heatmaps_on_device: bool = False
    ) -> BatchDetections:
        """Detections of ``images`` (host ``n x H x W x 3 uint8`` array, or a CUDA tensor).

        ``release`` is called once the pixels are copied (host) or queued (device);
        ``ready`` is an event the device tensor's producer recorded.
        ``heatmaps_on_device``: the detections' heatmaps stay a CUDA tensor
        (complete when this returns), not copied back.
        """
        torch = self.torch
        n_total = int(images.shape[0])
        results: list[BatchDetections] = []
        on_device = isinstance(images, torch.Tensor) and images.is_cuda
        direct = False
        if not on_device and isinstance(images, np.ndarray):
            direct = self.register_host and _HOST_REGISTRY.ensure(images)
            images = torch.from_numpy(images)
        released = False
        try:
            for start in range(0, n_total, self.max_batch):
                chunk = images[start : start + self.max_batch]
                n = int(chunk.shape[0])
                if on_device:
                    if ready is not None:
                        self.stream.wait_event(ready)
                    chunk.record_stream(self.stream)
                    with torch.cuda.stream(self.stream):
                        self.runner.input[:n].copy_(chunk, non_blocking=True)
                elif direct:
                    # The batch's own (page-locked) buffer is the DMA source; it is
                    # released once the copy has finished (below).
                    with torch.cuda.stream(self.stream):
                        self.runner.input[:n].copy_(chunk, non_blocking=True)
                        self.copied.record(self.stream)
                else:
                    if self._copied_recorded:
                        self.copied.synchronize()
                    self.pinned_in[:n].copy_(chunk)
                    if start + n >= n_total and release is not None:
                        release()
                        released = True
                    with torch.cuda.stream(self.stream):
                        self.runner.input[:n].copy_(self.pinned_in[:n], non_blocking=True)
                        self.copied.record(self.stream)
                        self._copied_recorded = True
                with torch.cuda.stream(self.stream):
                    outs = self.runner.run(n)
                    red = self.decoder.reduce(outs, n)
                    kept = None
                    if heatmaps_on_device and self.decoder.card.heatmap is not None:
                        kept = red.pop(self.decoder.card.heatmap.output)
                    host = {}
                    for k, v in red.items():
                        buf = self._out_buffer(k, v)
                        buf.copy_(v, non_blocking=True)
                        host[k] = buf
                    self.done.record(self.stream)
                if direct:
                    self.copied.synchronize()
                if (on_device or direct) and start + n >= n_total and release is not None:
                    release()
                    released = True
                self.done.synchronize()
                results.append(self.decoder.finish({k: v.numpy() for k, v in host.items()}, n, kept))
        finally:
            if not released and release is not None:
                release()
        return BatchDetections.concat(results)

    def close(self) -> None:
        self.stream.synchronize()
        self.runner = None
        self._pinned_in = None
        self.pinned_out.clear()


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
    buffers batches arrive in (once per buffer, see ``_HostRegistry``) so the
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
            decoder = _DeviceDecoder(self.card)
            self._workers: list[Any] = [_CudaWorker(self.backend, decoder, register_host) for _ in range(self.streams)]
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
        n_workers = len(self._workers)
        in_q: queue.Queue = queue.Queue(maxsize=n_workers)
        out_q: queue.Queue = queue.Queue(maxsize=2 * n_workers + 2)
        stop = threading.Event()
        feeding_done = threading.Event()

        def put_out(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out_q.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def feed() -> None:
            it = iter(batches)
            try:
                for seq, batch in enumerate(it):
                    if stop.is_set():
                        _release(batch)
                        break
                    while True:
                        if stop.is_set():
                            _release(batch)
                            break
                        try:
                            in_q.put((seq, batch), timeout=_POLL_S)
                            break
                        except queue.Full:
                            continue
            except BaseException as exc:  # a loader error ends the run; the consumer raises it
                stop.set()
                out_q.put(_Failure(exc))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    try:
                        close()
                    except Exception:
                        pass
                feeding_done.set()
                # One end mark per worker after the last batch: each ends as soon as it takes one,
                # not at its next poll of an empty queue (up to _POLL_S at the end of every run).
                for _ in range(n_workers):
                    while not stop.is_set():
                        try:
                            in_q.put(_END, timeout=_POLL_S)
                            break
                        except queue.Full:
                            continue

        def work(worker: Any) -> None:
            try:
                while True:
                    try:
                        item = in_q.get(timeout=_POLL_S)
                    except queue.Empty:
                        if feeding_done.is_set() or stop.is_set():
                            if in_q.empty():
                                break
                        continue
                    if item is _END:
                        break
                    seq, batch = item
                    if stop.is_set():
                        _release(batch)
                        continue
                    tiles = list(batch.tiles)
                    try:
                        with worker.lock:
                            dets = worker.process(
                                batch.images,
                                release=batch.release,
                                ready=batch.ready,
                                heatmaps_on_device=heatmaps_on_device,
                            )
                        if len(dets) != len(tiles) and tiles:
                            raise WSIPipelineError(f"{len(dets)} results for {len(tiles)} tiles")
                    except BaseException as exc:
                        _release(batch)
                        stop.set()
                        indices = [t.index for t in tiles]
                        err = InferenceError(f"{type(exc).__name__}: {exc}", indices, batch.sequence)
                        err.__cause__ = exc
                        out_q.put(_Failure(err))
                        break
                    put_out((seq, BatchResult(tiles, dets, batch.sequence)))
            finally:
                out_q.put(_DONE)

        feeder = threading.Thread(target=feed, name="executor-feed", daemon=True)
        threads = [
            threading.Thread(target=work, args=(w,), name=f"executor-{i}", daemon=True)
            for i, w in enumerate(self._workers)
        ]
        feeder.start()
        for t in threads:
            t.start()
        failure: BaseException | None = None
        finished = 0
        pending: dict[int, BatchResult] = {}
        next_seq = 0
        try:
            while finished < n_workers:
                try:
                    item = out_q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is _DONE:
                    finished += 1
                    continue
                if isinstance(item, _Failure):
                    if failure is None:
                        failure = item.exc
                    stop.set()
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
            failure = self._drain_and_join(in_q, out_q, feeder, threads) or failure
            if failure is None:
                for seq in sorted(pending):
                    yield pending.pop(seq)
        finally:
            stop.set()
            self._drain_and_join(in_q, out_q, feeder, threads)
        if failure is not None:
            raise failure

    @staticmethod
    def _drain_and_join(
        in_q: queue.Queue, out_q: queue.Queue, feeder: threading.Thread, threads: list[threading.Thread]
    ) -> BaseException | None:
        """Release queued batches until every thread has ended; return the first failure seen."""
        failure = None

        def drain() -> None:
            nonlocal failure
            for q in (in_q, out_q):
                try:
                    while True:
                        item = q.get_nowait()
                        if isinstance(item, _Failure) and failure is None:
                            failure = item.exc
                        elif q is in_q and item is not _END:
                            _release(item[1])
                except queue.Empty:
                    pass

        while any(t.is_alive() for t in [feeder, *threads]):
            drain()
            for t in [feeder, *threads]:
                t.join(timeout=_POLL_S / 4)
        drain()
        return failure

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


def _release(batch: TileBatch) -> None:
    batch.release()


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch")
