"""Which loader reads a slide's tiles for a run: GPU decoding where it can, the CPU reader otherwise.

:func:`choose_tile_decode` decides where a run decodes its stored tiles and
says why (recorded in ``summary.json`` as ``tile_decode``);
:func:`make_slide_loader` builds the loader: the
:class:`~.gpu_loader.GpuTileLoader` (stored JPEG tiles decoded by nvJPEG or
nvImageCodec by kind, patches assembled, and resampled where the grid asks,
on the device) or the CPU :class:`~.loader.TileLoader`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import ConfigError
from ..slide.base import Slide, decoding_in_this_thread
from .grid import Tile, read_tile, reduced_factor
from .loader import TileLoader

log = logging.getLogger("wsi_pipeline")

# A GPU-decoded loader batch holds this many executor batches: the stored tiles that
# neighbouring patches share are decoded once per loader batch (and those shared with the
# previous loader batch copied from it), in one nvJPEG call per loader batch.
GPU_DECODE_BATCHES = 4
# Loader batches assembled at once (each thread on its own CUDA stream).
GPU_DECODE_THREADS = 2


def import_gpu_loader_ahead(warm_up: bool = True) -> threading.Thread:
    """Import the GPU loader (torch and torchvision) on a thread of its own, then, with
    ``warm_up`` and where CUDA is there, set nvJPEG up (:func:`~.gpu_codecs.warm_up_nvjpeg`);
    returns the thread.

    Importing torchvision took 6.9 s of a GPU machine's first slide where its files were slow to
    read (benchmarks/HISTORY.md); started while the model loads, it is done or under way when the first
    slide asks (Python's import lock makes that wait for it). A failure of the import is left to
    that import; a failure of the warm-up to the first slide's decoding (logged here at debug level).
    The interpreter's exit waits for the thread (:data:`AHEAD_EXIT_WAIT_S` at most).
    """

    def run() -> None:
        try:
            from . import gpu_codecs, gpu_loader  # noqa: F401  (imported ahead: the point of the thread)
        except Exception:  # raised again, with its message, where the loader is needed
            return
        import torch  # there: the loader imported it

        if not warm_up or not torch.cuda.is_available():
            return
        try:
            seconds = gpu_codecs.warm_up_nvjpeg()
        except Exception as exc:
            log.debug("nvJPEG's warm-up failed: %s", exc)
        else:
            log.debug("nvJPEG warmed up in %.2f s", seconds)

    thread = threading.Thread(target=run, name="import-gpu-loader", daemon=True)
    with _AHEAD_LOCK:
        _AHEAD[:] = [t for t in _AHEAD if t.is_alive()]
        _AHEAD.append(thread)
    thread.start()
    return thread


# The threads of import_gpu_loader_ahead, waited for (each up to AHEAD_EXIT_WAIT_S) when the
# interpreter exits: a daemon thread still inside a CUDA call when the interpreter finalises is
# stopped as it takes the interpreter lock back, and a thread stopped inside C++ frames can abort
# the process. They are daemons so that a hung import or device cannot keep the process alive.
_AHEAD: list[threading.Thread] = []
_AHEAD_LOCK = threading.Lock()
AHEAD_EXIT_WAIT_S = 60.0


@atexit.register
def _wait_for_threads_ahead() -> None:
    with _AHEAD_LOCK:
        threads = list(_AHEAD)
    for t in threads:
        t.join(AHEAD_EXIT_WAIT_S)


class TileDecodeChoice(NamedTuple):
    """Where a run decodes its stored tiles (``"gpu"`` or ``"cpu"``), why, and with what: the GPU
    decoder (``"nvjpeg"``, ``"nvimgcodec"``), or the CPU reader's (``"reader"``)."""

    where: str
    why: str
    decoder: str


def choose_tile_decode(
    slide: Slide, tiles: Sequence[Tile], decode: str, on_damaged_tile: str, backend: str, on_cuda: bool
) -> TileDecodeChoice:
    """Where a run decodes ``tiles`` of ``slide``, why, and with which decoder.

    ``decode``: the setting (``auto``, ``cpu``, ``gpu``; ``gpu`` raises
    :class:`ConfigError` where it cannot be met). ``backend``: the
    backend's name; ``on_cuda``: whether it runs on CUDA.
    """
    if decode == "cpu":
        return TileDecodeChoice("cpu", "decode = cpu", "reader")
    if tiles and reduced_factor(slide, tiles[0]):
        reason = "resample = reduced decodes the JPEG tiles reduced on the CPU reader"
    elif on_damaged_tile == "fail":
        # The GPU decoders report no corrupt-data warnings: only the CPU decoder can fail a damaged tile.
        reason = "on_damaged_tile = fail needs the CPU decoder's reports of corrupt tiles"
    elif not on_cuda:
        reason = f"the {backend} backend runs on the CPU"
    else:
        from .gpu_decode import gpu_decode_plan  # needs torch: only with a CUDA backend

        decoder, reason = gpu_decode_plan(slide, tiles)
        if decoder is not None:
            return TileDecodeChoice("gpu", reason, decoder)
    if decode == "gpu":
        raise ConfigError(f"{slide.path}: decode = gpu, but {reason}")
    return TileDecodeChoice("cpu", reason, "reader")


class _TimedRead:
    """:func:`read_tile`, adding each call's seconds to :attr:`seconds` (thread-safe); with
    ``in_this_thread``, each tile's stored tiles decoded by the reading thread
    (:func:`~..slide.base.decoding_in_this_thread`)."""

    def __init__(self, in_this_thread: bool = False) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._in_this_thread = in_this_thread

    def __call__(self, slide: Slide, tile: Tile, buf: np.ndarray) -> None:
        t0 = time.perf_counter()
        with decoding_in_this_thread() if self._in_this_thread else contextlib.nullcontext():
            read_tile(slide, tile, buf)
        with self._lock:
            self.seconds += time.perf_counter() - t0


def make_slide_loader(
    slide: Slide,
    tiles: Sequence[Tile],
    where: str,
    *,
    batch_size: int,
    streams: int,
    reader_workers: int,
    device: str | None = None,
    jpeg_helpers: Any = None,
    jpeg_decoder: str = "nvjpeg",
    model_on_cpu: bool = False,
) -> tuple[Any, Callable[[], float]]:
    """The loader of a run, and a function giving its reader threads' seconds so far.

    ``where``, ``jpeg_decoder``: :func:`choose_tile_decode`'s answer. ``batch_size``: the
    executor's batch; ``streams``: its streams (batches in flight);
    ``reader_workers``: CPU reader threads; ``device``: the CUDA device of GPU
    decoding (whose reads are not timed: 0); ``jpeg_helpers``:
    processes that decode their share of the stored tiles on a GPU run
    (:mod:`.jpeg_processes`); ``model_on_cpu``: the model runs on this CPU, so each CPU reader
    thread decodes its tiles' stored tiles itself, large regions too (the cores are the model's and
    the readers' already).
    """
    if where == "gpu":
        from .gpu_loader import GpuTileLoader

        loader = GpuTileLoader(
            slide,
            list(tiles),
            batch_size=batch_size * GPU_DECODE_BATCHES,
            device=device,
            prefetch=streams + 1,
            decode_threads=GPU_DECODE_THREADS,
            jpeg_decoder=jpeg_decoder,
            helpers=jpeg_helpers,
        )
        return loader, lambda: 0.0
    read = _TimedRead(in_this_thread=model_on_cpu)
    loader = TileLoader(
        slide,
        list(tiles),
        batch_size=batch_size,
        workers=reader_workers,
        prefetch=max(2, streams),
        auto_release=False,
        max_held=streams + 1,
        read=read,
    )
    return loader, lambda: read.seconds


__all__ = [
    "GPU_DECODE_BATCHES",
    "TileDecodeChoice",
    "choose_tile_decode",
    "import_gpu_loader_ahead",
    "make_slide_loader",
]
