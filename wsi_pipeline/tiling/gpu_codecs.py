"""The GPU JPEG decoders themselves: nvJPEG (torchvision's image extension) and nvImageCodec.

:func:`nvjpeg_decode` is one batched nvJPEG call (torchvision's extension is
loaded on its own, without importing torchvision); :func:`warm_up_nvjpeg`
sets nvJPEG up ahead of a first slide; :func:`nvimgcodec_decode` decodes
RGB JPEG streams with nvImageCodec (:func:`nvimgcodec_module`: None where it
is not installed). :func:`decode_stream` gives the process's CUDA streams
the GPU loaders decode on (made once per device and slot, reused from run
to run). How a batch of grid tiles is assembled from these calls is
:mod:`.gpu_decode`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np

from ..errors import ConfigError

try:
    import torch
except ImportError as exc:
    from ..errors import BackendUnavailableError

    raise BackendUnavailableError("GPU JPEG decoding needs torch and torchvision (the 'gpu' extra)") from exc

# torchvision.io.ImageReadMode.RGB.value, the mode argument of torchvision's decoding ops.
READ_MODE_RGB = 3
# The arguments of the two ops this module calls, as torchvision's image extension declares them.
_OP_ARGUMENTS = {"decode_jpegs_cuda": ["List[Tensor]", "int", "Device"], "decode_jpeg": ["Tensor", "int", "bool"]}


def image_ops_loaded() -> bool:
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
    (benchmarks/HISTORY.md), in every process that decodes on the GPU; a batch's first slide waited for
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
    if not image_ops_loaded():
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
            if image_ops_loaded():
                break
    return image_ops_loaded()


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
        return torch.ops.image.decode_jpegs_cuda(data, READ_MODE_RGB, device)
    return [torch.ops.image.decode_jpeg(d, READ_MODE_RGB, False) for d in data]


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
    for the next run of the same slide (benchmarks/HISTORY.md). A pipeline on CUDA calls this on a thread
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
    with torch.cuda.stream(decode_stream(device, 0)) if cuda else contextlib.nullcontext():
        decoded = nvjpeg_decode(data, device)
        if cuda:
            torch.cuda.current_stream(device).synchronize()
    if len(decoded) != len(data) or decoded[0].shape != (3, tile_px, tile_px):
        raise RuntimeError(f"nvJPEG's warm-up decoded {len(decoded)} of {len(data)} tiles")
    return time.perf_counter() - t0


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


_STREAMS: dict[tuple[str, int], Any] = {}
_STREAMS_LOCK = threading.Lock()


def decode_stream(device: torch.device, slot: int) -> Any:
    """The process's CUDA stream number ``slot`` for GPU loaders on ``device``, made on first use."""
    with _STREAMS_LOCK:
        key = (str(device), slot)
        stream = _STREAMS.get(key)
        if stream is None:
            stream = _STREAMS[key] = torch.cuda.Stream(device)
        return stream
