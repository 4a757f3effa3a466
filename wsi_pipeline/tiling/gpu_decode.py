"""GPU JPEG decoding of tile batches: stored JPEG tiles -> patches assembled on the device.

For a JPEG-tiled TIFF (:class:`~..slide.tiff_backend.TiffSlide`), a batch of
grid tiles is read as follows: the stored tiles its patches touch (a 512 px
patch on a 448 px step over 256 px stored tiles touches up to 3 x 3 of them;
neighbouring patches share most; :func:`~.mosaic.stored_tiles_touched`) are fetched
as standalone JPEG streams (``raw_tile_jpeg``: pread + JPEGTables spliced
in), decoded ONCE each, laid out as one mosaic on the device, and every
patch is gathered from the mosaic in one indexing kernel: the overlap of
neighbouring patches is never decoded or copied twice, and the CPU does no
per-patch work. Only the stored tiles some patch touches are decoded, not
the whole bounding box of the batch (the other mosaic slots are never read).

:class:`GpuTileDecoder` assembles one batch; :class:`~.gpu_loader.GpuTileLoader`
runs it over a slide's tiles, handing each batch's mosaic to the next. The
stored tiles are decoded into the mosaic by :mod:`.stored_tile_decoding`, by the kinds below; the
decoder calls themselves (nvJPEG, nvImageCodec, warm-up) are :mod:`.gpu_codecs`.

Three stored-tile decoders (``jpeg_decoder``), chosen by the level's JPEG kind
(:func:`gpu_decode_plan`):

``"nvjpeg"``
    one batched nvJPEG call per batch (torchvision's, :func:`~.gpu_codecs.nvjpeg_decode`),
    for YCbCr JPEG. Pixels differ from libjpeg-turbo's by decoder rounding and, for
    chroma-subsampled JPEG, by its chroma upsampling (BENCHMARKS.md, "Storage kinds").
``"nvimgcodec"``
    nvImageCodec told to convert nothing (:func:`~.gpu_codecs.nvimgcodec_decode`), for RGB JPEG.
``"threads"``
    the slide reader's own decoding in a thread pool, straight into a pinned
    staging buffer, then one H2D copy: the CPU reader's pixels exactly.

With a GPU decoder and :class:`~.jpeg_processes.JpegHelpers` (``helpers``), helper
processes decode a fixed share (``helpers.tile_share``) of each batch's
stored tiles with libjpeg-turbo while nvJPEG decodes the rest
(:mod:`.jpeg_processes`; a pipeline on CUDA starts them).

Measured on one H200 with 16 cores (docs/gpu.md): nvJPEG about 4,300 and
the threads about 2,500 patches/s alone; torchvision runs one nvJPEG call
at a time (a global lock), so more loader threads do not help it.

Pixels past the level's edge are the image reflected, as the CPU path fills
them (:func:`~.grid.fill_past_edge`). Grids that read a level as it is, and
grids resampled from a finer level (:mod:`.resample`, as ``read_tile``
resizes) where a patch's region is read whole on the CPU too (``grid.reads_whole``: larger ones
are left to the CPU reader, which reads them a band at a time); only 3-sample JPEG levels.
On a CPU device (``device="cpu"``, for tests) the same code runs without
CUDA streams or events.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from .gpu_choice import storage_gpu_decoder
from .gpu_codecs import image_ops_loaded, nvimgcodec_module
from .grid import Tile, reads_whole, reflect_index
from .jpeg_processes import JpegHelpers
from .mosaic import MosaicLayout, mosaic_layout, stored_tiles_touched
from .resample import resample_patches
from .stored_tile_decoding import StoredTileDecoding

try:
    import torch
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc

log = logging.getLogger(__name__)


def gpu_decode_plan(slide: Any, tiles: Sequence[Tile]) -> tuple[str | None, str]:
    """Which GPU decoder assembles ``tiles`` of ``slide`` (``"nvjpeg"``, ``"nvimgcodec"``), and
    why; ``(None, reason)`` where they cannot be assembled on the GPU.

    GPU decoding needs a reader's stored JPEG streams (:meth:`Slide.raw_tiles_jpeg`: the tifffile
    reader's TIFF and SVS levels), a grid that reads one level (resampled on the device where the
    grid's resolution is not a stored level's), and the storage
    :func:`~.gpu_choice.storage_gpu_decoder` takes, with its decoder installed.
    """
    if not tiles:
        return None, "no tiles to read"
    levels = {t.level for t in tiles}
    if len(levels) != 1 or len({t.read_size for t in tiles}) != 1:
        return None, "the grid's tiles are read from more than one level or size"
    level = levels.pop()
    if not reads_whole(tiles[0]):
        # The device gathers a patch's whole region before shrinking it; the CPU reads it in bands.
        return None, (
            f"a tile reads {tiles[0].read_size} px of level {level} for {tiles[0].size} px, too large to "
            "gather whole on the device (the CPU reader shrinks it a band at a time)"
        )
    decoder, why = storage_gpu_decoder(slide.stored_tile_format(level), slide.backend, level)
    if decoder == "nvjpeg" and not image_ops_loaded():
        return None, "this torchvision has no JPEG decoding ops with the expected arguments"
    if decoder == "nvimgcodec" and nvimgcodec_module() is None:
        return None, f"{why}, which is not installed (pip install 'wsi-pipeline[gpu]')"
    if decoder is not None and tiles[0].read_size != tiles[0].size:
        why += f", {tiles[0].read_size} px of level {level} resampled to {tiles[0].size} px on the device"
    return decoder, why


def gpu_decode_refusal(slide: Any, tiles: Sequence[Tile]) -> str | None:
    """Why ``tiles`` of ``slide`` cannot be assembled on the GPU (:func:`gpu_decode_plan`), or None."""
    decoder, why = gpu_decode_plan(slide, tiles)
    return why if decoder is None else None


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
        if jpeg_decoder == "nvjpeg" and not image_ops_loaded():
            raise ConfigError(
                "jpeg_decoder 'nvjpeg': this torchvision has no JPEG decoding ops with the expected arguments"
            )
        if jpeg_decoder == "nvimgcodec" and nvimgcodec_module() is None:
            raise ConfigError("jpeg_decoder 'nvimgcodec': nvidia-nvimgcodec is not installed or does not load")
        self.jpeg_decoder = jpeg_decoder
        self.threads = int(threads or max(1, (os.cpu_count() or 2) - 2))
        # With a GPU decoder: helper processes decode helpers.tile_share / SHARE_PERIOD of the stored tiles.
        self.helpers = helpers if helpers is not None and helpers.tile_share else None
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
        self.stored_tiles_reused = 0
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.background = torch.tensor(list(slide.background_rgb), dtype=torch.uint8, device=self.device)
        # The decoding of a batch's stored tiles by this decoder's kind.
        self.kinds = StoredTileDecoding(
            slide, self.device, self.background, jpeg_decoder, self.threads, self.helpers, self._count
        )

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
        """The stored tiles ``(tx, ty)`` that ``tiles`` touch (:func:`~.mosaic.stored_tiles_touched`)."""
        if not tiles:
            return []
        level = self._check(tiles)
        tw, th, _, _ = self.slide.tile_grid_shape(level)
        lw, lh = self.slide.level_dimensions[level]
        return stored_tiles_touched(*self._origins(tiles, level), tiles[0].read_size, tw, th, lw, lh)

    def _decode_into(self, stored: torch.Tensor, level: int, slots: list, th: int, tw: int) -> None:
        """Decode the stored tiles ``slots`` (``(slot, tx, ty)``) into their slots of ``stored``."""
        if not slots:
            return
        if self.jpeg_decoder == "threads":
            self.kinds.decode_threads(stored, level, slots, th, tw)
        elif self.helpers is not None:
            self.kinds.decode_shared(stored, level, slots, th, tw)
        else:
            self.kinds.decode_gpu(stored, level, slots, th, tw)
        self._count(decoded=len(slots))

    def close(self) -> None:
        self.kinds.close()

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
        layout = mosaic_layout(needed)
        kept = self._decode_stored(level, needed, layout, th, tw, previous_tiles, take_previous)
        rows, cols = layout.rows, layout.cols
        # Mosaic of the stored tiles, in level pixels from (tx0*tw, ty0*th).
        mosaic = kept.pixels.view(rows, cols, th, tw, 3).permute(0, 2, 1, 3, 4).reshape(rows * th, cols * tw, 3)
        mx0, my0 = layout.tx0 * tw, layout.ty0 * th
        mosaic_box = (mx0, my0, mx0 + cols * tw, my0 + rows * th)
        canvas, px0, py0 = self._patch_canvas(mosaic, mosaic_box, lw, lh, xs0, ys0, size)
        offsets_x = [x - px0 for x in xs0]
        offsets_y = [y - py0 for y in ys0]
        return self._gather_patches(canvas, offsets_x, offsets_y, size, out_size), kept

    def _decode_stored(
        self,
        level: int,
        needed: list[tuple[int, int]],
        layout: MosaicLayout,
        th: int,
        tw: int,
        previous_tiles: Sequence[Tile],
        take_previous: Callable[[], StoredTiles | None] | None,
    ) -> StoredTiles:
        """The ``needed`` stored tiles in their slots of a new mosaic: those the previous batch does
        not touch decoded first, then ``take_previous`` called, the shared ones copied from its
        mosaic, and those it does not hold (it failed, or holds another level) decoded."""
        slots = layout.slots
        previous = set(self.stored_tiles(previous_tiles)) if previous_tiles else set()
        shared = [c for c in needed if c in previous]
        # Slots no patch touches stay uninitialised: no patch pixel inside the
        # level lies in them, and the canvas masks everything outside it.
        stored = torch.empty((layout.rows * layout.cols, th, tw, 3), dtype=torch.uint8, device=self.device)
        self._decode_into(stored, level, [(slots[c], *c) for c in needed if c not in previous], th, tw)
        # Always taken (even when nothing is shared), so that batches publish in sequence order.
        prev = take_previous() if take_previous is not None else None
        if prev is not None and prev.level == level:
            self._copy_shared(stored, slots, shared, prev)
            shared = [c for c in shared if c not in prev.slots]
        del prev
        self._decode_into(stored, level, [(slots[c], *c) for c in shared], th, tw)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return StoredTiles(level, stored, slots, ready)

    def _copy_shared(
        self, stored: torch.Tensor, slots: dict[tuple[int, int], int], shared: list[tuple[int, int]], prev: StoredTiles
    ) -> None:
        """Copy the ``shared`` stored tiles that ``prev`` holds from its mosaic into their ``slots`` of ``stored``."""
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

    def _patch_canvas(
        self,
        mosaic: torch.Tensor,
        mosaic_box: tuple[int, int, int, int],
        lw: int,
        lh: int,
        xs0: list[int],
        ys0: list[int],
        size: int,
    ) -> tuple[torch.Tensor, int, int]:
        """Everything the patches (level-pixel origins ``xs0``, ``ys0``, side ``size``) touch, and
        its level-pixel origin: the ``mosaic`` (spanning ``mosaic_box``, ``(x0, y0, x1, y1)`` in level
        pixels) inside the level of ``lw`` x ``lh`` pixels, background outside it."""
        mx0, my0, mx1, my1 = mosaic_box
        px0, py0 = min(xs0), min(ys0)
        px1, py1 = max(xs0) + size, max(ys0) + size
        canvas = torch.empty((py1 - py0, px1 - px0, 3), dtype=torch.uint8, device=self.device)
        canvas[...] = self.background
        sx0, sy0 = max(px0, mx0), max(py0, my0)
        sx1, sy1 = min(px1, mx1, lw), min(py1, my1, lh)
        if sx0 < sx1 and sy0 < sy1:
            canvas[sy0 - py0 : sy1 - py0, sx0 - px0 : sx1 - px0] = mosaic[sy0 - my0 : sy1 - my0, sx0 - mx0 : sx1 - mx0]
        if py1 > lh or px1 > lw:  # past the level's edge: the image reflected, as the CPU reader fills it
            at_y = np.clip(reflect_index(np.arange(py0, py1), lh) - py0, 0, None)
            at_x = np.clip(reflect_index(np.arange(px0, px1), lw) - px0, 0, None)
            canvas = canvas[torch.from_numpy(at_y).to(self.device)][:, torch.from_numpy(at_x).to(self.device)]
        return canvas, px0, py0

    def _gather_patches(
        self, canvas: torch.Tensor, offsets_x: list[int], offsets_y: list[int], size: int, out_size: int
    ) -> torch.Tensor:
        """The patches of side ``size`` at ``offsets_x``, ``offsets_y`` of ``canvas``, resampled to
        ``out_size`` where it differs."""
        if size != out_size:
            return resample_patches(canvas, offsets_x, offsets_y, size, out_size)
        ar = torch.arange(size, device=self.device)
        yy = torch.tensor(offsets_y, device=self.device)[:, None] + ar[None, :]
        xx = torch.tensor(offsets_x, device=self.device)[:, None] + ar[None, :]
        return canvas[yy[:, :, None], xx[:, None, :]]
