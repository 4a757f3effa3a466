"""Which GPU decoder takes a storage's stored tiles, by JPEG kind; needs no torch (``info`` asks too).

Below both the GPU decoder (:mod:`.gpu_decode`) and the choice of a run's loader
(:mod:`.slide_loader`), which ask it.
"""

from __future__ import annotations

from typing import Any

# GPU decoders by JPEG colour space (:mod:`..slide.jpeg_kind`): torchvision's nvJPEG converts every
# 3-component stream from YCbCr, so RGB JPEG (Aperio's) goes to nvImageCodec, told to convert nothing.
GPU_DECODER_BY_COLOUR = {"YCbCr": "nvjpeg", "RGB": "nvimgcodec"}
_DECODER_NAMES = {"nvjpeg": "nvJPEG", "nvimgcodec": "nvImageCodec"}


def storage_gpu_decoder(storage: dict[str, Any] | None, reader: str, level: int) -> tuple[str | None, str]:
    """The GPU decoder for stored tiles of ``storage`` (a reader's ``stored_tile_format(level)``),
    and why; ``(None, reason)`` where no GPU decoder takes them. Needs no torch (``info`` asks too).

    3-sample interleaved baseline JPEG of a kind the file's tags and markers tell: YCbCr of any
    chroma subsampling to nvJPEG (torchvision), RGB to nvImageCodec.
    """
    if storage is None:
        return None, f"the {reader} reader gives no stored tiles"
    if storage["compression"] != "JPEG":
        return None, f"level {level} is stored as {storage['compression']}, not JPEG"
    if storage["samples_per_pixel"] != 3 or storage["planar"] != 1 or storage["extra_samples"]:
        return None, f"level {level} has {storage['samples_per_pixel']} samples per pixel (expected 3, interleaved)"
    kind = storage.get("jpeg_kind") or "JPEG of an unknown kind"
    decoder = GPU_DECODER_BY_COLOUR.get(kind.split(" ")[0])
    if decoder is None:
        return None, f"level {level} holds {kind} (expected YCbCr or RGB)"
    if not storage.get("jpeg_baseline", True):
        return None, f"level {level} holds progressive or lossless {kind} JPEG"
    return decoder, f"{kind} JPEG tiles decoded by {_DECODER_NAMES[decoder]}"


__all__ = ["GPU_DECODER_BY_COLOUR", "storage_gpu_decoder"]
