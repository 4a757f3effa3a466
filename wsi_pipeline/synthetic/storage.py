"""The same pixels stored as scanners store them: tiled TIFFs of each JPEG kind and Aperio SVS.

Real slides are seldom what ``wsi-pipeline synth`` writes (YCbCr 4:2:0 JPEG in 256 px tiles):
Aperio scanners store RGB JPEG (no colour transform) in 240 px tiles that share one JPEGTables
tag, with a thumbnail, a label and a macro image beside the pyramid; other scanners store YCbCr
4:4:4. :func:`write_storage` copies a slide's pixels into one of these kinds, a band of tiles at a
time (memory is bounded by one band across the widest level), so that readers, decoders and the
whole pipeline can be measured and tested on the storage users have.

Kinds (:data:`STORAGE_KINDS`):

``tiff-ycbcr420``, ``tiff-ycbcr422``, ``tiff-ycbcr444``
    generic pyramidal tiled TIFF (one page per level, each half the previous), YCbCr JPEG with
    that chroma subsampling, resolution tags in centimetres.
``tiff-rgb``
    the same with RGB JPEG (Adobe APP14 transform 0; photometric RGB).
``svs``
    Aperio SVS as OpenSlide's ``aperio`` reader expects it: RGB JPEG tiles without tables,
    their quantisation and Huffman tables in the page's JPEGTables tag; levels at downsample 4,
    16, ...; the thumbnail as the second page, label (LZW) and macro (JPEG) pages last; mpp and
    magnification in the Aperio ImageDescription.
``tiff-subifds-ycbcr444``, ``tiff-subifds-rgb``
    the YCbCr 4:4:4 / RGB TIFF with its reduced levels in page 0's SubIFDs, no OME-XML, as
    tifffile's ``subifds=`` and libvips' ``tiffsave --subifd`` write a pyramid (OpenSlide sees
    level 0 alone).
``tiff-one-level``
    the YCbCr 4:4:4 TIFF's level 0 alone (a slide of one stored level).
``svs-j2k``
    the same with Aperio's JPEG 2000 (TIFF compression 33003): Y, Cb, Cr planes (JFIF's full
    range) in a J2K codestream without its own colour transform, as OpenSlide decodes them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import cv2
import imagecodecs
import numpy as np
import tifffile

from ..errors import ConfigError
from ..io.atomic import partial_name
from ..slide.base import Slide

STORAGE_KINDS = (
    "tiff-ycbcr420",
    "tiff-ycbcr422",
    "tiff-ycbcr444",
    "tiff-rgb",
    "tiff-subifds-ycbcr444",
    "tiff-subifds-rgb",
    "tiff-one-level",
    "svs",
    "svs-j2k",
)
# Kinds that store another kind's tiles in another layout: (the tiles' kind, the layout).
_LAYOUTS = {
    "tiff-subifds-ycbcr444": ("tiff-ycbcr444", "subifds"),
    "tiff-subifds-rgb": ("tiff-rgb", "subifds"),
    "tiff-one-level": ("tiff-ycbcr444", "one-level"),
}
_SUBSAMPLING = {"tiff-ycbcr420": (2, 2), "tiff-ycbcr422": (2, 1), "tiff-ycbcr444": (1, 1)}
# Levels stop at the first whose longer side is at most this.
_SMALLEST_LEVEL_SIDE = 1024
# JPEG markers whose segments an Aperio tile leaves to the JPEGTables tag: DQT and DHT.
_TABLE_MARKERS = (0xDB, 0xC4)


def _jpeg_segments(stream: bytes) -> list[tuple[int, int, int]]:
    """``(marker, start, length)`` of a JPEG stream's segments after SOI, up to and including SOS
    (whose length runs to the end of the stream: the entropy-coded data and EOI)."""
    out, i = [], 2
    while i + 4 <= len(stream):
        if stream[i] != 0xFF:
            raise ValueError(f"JPEG segment expected at byte {i}, found 0x{stream[i]:02x}")
        marker = stream[i + 1]
        if marker == 0xDA:
            out.append((marker, i, len(stream) - i))
            break
        length = int.from_bytes(stream[i + 2 : i + 4], "big") + 2
        out.append((marker, i, length))
        i += length
    return out


def split_jpeg_tables(stream: bytes) -> tuple[bytes, bytes]:
    """A JPEG stream as (tables, abbreviated stream): the tables' DQT and DHT segments between SOI
    and EOI, as a TIFF JPEGTables tag holds them, and the stream without them, as TIFF tiles that
    share tables are stored."""
    segments = _jpeg_segments(stream)
    tables = b"".join(stream[s : s + n] for m, s, n in segments if m in _TABLE_MARKERS)
    rest = b"".join(stream[s : s + n] for m, s, n in segments if m not in _TABLE_MARKERS)
    return b"\xff\xd8" + tables + b"\xff\xd9", b"\xff\xd8" + rest


def _encode(tile: np.ndarray, kind: str, quality: int) -> bytes:
    if kind == "svs-j2k":
        ycc = cv2.cvtColor(tile, cv2.COLOR_RGB2YCrCb)[..., [0, 2, 1]]
        return imagecodecs.jpeg2k_encode(np.ascontiguousarray(ycc), level=quality, codecformat="J2K", mct=False)
    if kind in ("tiff-rgb", "svs"):
        return imagecodecs.jpeg8_encode(tile, level=quality, colorspace="RGB", outcolorspace="RGB")
    return imagecodecs.jpeg8_encode(
        tile, level=quality, colorspace="RGB", outcolorspace="YCBCR", subsampling=_SUBSAMPLING[kind]
    )


def _level_plan(width: int, height: int, factor: int) -> list[tuple[int, int, int]]:
    """(downsample, width, height) of each level: level k at ``factor ** k``."""
    plan = [(1, width, height)]
    while max(plan[-1][1:]) > _SMALLEST_LEVEL_SIDE:
        d = factor ** len(plan)
        plan.append((d, math.ceil(width / d), math.ceil(height / d)))
    return plan


def _read_scaled(source: Slide, x0: int, y0: int, w: int, h: int, downsample: int) -> np.ndarray:
    """``h x w`` pixels of ``source`` at ``downsample`` from level-0 (x0, y0): its level of that
    downsample where there is one, else the nearest finer level resized (area)."""
    level = source.best_level_for_downsample(downsample + 1e-6)
    ds = source.level_downsamples[level]
    if abs(ds - downsample) < 1e-3:
        return source.read_region((x0, y0), level, (w, h))
    scale = downsample / ds
    region = source.read_region((x0, y0), level, (max(1, round(w * scale)), max(1, round(h * scale))))
    return cv2.resize(region, (w, h), interpolation=cv2.INTER_AREA)


def _tiles(source: Slide, downsample: int, lw: int, lh: int, tile: int) -> Iterator[np.ndarray]:
    """A level's tiles in row-major order, full size (TIFF crops edge tiles), read a row at a time."""
    for ty in range(-(-lh // tile)):
        band = _read_scaled(source, 0, ty * tile * downsample, -(-lw // tile) * tile, tile, downsample)
        for tx in range(-(-lw // tile)):
            yield np.ascontiguousarray(band[:, tx * tile : (tx + 1) * tile])


def _aperio_description(width: int, height: int, tile: int, quality: int, mpp: float | None, what: str) -> str:
    # The layout OpenSlide's aperio reader and tifffile's is_svs recognise: the first line names
    # the library, the second the image, then "|"-separated "key = value" fields.
    fields = ["AppMag = 40" if mpp is None else f"AppMag = {10 / mpp:g}"]
    if mpp is not None:
        fields.append(f"MPP = {mpp:.4f}")
    return (
        f"Aperio Image Library v12.0.15 \r\n{width}x{height} [0,0 {width}x{height}] ({tile}x{tile}) {what} Q={quality}|"
        + "|".join(fields)
    )


def write_storage(
    source: Slide, path: str | os.PathLike[str], kind: str, tile_size: int = 240, quality: int = 90
) -> dict:
    """Write ``source``'s pixels to ``path`` stored as ``kind`` (:data:`STORAGE_KINDS`).

    ``tile_size``: the stored tiles' side (a multiple of 16); ``quality``: JPEG quality. The file
    is written under a temporary name and renamed when complete. Returns path, kind, width,
    height, mpp, tile_size and the written levels' dimensions.
    """
    if kind not in STORAGE_KINDS:
        raise ConfigError(f"storage kind: expected one of {', '.join(STORAGE_KINDS)}, found {kind!r}")
    if not 16 <= tile_size <= 4096 or tile_size % 16:
        raise ConfigError(f"tile size must be a multiple of 16 within 16..4096 pixels, got {tile_size!r}")
    path = os.fspath(path)
    width, height = source.dimensions
    mpp = source.mpp[0] if source.mpp else None
    svs = kind.startswith("svs")
    plan = _level_plan(width, height, 4 if svs else 2)
    written, layout = _LAYOUTS.get(kind, (kind, None))
    if layout == "one-level":
        plan = plan[:1]
    bigtiff = width * height * 3 > 2**31
    tmp = partial_name(path)
    try:
        with tifffile.TiffWriter(tmp, bigtiff=bigtiff) as tw:
            for k, (d, lw, lh) in enumerate(plan):
                subifds = len(plan) - 1 if layout == "subifds" and k == 0 else None
                _write_level(tw, source, written, d, lw, lh, tile_size, quality, mpp, first=k == 0, subifds=subifds)
                if svs and k == 0:
                    _write_associated(tw, source, "thumbnail", width, height, quality, mpp)
            if svs:
                _write_associated(tw, source, "label", width, height, quality, mpp)
                _write_associated(tw, source, "macro", width, height, quality, mpp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {
        "path": path,
        "kind": kind,
        "width": width,
        "height": height,
        "mpp": mpp,
        "tile_size": tile_size,
        "level_dimensions": [(lw, lh) for _, lw, lh in plan],
    }


def _write_level(
    tw: tifffile.TiffWriter,
    source: Slide,
    kind: str,
    downsample: int,
    lw: int,
    lh: int,
    tile: int,
    quality: int,
    mpp: float | None,
    first: bool,
    subifds: int | None = None,
) -> None:
    tiles = _tiles(source, downsample, lw, lh, tile)
    extratags: list = []
    if kind == "svs-j2k":
        data: Iterator = (_encode(t, kind, quality) for t in tiles)
        description = _aperio_description(lw, lh, tile, quality, None if mpp is None else mpp * downsample, "J2K/YUV16")
        resolution: dict = {}
    elif kind == "svs":
        tables, _ = split_jpeg_tables(_encode(np.zeros((tile, tile, 3), np.uint8), kind, quality))
        extratags.append((347, 7, len(tables), tables, True))  # JPEGTables, shared by every tile
        data = (split_jpeg_tables(_encode(t, kind, quality))[1] for t in tiles)
        description = _aperio_description(lw, lh, tile, quality, None if mpp is None else mpp * downsample, "JPEG/RGB")
        resolution: dict = {}
    else:
        data = (_encode(t, kind, quality) for t in tiles)
        description = None
        resolution = {"resolutionunit": "NONE"}
        if mpp is not None:
            per_cm = 1e4 / (mpp * downsample)
            resolution = {"resolution": (per_cm, per_cm), "resolutionunit": "CENTIMETER"}
    rgb = kind in ("tiff-rgb", "svs", "svs-j2k")
    tw.write(
        data,
        shape=(lh, lw, 3),
        dtype=np.uint8,
        tile=(tile, tile),
        photometric="rgb",
        compression=33003 if kind == "svs-j2k" else "jpeg",
        # The streams are encoded here; these arguments only make tifffile write the tags that
        # describe them (photometric RGB or YCbCr, and YCbCrSubSampling).
        compressionargs={"outcolorspace": "RGB"} if rgb and kind != "svs-j2k" else None,
        subsampling=None if rgb else _SUBSAMPLING[kind],
        # Aperio marks its pyramid levels as full images (tifffile's SVS series expects that).
        subfiletype=0 if first or kind.startswith("svs") else 1,
        description=description,
        software="wsi-pipeline",
        metadata=None,
        extratags=extratags,
        subifds=subifds,
        **resolution,
    )


def _write_associated(
    tw: tifffile.TiffWriter, source: Slide, what: str, width: int, height: int, quality: int, mpp: float | None
) -> None:
    """An Aperio thumbnail, label or macro page (stripped, not part of the pyramid)."""
    side = 768 if what == "thumbnail" else 256
    image = source.get_thumbnail(side)
    if what == "label":
        image = np.ascontiguousarray(255 - image[: side // 2, : side // 2])  # not the slide: not to be read as it
    h, w = image.shape[:2]
    line = {"thumbnail": f"{width}x{height} -> {w}x{h} - ", "label": f"label {w}x{h}", "macro": f"macro {w}x{h}"}[what]
    description = f"Aperio Image Library v12.0.15 \r\n{line}" + ("" if mpp is None else f"|MPP = {mpp:.4f}")
    tw.write(
        image,
        photometric="rgb",
        compression="lzw" if what == "label" else "jpeg",
        compressionargs=None if what == "label" else {"level": quality},
        subfiletype={"thumbnail": 0, "label": 1, "macro": 9}[what],
        description=description,
        metadata=None,
        rowsperstrip=16,
    )


__all__ = ["STORAGE_KINDS", "split_jpeg_tables", "write_storage"]
