"""GPU JPEG decoding of tile batches: stored JPEG tiles -> patches assembled on the device.

For a JPEG-tiled TIFF (:class:`~..slide.tiff_backend.TiffSlide`), a batch of
grid tiles is read as follows: the stored tiles covering the batch's
patches (a 512 px patch on a 448 px step over 256 px stored tiles touches up
to 3 x 3 of them; neighbouring patches share most) are fetched as
standalone JPEG streams (``raw_tile_jpeg``: pread + JPEGTables spliced in),
decoded ONCE each, laid out as one mosaic on the device, and every patch is
gathered from the mosaic in one indexing kernel: the overlap of neighbouring
patches is never decoded or copied twice, and the CPU does no per-patch work.

Two stored-tile decoders (``jpeg_decoder``):

``"nvjpeg"`` (default)
    one batched ``torchvision.io.decode_jpeg(list, device="cuda")`` call per
    batch. Pixels differ from libjpeg-turbo's by decoder rounding (on a
    synthetic pathology slide: mean 0.015 grey levels, max 18).
``"threads"``
    libjpeg-turbo (imagecodecs) in a thread pool, straight into a pinned
    staging buffer, then one H2D copy: the CPU reader's pixels exactly.

Measured on one H200 with 16 cores (docs/gpu.md): nvJPEG about 4,300 and
the threads about 2,500 patches/s alone; torchvision runs one nvJPEG call
at a time (a global lock), so more loader threads do not help it.

Pixels past the level's edge take the slide's background colour, as in the
CPU readers. Only grids that read a level as it is are supported (no
resize: ``tile.read_size == tile.size``), and only 3-sample JPEG levels.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, TileReadError
from .grid import Tile

try:
    import torch
    import torchvision.io
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc


@dataclass
class DeviceBatch:
    """A batch of tiles already on the device.

    ``images``: ``n x size x size x 3`` uint8 CUDA tensor (RGB); ``ready``:
    an event recorded after it was written (consumers on other streams wait
    on it); ``tiles``, ``sequence``: as in :class:`~..tiling.loader.Batch`.
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


def gpu_decode_refusal(slide: Any, tiles: Sequence[Tile]) -> str | None:
    """Why ``tiles`` of ``slide`` cannot be assembled on the GPU, or None when they can.

    GPU decoding needs the stored JPEG streams of a tiled TIFF (the tifffile
    reader), a grid that reads one level as it is (no resizing), and 3-sample
    interleaved YCbCr JPEG tiles: a standalone decoder takes 3-component
    JPEG for YCbCr, so tiles stored as RGB JPEG (Aperio's usual choice) stay
    on the CPU, whose decoder is told the colour space.
    """
    if not tiles:
        return "no tiles to read"
    levels = {t.level for t in tiles}
    if len(levels) != 1 or any(t.read_size != t.size for t in tiles):
        return "the grid resizes what it reads"
    level = levels.pop()
    fmt = slide.stored_tile_format(level)
    if fmt is None:
        return f"the {slide.backend} reader gives no stored tiles"
    if fmt["compression"] != "JPEG":
        return f"level {level} is stored as {fmt['compression']}, not JPEG"
    if fmt["samples_per_pixel"] != 3 or fmt["planar"] != 1 or fmt["extra_samples"]:
        return f"level {level} has {fmt['samples_per_pixel']} samples per pixel (expected 3, interleaved)"
    if fmt["photometric"] != "YCBCR":
        return f"level {level} holds {fmt['photometric']} JPEG (expected YCbCr)"
    return None


JPEG_DECODERS = ("threads", "nvjpeg")
_POOL_LOCK = threading.Lock()


