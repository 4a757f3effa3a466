"""GPU JPEG decoding of tile batches: stored JPEG tiles -> patches assembled on the device.

For a JPEG-tiled TIFF (:class:`~..slide.tiff_backend.TiffSlide`), a batch of
grid tiles is read as follows: the stored tiles its patches touch (a 512 px
patch on a 448 px step over 256 px stored tiles touches up to 3 x 3 of them;
neighbouring patches share most; :func:`stored_tiles_touched`) are fetched
as standalone JPEG streams (``raw_tile_jpeg``: pread + JPEGTables spliced
in), decoded ONCE each, laid out as one mosaic on the device, and every
patch is gathered from the mosaic in one indexing kernel: the overlap of
neighbouring patches is never decoded or copied twice, and the CPU does no
per-patch work. Only the stored tiles some patch touches are decoded, not
the whole bounding box of the batch (the other mosaic slots are never read).

:class:`GpuTileLoader` decodes each stored tile once per slide where it
can: batches in grid order share stored tile rows, and a batch copies the
stored tiles it shares with the previous batch from that batch's mosaic on
the device instead of decoding them again (the previous mosaic is handed
over in sequence order; only one is held at a time).

Two stored-tile decoders (``jpeg_decoder``):

``"nvjpeg"`` (default)
    one batched nvJPEG call per batch (torchvision's, :func:`nvjpeg_decode`).
    Pixels differ from libjpeg-turbo's by decoder rounding (on a synthetic
    pathology slide: mean 0.015 grey levels, max 18).
``"threads"``
    libjpeg-turbo (imagecodecs) in a thread pool, straight into a pinned
    staging buffer, then one H2D copy: the CPU reader's pixels exactly.

With ``"nvjpeg"`` and :class:`~.jpeg_processes.JpegHelpers` (``helpers``), helper
processes decode a fixed share (``helpers.tile_share``) of each batch's
stored tiles with libjpeg-turbo while nvJPEG decodes the rest
(:mod:`.jpeg_processes`; a pipeline on CUDA starts them).

Measured on one H200 with 16 cores (docs/gpu.md): nvJPEG about 4,300 and
the threads about 2,500 patches/s alone; torchvision runs one nvJPEG call
at a time (a global lock), so more loader threads do not help it.

Pixels past the level's edge are the image reflected, as the CPU path fills
them (:func:`~.grid.fill_past_edge`). Only grids that read a level as it is are supported (no
resize: ``tile.read_size == tile.size``), and only 3-sample JPEG levels.
On a CPU device (``device="cpu"``, for tests) the same code runs without
CUDA streams or events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, TileReadError
from .grid import Tile, reflect_index
from .jpeg_processes import JpegHelpers, cpu_share_tile
from .resample import resample_patches

log = logging.getLogger(__name__)

try:
    import torch
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc

# torchvision.io.ImageReadMode.RGB.value, the mode argument of torchvision's decoding ops.
_READ_MODE_RGB = 3
# The arguments of the two ops this module calls, as torchvision's image extension declares them.
_OP_ARGUMENTS = {"decode_jpegs_cuda": ["List[Tensor]", "int", "Device"], "decode_jpeg": ["Tensor", "int", "bool"]}


def _image_ops_loaded() -> bool:
    try:
        return all(
            [str(a.type) for a in getattr(torch.ops.image, name).default._schema.arguments] == args
            for name, args in _OP_ARGUMENTS.items()
        )
    except (AttributeError, RuntimeError):
        return False


def _load_image_extension() -> bool:
    """Load torchvision's image extension (its JPEG decoding ops) without importing torchvision.

    Importing torchvision runs its package's ``__init__``, which imports its models and, through
    ``torchvision.ops``, ``torch._dynamo``: 3.1 s on a 2-core machine and 6.6 s on the GPU machine
    (BENCHMARKS.md), in every process that decodes on the GPU; a batch's first slide waited for
    it. The decoder is one op of that extension, so the extension is loaded on its own, the way
    torchvision's ``io`` loads it. True when its ops are there with the arguments this module
    passes; False (nothing raised) where it cannot be found or differs.
    """
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    if not _image_ops_loaded():
        names = [
            f"{lib}{suffix}" for lib in ("image_stable", "image") for suffix in importlib.machinery.EXTENSION_SUFFIXES
        ]
        found = [
            p
            for folder in spec.submodule_search_locations
            for n in names
            if os.path.isfile(p := os.path.join(folder, n))
        ]
        for path in found:
            try:
                torch.ops.load_library(path)
            except OSError:
                continue
            if _image_ops_loaded():
                break
    return _image_ops_loaded()


if not _load_image_extension():
    try:
        import torchvision.io  # noqa: F401  (loads the extension the usual way)
    except ImportError as exc:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc


def nvjpeg_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode JPEG streams to RGB: ``torchvision.io.decode_jpeg(data, mode=RGB, device=device)``.

    ``data``: 1-D uint8 CPU tensors, one stream each. Returns ``3 x h x w`` uint8 tensors on
    ``device``: one batched nvJPEG call on CUDA (torchvision runs one such call at a time), the
    CPU decoder per stream otherwise. Raises RuntimeError for a stream it cannot decode.
    """
    if device.type == "cuda":
        return torch.ops.image.decode_jpegs_cuda(data, _READ_MODE_RGB, device)
    return [torch.ops.image.decode_jpeg(d, _READ_MODE_RGB, False) for d in data]


