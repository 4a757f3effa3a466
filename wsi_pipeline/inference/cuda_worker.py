"""A CUDA executor's worker: one stream with its pinned buffers and the backend's runner.

A worker's batch goes: asynchronous H2D copy straight from the loader's
buffer, page-locked once per pooled buffer (:class:`HostRegistry`; where that
is not possible, a host copy into the worker's pinned buffer first); the
loader's buffer is released as soon as the copy has finished -> model ->
output reduction on the device (:class:`~.device_decode.DeviceDecoder`) ->
asynchronous D2H copy of the small results -> event.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from .device_decode import DeviceDecoder
from .tile_detections import BatchDetections


class HostRegistry:
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


_HOST_REGISTRY = HostRegistry()


class CudaWorker:
    """One CUDA stream with its pinned buffers and runner. Not thread-safe (``lock``)."""

    def __init__(self, backend: Any, decoder: DeviceDecoder, register_host: bool = True):
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