class GpuTileDecoder:
    """Assemble batches of grid tiles of a JPEG-tiled :class:`TiffSlide` on a CUDA device.

    ``jpeg_decoder``: ``"nvjpeg"`` or ``"threads"`` (module docstring);
    ``threads``: CPU decoding threads for ``"threads"`` (default: cores - 2).
    Thread-safe: each calling thread gets its own staging buffer.
    """

    def __init__(
        self, slide: Any, device: str | torch.device = "cuda", jpeg_decoder: str = "nvjpeg", threads: int | None = None
    ):
        if jpeg_decoder not in JPEG_DECODERS:
            raise ConfigError(f"jpeg_decoder: expected one of {list(JPEG_DECODERS)}, found {jpeg_decoder!r}")
        self.jpeg_decoder = jpeg_decoder
        self.threads = int(threads or max(1, (os.cpu_count() or 2) - 2))
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        if slide.stored_tile_format(0) is None:
            raise ConfigError(
                f"{slide.path}: GPU decoding needs a tiled TIFF opened with the tifffile "
                f"reader, found the {slide.backend} reader"
            )
        self.slide = slide
        self.cpu_fallback_batches = 0  # batches nvJPEG refused, decoded by libjpeg-turbo instead
        self.device = torch.device(device)
        self.background = torch.tensor(list(slide.background_rgb), dtype=torch.uint8, device=self.device)

    def _check(self, tiles: Sequence[Tile]) -> int:
        level = tiles[0].level
        for t in tiles:
            if t.level != level or t.read_size != t.size:
                raise ConfigError(
                    f"{self.slide.path}: GPU decoding reads a level as it is; tile {t.index} "
                    f"needs level {t.level} resized {t.read_size}->{t.size} px"
                )
        return level

    def _fail(self, level: int, tx: int, ty: int, exc: Exception) -> TileReadError:
        return TileReadError(
            self.slide.path, f"cannot decode stored tile ({tx}, {ty}) of level {level}: {exc}", None, level
        )

    def _decode_nvjpeg(self, level: int, slots: list, m: int, th: int, tw: int) -> torch.Tensor:
        data, where, empty = [], [], []
        for slot, tx, ty in slots:
            raw = self.slide.raw_tile_jpeg(level, tx, ty)
            if raw:
                data.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                where.append(slot)
            else:
                empty.append(slot)
        stored = torch.empty((m, th, tw, 3), dtype=torch.uint8, device=self.device)
        if empty:
            stored[empty] = self.background
        if data:
            try:
                decoded = torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device=self.device)
            except RuntimeError:
                # nvJPEG refuses some streams (and damaged ones): libjpeg-turbo decodes the
                # batch instead and reports the tile that really cannot be decoded.
                self.cpu_fallback_batches += 1
                return self._decode_threads(level, slots, m, th, tw)
            for d in decoded:
                if d.shape != (3, th, tw):
                    raise TileReadError(
                        self.slide.path,
                        f"stored tile decoded to {list(d.shape)}, expected [3, {th}, {tw}]",
                        None,
                        level,
                    )
            stored[where] = torch.stack(decoded).permute(0, 2, 3, 1)
        return stored

    def _staging(self, m: int, th: int, tw: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """This thread's pinned staging buffer of at least ``m`` stored tiles (free to write)."""
        buf = getattr(self._local, "staging", None)
        event = getattr(self._local, "event", None)
        if event is not None:
            event.synchronize()  # the previous H2D copy out of it has finished
        cuda = self.device.type == "cuda"
        if buf is None or buf.shape[0] < m or tuple(buf.shape[1:]) != (th, tw, 3):
            buf = torch.empty((max(m, 64), th, tw, 3), dtype=torch.uint8, pin_memory=cuda)
            self._local.staging = buf
        if event is None and cuda:
            event = self._local.event = torch.cuda.Event()
        return buf, event

    def _decode_threads(self, level: int, slots: list, m: int, th: int, tw: int) -> torch.Tensor:
        import imagecodecs

        staging, event = self._staging(m, th, tw)
        host = staging.numpy()
        slide = self.slide
        background = tuple(slide.background_rgb)

        def run(chunk: list) -> None:
            for slot, tx, ty in chunk:
                raw = slide.raw_tile_jpeg(level, tx, ty)
                if not raw:
                    host[slot] = background
                    continue
                try:
                    imagecodecs.jpeg8_decode(raw, out=host[slot])
                except Exception as exc:  # imagecodecs raises its own error types
                    raise self._fail(level, tx, ty, exc) from exc

        if self._pool is None:
            with _POOL_LOCK:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="jpeg-decode")
        # Chunks rather than one task per tile: the per-tile Python work then
        # runs in the pool threads, which release the GIL while decoding.
        n_chunks = min(len(slots), self.threads)
        futures = [self._pool.submit(run, slots[i::n_chunks]) for i in range(n_chunks)]
        for f in futures:
            f.result()
        stored = torch.empty((m, th, tw, 3), dtype=torch.uint8, device=self.device)
        stored.copy_(staging[:m], non_blocking=event is not None)
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        return stored

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode(self, tiles: Sequence[Tile]) -> torch.Tensor:
        """The tiles' pixels: ``n x size x size x 3`` uint8 on the device (current stream)."""
        if not tiles:
            raise ConfigError("no tiles to decode")
        slide = self.slide
        level = self._check(tiles)
        tw, th, across, down = slide.tile_grid_shape(level)
        lw, lh = slide.level_dimensions[level]
        ds = slide.level_downsamples[level]
        size = tiles[0].size
        # Level-pixel origins, as the CPU reader computes them.
        xs0 = [int(math.floor(t.x0_level0 / ds)) for t in tiles]
        ys0 = [int(math.floor(t.y0_level0 / ds)) for t in tiles]
        px0, py0 = min(xs0), min(ys0)
        px1, py1 = max(xs0) + size, max(ys0) + size
        tx0, ty0 = max(px0, 0) // tw, max(py0, 0) // th
        tx1 = min(max(px1, 1) - 1, lw - 1) // tw
        ty1 = min(max(py1, 1) - 1, lh - 1) // th
        if tx0 > tx1 or ty0 > ty1 or px0 >= lw or py0 >= lh:  # wholly outside the level
            out = torch.empty((len(tiles), size, size, 3), dtype=torch.uint8, device=self.device)
            out[...] = self.background
            return out
        rows, cols = ty1 - ty0 + 1, tx1 - tx0 + 1
        slots = [((ty - ty0) * cols + (tx - tx0), tx, ty) for ty in range(ty0, ty1 + 1) for tx in range(tx0, tx1 + 1)]
        if self.jpeg_decoder == "nvjpeg":
            stored = self._decode_nvjpeg(level, slots, rows * cols, th, tw)
        else:
            stored = self._decode_threads(level, slots, rows * cols, th, tw)
        # Mosaic of the stored tiles, in level pixels from (tx0*tw, ty0*th).
        mosaic = stored.view(rows, cols, th, tw, 3).permute(0, 2, 1, 3, 4).reshape(rows * th, cols * tw, 3)
        mx0, my0 = tx0 * tw, ty0 * th
        # Everything the patches touch, background outside the level.
        canvas_w, canvas_h = px1 - px0, py1 - py0
        canvas = torch.empty((canvas_h, canvas_w, 3), dtype=torch.uint8, device=self.device)
        canvas[...] = self.background
        sx0, sy0 = max(px0, mx0), max(py0, my0)
        sx1, sy1 = min(px1, mx0 + cols * tw, lw), min(py1, my0 + rows * th, lh)
        if sx0 < sx1 and sy0 < sy1:
            canvas[sy0 - py0 : sy1 - py0, sx0 - px0 : sx1 - px0] = mosaic[sy0 - my0 : sy1 - my0, sx0 - mx0 : sx1 - mx0]
        ar = torch.arange(size, device=self.device)
        yy = (torch.tensor(ys0, device=self.device) - py0)[:, None] + ar[None, :]
        xx = (torch.tensor(xs0, device=self.device) - px0)[:, None] + ar[None, :]
        return canvas[yy[:, :, None], xx[:, None, :]]