# The stored tiles :func:`warm_up_nvjpeg` decodes, and their size: the usual stored tile of a slide,
# in a number like a loader batch's share for nvJPEG.
WARM_UP_TILES = 256
WARM_UP_TILE_PX = 256


def warm_up_nvjpeg(
    device: torch.device | str = "cuda", tiles: int = WARM_UP_TILES, tile_px: int = WARM_UP_TILE_PX
) -> float:
    """Decode ``tiles`` JPEG streams of ``tile_px`` square with nvJPEG once, on the loaders' first
    stream, and wait for them; returns the seconds it took (on a CPU ``device``, for tests, the
    CPU decoder runs instead).

    nvJPEG sets itself up on a process's first calls (its decoder, its host and device buffers,
    the loading of its kernels): a process's first run spent 0.98 s in nvJPEG calls against 0.22 s
    for the next run of the same slide (BENCHMARKS.md). A pipeline on CUDA calls this on a thread
    while its model loads, so that its first slide does not wait for that set-up.
    """
    import simplejpeg

    device = torch.device(device)
    rng = np.random.default_rng(0)
    # Smooth noise: JPEG streams of about a slide tile's size and entropy.
    noise = rng.integers(0, 256, (tile_px // 8, tile_px // 8, 3), dtype=np.uint8)
    image = np.ascontiguousarray(np.repeat(np.repeat(noise, 8, axis=0), 8, axis=1))
    stream = np.frombuffer(bytearray(simplejpeg.encode_jpeg(image, quality=90, colorspace="RGB")), np.uint8)
    data = [torch.from_numpy(stream)] * int(tiles)
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    with torch.cuda.stream(_decode_stream(device, 0)) if cuda else contextlib.nullcontext():
        decoded = nvjpeg_decode(data, device)
        if cuda:
            torch.cuda.current_stream(device).synchronize()
    if len(decoded) != len(data) or decoded[0].shape != (3, tile_px, tile_px):
        raise RuntimeError(f"nvJPEG's warm-up decoded {len(decoded)} of {len(data)} tiles")
    return time.perf_counter() - t0


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


def gpu_decode_plan(slide: Any, tiles: Sequence[Tile]) -> tuple[str | None, str]:
    """Which GPU decoder assembles ``tiles`` of ``slide`` (``"nvjpeg"``, ``"nvimgcodec"``), and
    why; ``(None, reason)`` where they cannot be assembled on the GPU.

    GPU decoding needs a reader's stored JPEG streams (:meth:`Slide.raw_tiles_jpeg`: the tifffile
    reader's TIFF and SVS levels), a grid that reads one level (resampled on the device where the
    grid's resolution is not a stored level's), and the storage
    :func:`~.slide_loader.storage_gpu_decoder` takes, with its decoder installed.
    """
    from .slide_loader import storage_gpu_decoder

    if not tiles:
        return None, "no tiles to read"
    levels = {t.level for t in tiles}
    if len(levels) != 1 or len({t.read_size for t in tiles}) != 1:
        return None, "the grid's tiles are read from more than one level or size"
    level = levels.pop()
    decoder, why = storage_gpu_decoder(slide.stored_tile_format(level), slide.backend, level)
    if decoder == "nvjpeg" and not _image_ops_loaded():
        return None, "this torchvision has no JPEG decoding ops with the expected arguments"
    if decoder == "nvimgcodec" and nvimgcodec_module() is None:
        return None, f"{why}, which is not installed (pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg)"
    if decoder is not None and tiles[0].read_size != tiles[0].size:
        why += f", {tiles[0].read_size} px of level {level} resampled to {tiles[0].size} px on the device"
    return decoder, why


def gpu_decode_refusal(slide: Any, tiles: Sequence[Tile]) -> str | None:
    """Why ``tiles`` of ``slide`` cannot be assembled on the GPU (:func:`gpu_decode_plan`), or None."""
    decoder, why = gpu_decode_plan(slide, tiles)
    return why if decoder is None else None


_NVIMGCODEC: list[Any] = []
_NVIMGCODEC_LOCK = threading.Lock()


def nvimgcodec_module() -> Any:
    """``nvidia.nvimgcodec`` where it is installed and loads, else None (looked up once)."""
    with _NVIMGCODEC_LOCK:
        if not _NVIMGCODEC:
            try:
                from nvidia import nvimgcodec
            except Exception:  # not installed, or its libraries do not load
                nvimgcodec = None
            _NVIMGCODEC.append(nvimgcodec)
        return _NVIMGCODEC[0]


# Idle nvImageCodec decoders per device: a decoder serves one call at a time (concurrent calls on one
# decoder broke its internal state on the GPU machine), and making one costs set-up, so loader
# threads take one from here and give it back, from run to run.
_NVIMGCODEC_IDLE: dict[int, list[Any]] = {}


def nvimgcodec_decode(data: list[bytes], device: torch.device, stream: Any) -> tuple[list[torch.Tensor], Any]:
    """Decode RGB JPEG streams (no colour transform) with nvImageCodec, converting nothing.

    ``data``: one ``bytes`` per stream (nvImageCodec reads a buffer from its start: views into a
    larger array are not streams to it); ``stream``: the CUDA stream the decoding is ordered on.
    Returns ``h x w x 3`` uint8 tensors on ``device`` (views of nvImageCodec's images) and the
    images themselves, to be kept alive until the work reading the tensors is done. The hardware
    JPEG engines are tried first, then the hybrid CPU-GPU decoder (nvImageCodec picks per stream;
    its GPU-only decoder could not be made on the GPU machine). Raises RuntimeError for a stream it
    cannot decode.
    """
    nv = nvimgcodec_module()
    if nv is None:
        raise ConfigError("jpeg_decoder 'nvimgcodec': nvidia-nvimgcodec is not installed")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _NVIMGCODEC_LOCK:
        idle = _NVIMGCODEC_IDLE.setdefault(index, [])
        decoder = idle.pop() if idle else None
    if decoder is None:
        backends = [nv.Backend(nv.BackendKind.HW_GPU_ONLY), nv.Backend(nv.BackendKind.HYBRID_CPU_GPU)]
        decoder = nv.Decoder(device_id=index, backends=backends)
    try:
        # SYCC: the components as stored. An RGB stream's are R, G, B; the default (sRGB) would
        # convert them from YCbCr.
        params = nv.DecodeParams(color_spec=nv.ColorSpec.SYCC)
        images = decoder.decode(data, params=params, cuda_stream=stream.cuda_stream)
    finally:
        with _NVIMGCODEC_LOCK:
            _NVIMGCODEC_IDLE[index].append(decoder)
    failed = sum(im is None for im in images)
    if failed:
        raise RuntimeError(f"nvImageCodec could not decode {failed} of {len(images)} streams")
    return [torch.as_tensor(im, device=device) for im in images], images


def stored_tiles_touched(
    xs0: Iterable[int], ys0: Iterable[int], size: int, tile_w: int, tile_h: int, level_w: int, level_h: int
) -> list[tuple[int, int]]:
    """The stored tiles ``(tx, ty)`` that patches touch, row-major, clipped to the level.

    ``xs0``, ``ys0``: the patches' level-pixel origins; ``size``: their side
    in pixels; ``tile_w``, ``tile_h``: the stored tiles'; ``level_w``,
    ``level_h``: the level's. A patch wholly past the level's edge touches none.
    """
    x0, y0 = np.asarray(list(xs0), np.int64), np.asarray(list(ys0), np.int64)
    if x0.shape != y0.shape:
        raise ValueError(f"expected as many x as y origins, found {x0.shape[0]} and {y0.shape[0]}")
    x1, y1 = np.minimum(x0 + size, level_w), np.minimum(y0 + size, level_h)
    x0, y0 = np.maximum(x0, 0), np.maximum(y0, 0)
    inside = (x0 < x1) & (y0 < y1)
    if not inside.any():
        return []
    tx0, tx1 = x0[inside] // tile_w, (x1[inside] - 1) // tile_w  # inclusive stored-tile ranges
    ty0, ty1 = y0[inside] // tile_h, (y1[inside] - 1) // tile_h
    # Mark each patch's rectangle of stored tiles on a grid around them, one offset at a time
    # (a patch spans a few stored tiles per axis); the grid's nonzero cells come out row-major.
    ox, oy = int(tx0.min()), int(ty0.min())
    touched = np.zeros((int(ty1.max()) - oy + 1, int(tx1.max()) - ox + 1), bool)
    for dy in range(int((ty1 - ty0).max()) + 1):
        for dx in range(int((tx1 - tx0).max()) + 1):
            ok = (ty0 + dy <= ty1) & (tx0 + dx <= tx1)
            touched[ty0[ok] + dy - oy, tx0[ok] + dx - ox] = True
    ty, tx = np.nonzero(touched)
    return list(zip((tx + ox).tolist(), (ty + oy).tolist(), strict=True))


@dataclass
class StoredTiles:
    """A batch's decoded stored tiles, which the next batch copies from.

    ``pixels``: ``slots x tile_h x tile_w x 3`` uint8 on the device;
    ``slots``: ``(tx, ty) -> slot`` of the tiles it holds (other slots are
    uninitialised); ``ready``: an event recorded after they were written
    (None on a CPU device).
    """

    level: int
    pixels: Any
    slots: dict[tuple[int, int], int]
    ready: Any = None


JPEG_DECODERS = ("threads", "nvjpeg", "nvimgcodec")
_POOL_LOCK = threading.Lock()


class GpuTileDecoder:
    """Assemble batches of grid tiles of a JPEG-tiled :class:`TiffSlide` on a CUDA device.

    ``jpeg_decoder``: ``"nvjpeg"`` or ``"threads"`` (module docstring);
    ``threads``: CPU decoding threads for ``"threads"`` (default: cores - 2).
    Thread-safe: each calling thread gets its own staging buffer.
    Counters (thread-safe, for a run's record): ``stored_tiles_decoded``
    (stored tiles read and decoded), ``stored_tiles_reused`` (copied from the
    previous batch instead), ``cpu_fallback_batches`` (batches nvJPEG
    refused, decoded by libjpeg-turbo instead).
    """

    def __init__(
        self,
        slide: Any,
        device: str | torch.device = "cuda",
        jpeg_decoder: str = "nvjpeg",
        threads: int | None = None,
        helpers: JpegHelpers | None = None,
    ):
        if jpeg_decoder not in JPEG_DECODERS:
            raise ConfigError(f"jpeg_decoder: expected one of {list(JPEG_DECODERS)}, found {jpeg_decoder!r}")
        if jpeg_decoder == "nvjpeg" and not _image_ops_loaded():
            raise ConfigError(
                "jpeg_decoder 'nvjpeg': this torchvision has no JPEG decoding ops with the expected arguments"
            )
        if jpeg_decoder == "nvimgcodec" and nvimgcodec_module() is None:
            raise ConfigError("jpeg_decoder 'nvimgcodec': nvidia-nvimgcodec is not installed or does not load")
        self.jpeg_decoder = jpeg_decoder
        self.threads = int(threads or max(1, (os.cpu_count() or 2) - 2))
        # With a GPU decoder: helper processes decode helpers.tile_share / SHARE_PERIOD of the stored tiles.
        self.helpers = helpers if helpers is not None and helpers.tile_share else None
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        if slide.stored_tile_format(0) is None:
            raise ConfigError(
                f"{slide.path}: GPU decoding needs a tiled TIFF opened with the tifffile "
                f"reader, found the {slide.backend} reader"
            )
        self.slide = slide
        self._counts_lock = threading.Lock()
        self.cpu_fallback_batches = 0
        self.stored_tiles_decoded = 0
        self.stored_tiles_by_helpers = 0
        self._warned_staging = False
        self.stored_tiles_reused = 0
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.background = torch.tensor(list(slide.background_rgb), dtype=torch.uint8, device=self.device)

    def _count(self, decoded: int = 0, reused: int = 0, fallback: int = 0, helped: int = 0) -> None:
        with self._counts_lock:
            self.stored_tiles_by_helpers += helped
            self.stored_tiles_decoded += decoded
            self.stored_tiles_reused += reused
            self.cpu_fallback_batches += fallback

    def _check(self, tiles: Sequence[Tile]) -> int:
        level, read_size, size = tiles[0].level, tiles[0].read_size, tiles[0].size
        for t in tiles:
            if t.level != level or t.read_size != read_size or t.size != size:
                raise ConfigError(
                    f"{self.slide.path}: GPU decoding reads one level at one size; tile {t.index} "
                    f"reads {t.read_size} px of level {t.level}, tile {tiles[0].index} {read_size} px of level {level}"
                )
        return level

    def _origins(self, tiles: Sequence[Tile], level: int) -> tuple[list[int], list[int]]:
        """The tiles' level-pixel origins, as the CPU reader computes them."""
        ds = self.slide.level_downsamples[level]
        return [int(math.floor(t.x0_level0 / ds)) for t in tiles], [int(math.floor(t.y0_level0 / ds)) for t in tiles]

    def stored_tiles(self, tiles: Sequence[Tile]) -> list[tuple[int, int]]:
        """The stored tiles ``(tx, ty)`` that ``tiles`` touch (:func:`stored_tiles_touched`)."""
        if not tiles:
            return []
        level = self._check(tiles)
        tw, th, _, _ = self.slide.tile_grid_shape(level)
        lw, lh = self.slide.level_dimensions[level]
        return stored_tiles_touched(*self._origins(tiles, level), tiles[0].read_size, tw, th, lw, lh)

    def _fail(self, level: int, tx: int, ty: int, exc: Exception) -> TileReadError:
        return TileReadError(
            self.slide.path, f"cannot decode stored tile ({tx}, {ty}) of level {level}: {exc}", None, level
        )

    def _decode_gpu(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
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
                self._decode_threads(stored, level, slots, th, tw)
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
        and the call goes on (BENCHMARKS.md, 2026-12-04 03:2x–04:2x).
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

    def _decode_threads(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
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

    def _decode_shared(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        """Decode ``slots``: the helper processes their share (:func:`cpu_share_tile`) into a shared
        staging buffer, then one copy to the device; nvJPEG the rest, at the same time."""
        helpers = self.helpers
        assert helpers is not None
        mine, rest = [], []
        for s in slots:
            (mine if cpu_share_tile(s[1], s[2], helpers.tile_share) else rest).append(s)
        if not mine:
            self._decode_gpu(stored, level, slots, th, tw)
            return
        try:
            staging = helpers.acquire_staging(len(mine), th, tw, self.cuda)
        except OSError as exc:  # no room for the shared buffer: nvJPEG decodes the whole batch
            if not self._warned_staging:
                self._warned_staging = True
                log.warning("%s: the JPEG helper processes are not used: %s", self.slide.path, exc)
            self._decode_gpu(stored, level, slots, th, tw)
            return
        try:
            pending = helpers.start(
                self.slide.path,
                level,
                [(i, tx, ty) for i, (_, tx, ty) in enumerate(mine)],
                staging,
                reader=self.slide.backend,
            )
            try:
                if rest:
                    self._decode_gpu(stored, level, rest, th, tw)
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

    def _decode_into(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        """Decode the stored tiles ``slots`` (``(slot, tx, ty)``) into their slots of ``stored``."""
        if not slots:
            return
        if self.jpeg_decoder == "threads":
            self._decode_threads(stored, level, slots, th, tw)
        elif self.helpers is not None:
            self._decode_shared(stored, level, slots, th, tw)
        else:
            self._decode_gpu(stored, level, slots, th, tw)
        self._count(decoded=len(slots))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode(self, tiles: Sequence[Tile]) -> torch.Tensor:
        """The tiles' pixels: ``n x size x size x 3`` uint8 on the device (current stream).

        Decodes every stored tile the tiles touch (nothing is reused). Tiles whose ``read_size``
        differs from their ``size`` are read at ``read_size`` and resampled on the device
        (:func:`.resample.resample_patches`, the CPU reader's ``cv2.INTER_AREA``).
        """
        return self.decode_after(tiles)[0]

    def decode_after(
        self,
        tiles: Sequence[Tile],
        previous_tiles: Sequence[Tile] = (),
        take_previous: Callable[[], StoredTiles | None] | None = None,
    ) -> tuple[torch.Tensor, StoredTiles | None]:
        """:meth:`decode`, copying the stored tiles shared with the previous batch from its mosaic.

        ``previous_tiles``: the previous batch's tiles (same level);
        ``take_previous``: gives its :class:`StoredTiles` (waiting for them),
        None where there are none (it failed): the shared stored tiles are
        then decoded too. The stored tiles this batch alone needs are
        decoded before ``take_previous`` is called, which is called even
        when nothing is shared (a loader's batches then finish in order).
        Returns the pixels and this batch's :class:`StoredTiles` (None when
        no stored tile is touched).
        """
        if not tiles:
            raise ConfigError("no tiles to decode")
        slide = self.slide
        level = self._check(tiles)
        tw, th, _, _ = slide.tile_grid_shape(level)
        lw, lh = slide.level_dimensions[level]
        size, out_size = tiles[0].read_size, tiles[0].size
        xs0, ys0 = self._origins(tiles, level)
        needed = stored_tiles_touched(xs0, ys0, size, tw, th, lw, lh)
        if not needed:  # wholly outside the level
            out = torch.empty((len(tiles), out_size, out_size, 3), dtype=torch.uint8, device=self.device)
            out[...] = self.background
            return out, None
        tx0, tx1 = min(tx for tx, _ in needed), max(tx for tx, _ in needed)
        ty0, ty1 = needed[0][1], needed[-1][1]
        rows, cols = ty1 - ty0 + 1, tx1 - tx0 + 1
        slots = {(tx, ty): (ty - ty0) * cols + (tx - tx0) for tx, ty in needed}
        previous = set(self.stored_tiles(previous_tiles)) if previous_tiles else set()
        shared = [c for c in needed if c in previous]
        # Slots no patch touches stay uninitialised: no patch pixel inside the
        # level lies in them, and the canvas below masks everything outside it.
        stored = torch.empty((rows * cols, th, tw, 3), dtype=torch.uint8, device=self.device)
        self._decode_into(stored, level, [(slots[c], *c) for c in needed if c not in previous], th, tw)
        # Always taken (even when nothing is shared), so that batches publish in sequence order.
        prev = take_previous() if take_previous is not None else None
        if prev is not None and prev.level == level:
            copy = [(slots[c], prev.slots[c]) for c in shared if c in prev.slots]
            if copy:
                if prev.ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(prev.ready)
                dst = torch.tensor([d for d, _ in copy], device=self.device)
                src = torch.tensor([s for _, s in copy], device=self.device)
                stored[dst] = prev.pixels[src]
                if self.cuda:  # read on this stream: not to be reused before the copy is done
                    prev.pixels.record_stream(torch.cuda.current_stream(self.device))
                self._count(reused=len(copy))
            shared = [c for c in shared if c not in prev.slots]
        del prev
        self._decode_into(stored, level, [(slots[c], *c) for c in shared], th, tw)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        kept = StoredTiles(level, stored, slots, ready)
        # Mosaic of the stored tiles, in level pixels from (tx0*tw, ty0*th).
        mosaic = stored.view(rows, cols, th, tw, 3).permute(0, 2, 1, 3, 4).reshape(rows * th, cols * tw, 3)
        mx0, my0 = tx0 * tw, ty0 * th
        # Everything the patches touch, background outside the level.
        px0, py0 = min(xs0), min(ys0)
        px1, py1 = max(xs0) + size, max(ys0) + size
        canvas = torch.empty((py1 - py0, px1 - px0, 3), dtype=torch.uint8, device=self.device)
        canvas[...] = self.background
        sx0, sy0 = max(px0, mx0), max(py0, my0)
        sx1, sy1 = min(px1, mx0 + cols * tw, lw), min(py1, my0 + rows * th, lh)
        if sx0 < sx1 and sy0 < sy1:
            canvas[sy0 - py0 : sy1 - py0, sx0 - px0 : sx1 - px0] = mosaic[sy0 - my0 : sy1 - my0, sx0 - mx0 : sx1 - mx0]
        if py1 > lh or px1 > lw:  # past the level's edge: the image reflected, as the CPU reader fills it
            at_y = np.clip(reflect_index(np.arange(py0, py1), lh) - py0, 0, None)
            at_x = np.clip(reflect_index(np.arange(px0, px1), lw) - px0, 0, None)
            canvas = canvas[torch.from_numpy(at_y).to(self.device)][:, torch.from_numpy(at_x).to(self.device)]
        offsets_x = [x - px0 for x in xs0]
        offsets_y = [y - py0 for y in ys0]
        if size != out_size:
            return resample_patches(canvas, offsets_x, offsets_y, size, out_size), kept
        ar = torch.arange(size, device=self.device)
        yy = torch.tensor(offsets_y, device=self.device)[:, None] + ar[None, :]
        xx = torch.tensor(offsets_x, device=self.device)[:, None] + ar[None, :]
        return canvas[yy[:, :, None], xx[:, None, :]], kept


class _HandOff:
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


_STREAMS: dict[tuple[str, int], Any] = {}
_STREAMS_LOCK = threading.Lock()


def _decode_stream(device: torch.device, slot: int) -> Any:
    """The process's CUDA stream number ``slot`` for GPU loaders on ``device``, made on first use."""
    with _STREAMS_LOCK:
        key = (str(device), slot)
        stream = _STREAMS.get(key)
        if stream is None:
            stream = _STREAMS[key] = torch.cuda.Stream(device)
        return stream


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
        self._handoff: _HandOff | None = None

    @property
    def n_batches(self) -> int:
        return (len(self.tiles) + self.batch_size - 1) // self.batch_size

    def _stream(self) -> Any:
        """This thread's CUDA stream (a null context on a CPU device).

        The loader's threads are the run's, but their streams are the process's
        (:func:`_decode_stream`): blocks the caching allocator holds for a stream are reused only
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
            stream = self._local.stream = _decode_stream(self.decoder.device, slot)
        return torch.cuda.stream(stream)

    def _decode_batch(self, seq: int, start: int, handoff: _HandOff) -> DeviceBatch:
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
        handoff = self._handoff = _HandOff()
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
