"""The kinds of stored-tile decoding a GPU batch uses, each into the slots of the batch's mosaic.

:class:`~.gpu_decode.GpuTileDecoder` lays a batch's stored JPEG tiles out as a mosaic on the device
and gathers its patches from it; :class:`StoredTileDecoding` decodes the stored tiles into their
slots by the decoder's kind (``jpeg_decoder``, :mod:`.gpu_decode`'s docstring):

- ``nvjpeg`` / ``nvimgcodec`` (:meth:`StoredTileDecoding.decode_gpu`): the streams read in one
  call, copied into this thread's page-locked buffer, decoded in one call; a batch nvJPEG refuses
  is decoded by the threads instead;
- ``threads`` (:meth:`StoredTileDecoding.decode_threads`): the slide reader's own decoding in a
  thread pool, into a pinned staging buffer, then one copy to the device;
- with :class:`~.jpeg_processes.JpegHelpers` (:meth:`StoredTileDecoding.decode_shared`): the
  helper processes decode their share while the GPU decoder decodes the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import TileReadError
from .gpu_codecs import nvimgcodec_decode, nvjpeg_decode
from .jpeg_processes import JpegHelpers, cpu_share_tile

try:
    import torch
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc

# The GPU decoder's logger: its warnings are the decoder's.
log = logging.getLogger("wsi_pipeline.tiling.gpu_decode")
_POOL_LOCK = threading.Lock()


class StoredTileDecoding:
    """Decodes a batch's stored tiles ``(slot, tx, ty)`` into their slots of a mosaic on ``device``.

    ``count``: called with ``fallback=1`` for a batch the GPU decoder refused, ``helped=n`` for the
    stored tiles the helper processes decoded (the owner's counters). Thread-safe: each calling
    thread has its own page-locked buffers.
    """

    def __init__(
        self,
        slide: Any,
        device: torch.device,
        background: torch.Tensor,
        jpeg_decoder: str,
        threads: int,
        helpers: JpegHelpers | None,
        count: Callable[..., None],
    ) -> None:
        self.slide = slide
        self.device = device
        self.cuda = device.type == "cuda"
        self.background = background
        self.jpeg_decoder = jpeg_decoder
        self.threads = threads
        self.helpers = helpers
        self._count = count
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._warned_staging = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _fail(self, level: int, tx: int, ty: int, exc: Exception) -> TileReadError:
        return TileReadError(
            self.slide.path, f"cannot decode stored tile ({tx}, {ty}) of level {level}: {exc}", None, level
        )

    def decode_gpu(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        """Decode ``slots`` with this decoder's GPU decoder (nvJPEG or nvImageCodec)."""
        # All the streams in one read and one array; the streams the decoder takes are views of it.
        buf, lengths = self.slide.raw_tiles_jpeg(level, [(tx, ty) for _, tx, ty in slots])
        sizes = lengths.tolist()
        where = [slot for (slot, _, _), n in zip(slots, sizes, strict=True) if n]
        empty = [slot for (slot, _, _), n in zip(slots, sizes, strict=True) if not n]
        if empty:
            stored[empty] = self.background
        if where:
            try:
                if self.jpeg_decoder == "nvimgcodec":
                    decoded = self._nvimgcodec_from_buffer(buf, [n for n in sizes if n])
                else:
                    decoded = self._nvjpeg_from_buffer(
                        list(torch.split(self._streams_buffer(buf), [n for n in sizes if n]))
                    )
            except RuntimeError:
                # nvJPEG refuses some streams (and damaged ones): libjpeg-turbo decodes the
                # batch instead and reports the tile that really cannot be decoded.
                self._count(fallback=1)
                self.decode_threads(stored, level, slots, th, tw)
                return
            try:  # one check of the stacked shape; tiles of differing shapes do not stack
                stacked = torch.stack(decoded)
            except RuntimeError:
                stacked = None
            if stacked is None or stacked.shape[1:] != (th, tw, 3):
                found = next(list(d.shape) for d in decoded if d.shape != (th, tw, 3))
                raise TileReadError(
                    self.slide.path, f"stored tile decoded to {found}, expected [{th}, {tw}, 3]", None, level
                )
            stored[where] = stacked
            if self.jpeg_decoder == "nvimgcodec" and self.cuda:
                self._keep_nvimgcodec_images()

    def _streams_buffer(self, buf: np.ndarray) -> torch.Tensor:
        """The JPEG streams ``buf`` as a tensor nvJPEG reads: on CUDA, a copy in this thread's
        page-locked buffer (kept for its next batches, grown as needed).

        nvJPEG copies each stream to the device on its own. From pageable memory the CUDA driver
        stages such a copy and may wait for the decoder's stream first, behind the previous tile's
        work, which waits behind the model's kernels; from page-locked memory each copy is queued
        and the call goes on (benchmarks/HISTORY.md, 2026-12-04 03:2x–04:2x).
        """
        if not self.cuda:
            return torch.from_numpy(buf)
        pinned = getattr(self._local, "streams", None)
        copied = getattr(self._local, "streams_copied", None)
        if copied is None:
            copied = self._local.streams_copied = torch.cuda.Event()
        copied.synchronize()  # the previous batch's streams have been copied out of it
        if pinned is None or pinned.numel() < len(buf):
            size = max(len(buf) * 5 // 4, 1 << 20)
            pinned = self._local.streams = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out = pinned[: len(buf)]
        out.numpy()[:] = buf
        return out

    def _nvjpeg_from_buffer(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """:func:`nvjpeg_decode` of views of :meth:`_streams_buffer` as ``h x w x 3`` tensors; on
        CUDA, marks when nvJPEG's copies out of it are done (its stream is waited on by the current
        one), even if it raised."""
        try:
            return [d.permute(1, 2, 0) for d in nvjpeg_decode(data, self.device)]
        finally:
            if self.cuda:
                self._local.streams_copied.record(torch.cuda.current_stream(self.device))

    def _nvimgcodec_from_buffer(self, buf: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
        """:func:`nvimgcodec_decode` of the streams in ``buf`` (``sizes`` bytes each, back to back).

        The images nvImageCodec returns own the pixels; they are kept until the next batch of this
        thread, once the work of this one on its stream is done (an event), so that no pixel is
        freed while a copy out of it is queued.
        """
        kept = getattr(self._local, "nvimgcodec_kept", None)
        if kept is not None:
            kept[1].synchronize()
            self._local.nvimgcodec_kept = None
        bounds = np.cumsum([0, *sizes]).tolist()
        data = [buf[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        stream = torch.cuda.current_stream(self.device)
        tensors, images = nvimgcodec_decode(data, self.device, stream)
        self._local.nvimgcodec_pending = images
        return tensors

    def _keep_nvimgcodec_images(self) -> None:
        """Keep this thread's last nvImageCodec images until its stream has used them."""
        images = getattr(self._local, "nvimgcodec_pending", None)
        if images is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._local.nvimgcodec_kept = (images, event)
            self._local.nvimgcodec_pending = None

    def _staging(self, m: int, th: int, tw: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """This thread's pinned staging buffer of at least ``m`` stored tiles (free to write)."""
        buf = getattr(self._local, "staging", None)
        event = getattr(self._local, "event", None)
        if event is not None:
            event.synchronize()  # the previous H2D copy out of it has finished
        if buf is None or buf.shape[0] < m or tuple(buf.shape[1:]) != (th, tw, 3):
            buf = torch.empty((max(m, 64), th, tw, 3), dtype=torch.uint8, pin_memory=self.cuda)
            self._local.staging = buf
        if event is None and self.cuda:
            event = self._local.event = torch.cuda.Event()
        return buf, event

    def decode_threads(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        m = len(slots)
        staging, event = self._staging(m, th, tw)
        host = staging.numpy()
        slide = self.slide

        def run(chunk: list) -> None:
            for i, (_, tx, ty) in chunk:
                try:  # the CPU reader's own decoding: its colour space, its damage reports
                    slide.decode_stored_tile(level, tx, ty, host[i])
                except (TileReadError, OSError):  # named by the reader, or a failed read as it is
                    raise
                except Exception as exc:  # codecs raise their own error types
                    raise self._fail(level, tx, ty, exc) from exc

        if self._pool is None:
            with _POOL_LOCK:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="jpeg-decode")
        # Chunks rather than one task per tile: the per-tile Python work then
        # runs in the pool threads, which release the GIL while decoding.
        items = list(enumerate(slots))
        n_chunks = min(m, self.threads)
        futures = [self._pool.submit(run, items[i::n_chunks]) for i in range(n_chunks)]
        for f in futures:
            f.result()
        decoded = torch.empty((m, th, tw, 3), dtype=torch.uint8, device=self.device)
        decoded.copy_(staging[:m], non_blocking=event is not None)
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        stored[torch.tensor([slot for slot, _, _ in slots], device=self.device)] = decoded

    def decode_shared(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        """Decode ``slots``: the helper processes their share (:func:`cpu_share_tile`) into a shared
        staging buffer, then one copy to the device; nvJPEG the rest, at the same time."""
        helpers = self.helpers
        assert helpers is not None
        mine, rest = [], []
        for s in slots:
            (mine if cpu_share_tile(s[1], s[2], helpers.tile_share) else rest).append(s)
        if not mine:
            self.decode_gpu(stored, level, slots, th, tw)
            return
        try:
            staging = helpers.acquire_staging(len(mine), th, tw, self.cuda)
        except OSError as exc:  # no room for the shared buffer: nvJPEG decodes the whole batch
            if not self._warned_staging:
                self._warned_staging = True
                log.warning("%s: the JPEG helper processes are not used: %s", self.slide.path, exc)
            self.decode_gpu(stored, level, slots, th, tw)
            return
        try:
            pending = helpers.start(
                self.slide.path,
                level,
                [(i, tx, ty) for i, (_, tx, ty) in enumerate(mine)],
                staging,
                reader=self.slide.backend,
                on_damage=self.slide.report_damage,
            )
            try:
                if rest:
                    self.decode_gpu(stored, level, rest, th, tw)
            finally:
                pending.wait()
            m = len(mine)
            decoded = torch.empty((m, th, tw, 3), dtype=torch.uint8, device=self.device)
            decoded.copy_(staging.tensor[:m], non_blocking=self.cuda)
            if self.cuda:
                staging.event = torch.cuda.Event()
                staging.event.record(torch.cuda.current_stream(self.device))
            stored[torch.tensor([slot for slot, _, _ in mine], device=self.device)] = decoded
        finally:
            helpers.release_staging(staging)
        self._count(helped=len(mine))