class GpuTileLoader:
    """Yield :class:`DeviceBatch` es of ``tiles`` decoded on the GPU, in grid order.

    ``decode_threads`` batches are assembled at once, each thread on its own
    CUDA stream (``jpeg_decoder``, ``jpeg_threads``: see :class:`GpuTileDecoder`);
    ``prefetch`` batches are decoded ahead of the consumer
    (device memory: about ``(prefetch + 2) * batch_size`` tiles plus the
    stored-tile mosaics). Errors stop the loader and are raised from the
    iteration; breaking out of the loop shuts the threads down.
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
    ):
        if batch_size < 1 or prefetch < 1 or decode_threads < 1:
            raise ValueError("batch_size, prefetch and decode_threads must be at least 1")
        self.decoder = GpuTileDecoder(slide, device, jpeg_decoder=jpeg_decoder, threads=jpeg_threads)
        self.tiles = list(tiles)
        if self.tiles:
            self.decoder._check(self.tiles)
        self.batch_size = int(batch_size)
        self.prefetch = int(prefetch)
        self.decode_threads = int(decode_threads)
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def n_batches(self) -> int:
        return (len(self.tiles) + self.batch_size - 1) // self.batch_size

    def _decode_batch(self, seq: int, tiles: list[Tile]) -> DeviceBatch:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.decoder.device)
        with torch.cuda.stream(stream):
            images = self.decoder.decode(tiles)
            ready = torch.cuda.Event()
            ready.record(stream)
        return DeviceBatch(images, tiles, seq, ready)

    def __iter__(self) -> Iterator[DeviceBatch]:
        self._pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="gpu-decode")
        pending: deque[Future] = deque()
        starts = iter(enumerate(range(0, len(self.tiles), self.batch_size)))

        def submit() -> None:
            item = next(starts, None)
            if item is not None:
                seq, start = item
                pending.append(self._pool.submit(self._decode_batch, seq, self.tiles[start : start + self.batch_size]))

        try:
            for _ in range(self.prefetch):
                submit()
            while pending:
                batch = pending.popleft().result()  # raises the batch's error
                submit()
                yield batch
        finally:
            pool, self._pool = self._pool, None
            pool.shutdown(wait=True, cancel_futures=True)
            self.decoder.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.decoder.close()

    def __enter__(self) -> GpuTileLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
