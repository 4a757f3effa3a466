"""Seeded mutants of small synthetic slides, and a harness that runs each one in a worker
process under a time and an address-space limit.

Every case goes through what ``wsi-pipeline info`` and ``wsi-pipeline run`` do with a
slide file (open with backend detection, describe, tissue thumbnail, read every grid
tile through the tile loader, overlay thumbnail) and must end in success or in one of
the project's own errors naming the file: never another exception type, a hang, a
crash or an allocation past the limit.

Run standalone to print the counts: ``python tests/fuzz_slides.py --cases 300``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import stat
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Files a worker may have open (the usual soft limit): no case may need more.
OPEN_FILES = 1024

# -- the slides mutated -----------------------------------------------------------

_TIFF_TYPE_SIZE = {
    1: 1,
    2: 1,
    3: 2,
    4: 4,
    5: 8,
    6: 1,
    7: 1,
    8: 2,
    9: 4,
    10: 8,
    11: 4,
    12: 8,
    13: 4,
    16: 8,
    17: 8,
    18: 8,
}


def _smooth_rgb(h: int, w: int, seed: int):
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, h // 32), max(2, w // 32), 3)) * 255).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    return np.clip(img.astype(int) + rng.integers(-6, 7, (h, w, 3)), 0, 255).astype(np.uint8)


def _write_tiff(
    path: Path,
    image,
    levels: int,
    tile: int | None,
    compression: str,
    bigtiff: bool = False,
    description: str | None = None,
    subifds: bool = False,
) -> None:
    import cv2
    import tifffile

    pyramid = [image]
    for _ in range(levels - 1):
        p = pyramid[-1]
        pyramid.append(cv2.resize(p, (p.shape[1] // 2, p.shape[0] // 2), interpolation=cv2.INTER_AREA))
    kw: dict = dict(compression=compression, photometric="rgb")
    if tile:
        kw["tile"] = (tile, tile)
    if compression == "jpeg":
        kw["compressionargs"] = {"level": 85}
    res = dict(resolution=(4e4, 4e4), resolutionunit="CENTIMETER")
    with tifffile.TiffWriter(path, bigtiff=bigtiff or subifds, ome=subifds) as tw:
        extra = {"subifds": levels - 1} if subifds else {}
        meta = {"PhysicalSizeX": 0.25, "PhysicalSizeY": 0.25} if subifds else None
        tw.write(pyramid[0], description=description, metadata=meta, **res, **kw, **extra)
        for p in pyramid[1:]:
            tw.write(p, subfiletype=1, metadata=None, **kw)


def make_base_slides(folder: Path) -> dict[str, Path]:
    """Small valid slides of every kind the readers take, written into ``folder``."""
    import cv2
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    img = _smooth_rgb(384, 512, seed=3)
    bases = {
        "jpeg.tiff": dict(levels=3, tile=128, compression="jpeg"),
        "jpeg.bigtiff.tiff": dict(levels=3, tile=128, compression="jpeg", bigtiff=True),
        "deflate.tiff": dict(levels=2, tile=128, compression="zlib"),
        "single.tiff": dict(levels=1, tile=128, compression="jpeg"),
        "ome.ome.tiff": dict(levels=3, tile=128, compression="jpeg", subifds=True),
        "strips.tiff": dict(levels=1, tile=None, compression="zlib"),
        "aperio.svs": dict(
            levels=2,
            tile=128,
            compression="jpeg",
            description="Aperio Image Library v10.0.0\n512x384 [0,0 512x384] (128x128) "
            "JPEG/RGB Q=85|AppMag = 40|MPP = 0.25",
        ),
    }
    out = {}
    for name, kw in bases.items():
        _write_tiff(folder / name, img, **kw)
        out[name] = folder / name
    cv2.imwrite(str(folder / "rgb.png"), img[:200, :300, ::-1])
    rgba16 = np.concatenate([img[:120, :160], img[:120, :160, :1]], axis=2).astype(np.uint16) * 257
    cv2.imwrite(str(folder / "rgba16.png"), rgba16)
    cv2.imwrite(str(folder / "photo.jpg"), img[:200, :300, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 85])
    for name in ("rgb.png", "rgba16.png", "photo.jpg"):
        out[name] = folder / name
    return out


# -- TIFF structure ---------------------------------------------------------------


@dataclass
class _Entry:
    tag: int
    type: int
    count: int
    pos: int  # byte offset of the entry in the file


@dataclass
class _Ifd:
    offset: int
    entries: list[_Entry]
    next_pos: int  # byte offset of the next-IFD pointer


def _parse_tiff(buf: bytes) -> tuple[bool, list[_Ifd]]:
    """(is_bigtiff, IFDs of the main chain) of a little-endian TIFF."""
    big = buf[2] == 43
    ifds: list[_Ifd] = []
    off = struct.unpack_from("<Q" if big else "<I", buf, 8 if big else 4)[0]
    seen = set()
    while off and off not in seen and off + 16 < len(buf):
        seen.add(off)
        if big:
            n = struct.unpack_from("<Q", buf, off)[0]
            first, size = off + 8, 20
        else:
            n = struct.unpack_from("<H", buf, off)[0]
            first, size = off + 2, 12
        entries = []
        for k in range(n):
            p = first + k * size
            if big:
                tag, typ, count = struct.unpack_from("<HHQ", buf, p)
            else:
                tag, typ, count = struct.unpack_from("<HHI", buf, p)
            entries.append(_Entry(tag, typ, count, p))
        next_pos = first + n * size
        ifds.append(_Ifd(off, entries, next_pos))
        off = struct.unpack_from("<Q" if big else "<I", buf, next_pos)[0]
    return big, ifds


def _value_pos(buf: bytes, big: bool, e: _Entry) -> int:
    """Byte offset of an entry's first value (inline or out of line)."""
    inline = 8 if big else 4
    vpos = e.pos + (12 if big else 8)
    if _TIFF_TYPE_SIZE.get(e.type, 1) * e.count <= inline:
        return vpos
    return struct.unpack_from("<Q" if big else "<I", buf, vpos)[0]


def _put_uint(buf: bytearray, pos: int, size: int, value: int) -> None:
    if 0 <= pos and pos + size <= len(buf):
        buf[pos : pos + size] = (value % (1 << (8 * size))).to_bytes(size, "little")


_FORGED_VALUES = {
    256: [0, 1, 65535, 2**31 - 1, 2**32 - 1, 15_000_000],  # ImageWidth
    257: [0, 1, 65535, 2**31 - 1, 2**32 - 1, 15_000_000],  # ImageLength
    322: [0, 1, 7, 16, 65535, 15_000_000, 2**32 - 1],  # TileWidth
    323: [0, 1, 7, 16, 65535, 15_000_000, 2**32 - 1],  # TileLength
    258: [0, 1, 2, 12, 16, 32, 64, 65535],  # BitsPerSample
    277: [0, 1, 2, 4, 5, 255, 65535],  # SamplesPerPixel
    259: [0, 1, 2, 5, 7, 8, 34712, 52479, 65535],  # Compression
    262: [0, 1, 3, 4, 5, 6, 8, 32844, 65535],  # Photometric
    284: [0, 2, 3, 65535],  # PlanarConfiguration
    296: [0, 1, 2, 3, 65535],  # ResolutionUnit
    339: [0, 2, 3, 4, 65535],  # SampleFormat
    324: [0, 1, 8, 2**31 - 1, 2**32 - 1, 2**64 - 16],  # TileOffsets (one element)
    325: [0, 1, 2**31, 2**32 - 1, 2**64 - 16],  # TileByteCounts (one element)
    273: [0, 2**32 - 1, 2**64 - 16],  # StripOffsets
    279: [0, 2**31, 2**32 - 1],  # StripByteCounts
    278: [0, 1, 2**32 - 1],  # RowsPerStrip
    282: [(0, 0), (1, 0), (0, 1), (2**32 - 1, 1), (1, 2**32 - 1)],  # XResolution
    283: [(0, 0), (1, 0), (0, 1), (2**32 - 1, 1)],  # YResolution
    330: ["ifd0", "self", 0, 2**32 - 1],  # SubIFDs (one element)
}


def _forge_tag(buf: bytearray, rng: random.Random) -> str:
    big, ifds = _parse_tiff(bytes(buf))
    cands = [(i, e) for i, ifd in enumerate(ifds) for e in ifd.entries if e.tag in _FORGED_VALUES]
    i, e = rng.choice(cands)
    value = rng.choice(_FORGED_VALUES[e.tag])
    size = _TIFF_TYPE_SIZE.get(e.type, 4)
    pos = _value_pos(bytes(buf), big, e)
    if e.count > 1 and e.type != 5:
        pos += size * rng.randrange(e.count)
    if isinstance(value, tuple):
        _put_uint(buf, pos, 4, value[0])
        _put_uint(buf, pos + 4, 4, value[1])
    elif value == "ifd0":
        _put_uint(buf, pos, size, ifds[0].offset)
    elif value == "self":
        _put_uint(buf, pos, size, ifds[i].offset)
    else:
        if e.type == 3 and value > 65535:  # a SHORT cannot hold it: widen the tag to LONG(8)
            typ = 16 if big else 4
            _put_uint(buf, e.pos + 2, 2, typ)
            size = _TIFF_TYPE_SIZE[typ]
            if e.count == 1:
                pos = e.pos + (12 if big else 8)
        _put_uint(buf, pos, size, value)
    return f"forge tag {e.tag} of IFD {i} = {value}"


# Tags readers compute with, and what a forged layout makes of them: no value, an undefined byte, another
# bit depth for the last sample.
_LAYOUT_TAGS = (256, 257, 258, 259, 262, 277, 284, 322, 323)


def forge_tag_layout(buf: bytearray, tag: int, how: str, ifd: int = 0) -> str:
    """Give ``tag`` of IFD ``ifd`` a value of another shape: ``"empty"`` (count 0), ``"undefined"``
    (one byte of type UNDEFINED) or ``"mixed"`` (its last value doubled: BitsPerSample (8, 8, 16))."""
    big, ifds = _parse_tiff(bytes(buf))
    e = next(e for e in ifds[ifd].entries if e.tag == tag)
    count_size = 8 if big else 4
    if how == "empty":
        _put_uint(buf, e.pos + 4, count_size, 0)
    elif how == "undefined":
        _put_uint(buf, e.pos + 2, 2, 7)
        _put_uint(buf, e.pos + 4, count_size, 1)
        _put_uint(buf, e.pos + 4 + count_size, 1, 0x80)
    else:
        pos = _value_pos(bytes(buf), big, e) + _TIFF_TYPE_SIZE.get(e.type, 2) * (e.count - 1)
        _put_uint(buf, pos, _TIFF_TYPE_SIZE.get(e.type, 2), 16)
    return f"tag {tag} of IFD {ifd} made {how}"


def _forge_tag_layout(buf: bytearray, rng: random.Random) -> str:
    _, ifds = _parse_tiff(bytes(buf))
    i = rng.randrange(len(ifds))
    tag = rng.choice([e.tag for e in ifds[i].entries if e.tag in _LAYOUT_TAGS] or [259])
    how = "mixed" if tag == 258 else rng.choice(["empty", "undefined"])
    try:
        return forge_tag_layout(buf, tag, how, i)
    except StopIteration:
        return "no such tag"


def _forge_entry_header(buf: bytearray, rng: random.Random) -> str:
    big, ifds = _parse_tiff(bytes(buf))
    i = rng.randrange(len(ifds))
    e = rng.choice(ifds[i].entries)
    if rng.random() < 0.5:
        typ = rng.choice([0, 2, 7, 13, 19, 255])
        _put_uint(buf, e.pos + 2, 2, typ)
        return f"forge type of tag {e.tag} of IFD {i} = {typ}"
    count = rng.choice([0, 2, 2**31, 2**32 - 1] + ([2**40] if big else []))
    _put_uint(buf, e.pos + 4, 8 if big else 4, count)
    return f"forge count of tag {e.tag} of IFD {i} = {count}"


def _ifd_cycle(buf: bytearray, rng: random.Random) -> str:
    big, ifds = _parse_tiff(bytes(buf))
    src = rng.randrange(len(ifds))
    dst = rng.randrange(src + 1)
    _put_uint(buf, ifds[src].next_pos, 8 if big else 4, ifds[dst].offset)
    return f"next IFD of page {src} -> page {dst}"


def _tile_bytes(buf: bytearray, rng: random.Random) -> str:
    big, ifds = _parse_tiff(bytes(buf))
    i = rng.randrange(len(ifds))
    by_tag = {e.tag: e for e in ifds[i].entries}
    off_e, cnt_e = by_tag.get(324) or by_tag.get(273), by_tag.get(325) or by_tag.get(279)
    if off_e is None or cnt_e is None:
        return _random_bytes(buf, rng, 0, len(buf))
    k = rng.randrange(off_e.count)
    osz, csz = _TIFF_TYPE_SIZE[off_e.type], _TIFF_TYPE_SIZE[cnt_e.type]
    opos, cpos = _value_pos(bytes(buf), big, off_e) + k * osz, _value_pos(bytes(buf), big, cnt_e) + k * csz
    start = int.from_bytes(buf[opos : opos + osz], "little")
    n = int.from_bytes(buf[cpos : cpos + csz], "little")
    lo = start + min(n // 2, 700) if rng.random() < 0.8 else start
    return f"tile {k} of IFD {i}: " + _random_bytes(buf, rng, lo, start + n)


def _random_bytes(buf: bytearray, rng: random.Random, lo: int, hi: int) -> str:
    lo, hi = max(0, lo), min(len(buf), hi)
    if hi <= lo:
        return "no-op"
    spots = []
    for _ in range(rng.randint(1, 8)):
        p = rng.randrange(lo, hi)
        buf[p] = rng.randrange(256)
        spots.append(p)
    return f"random bytes at {spots}"


def _tag_data_bytes(buf: bytearray, rng: random.Random) -> str:
    """Random bytes inside an out-of-line tag value: JPEGTables, ImageDescription (OME-XML), or a
    value of the OME-XML's physical pixel size replaced."""
    big, ifds = _parse_tiff(bytes(buf))
    text = bytes(buf)
    at = text.find(b'PhysicalSizeX="')
    if at >= 0 and rng.random() < 0.3:
        start = at + len(b'PhysicalSizeX="')
        end = text.index(b'"', start)
        value = rng.choice([b"nan", b"inf", b"-1", b"0", b"1e999", b"abc", b"", b"1e-9"])
        buf[start:end] = value.ljust(end - start)[: max(end - start, len(value))]
        return f"PhysicalSizeX = {value!r}"
    cands = [(i, e) for i, ifd in enumerate(ifds) for e in ifd.entries if e.tag in (270, 347)]
    if not cands:
        return _random_bytes(buf, rng, 0, len(buf))
    i, e = rng.choice(cands)
    pos = _value_pos(text, big, e)
    return f"tag {e.tag} of IFD {i}: " + _random_bytes(buf, rng, pos, pos + e.count)


def _truncate(buf: bytearray, rng: random.Random) -> str:
    n = rng.randrange(8, len(buf))
    del buf[n:]
    return f"truncate to {n} bytes"


def _header_bytes(buf: bytearray, rng: random.Random) -> str:
    big, ifds = _parse_tiff(bytes(buf))
    ifd = rng.choice(ifds)
    return "IFD bytes: " + _random_bytes(buf, rng, ifd.offset, ifd.next_pos + 8)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _forge_png_header(buf: bytearray, rng: random.Random) -> str:
    w, h = struct.unpack_from(">II", buf, 16)
    depth, colour = buf[24], buf[25]
    what = rng.choice(["size", "depth", "colour"])
    if what == "size":
        w, h = rng.choice([(0, 0), (30000, 30000), (2**31 - 1, 1), (1, 2**31 - 1), (65536, 65536)])
    elif what == "depth":
        depth = rng.choice([0, 1, 3, 16, 255])
    else:
        colour = rng.choice([0, 1, 3, 4, 7, 255])
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    buf[8:33] = _png_chunk(b"IHDR", ihdr)
    return f"PNG header {w}x{h} depth {depth} colour {colour}"


def _forge_jpeg_header(buf: bytearray, rng: random.Random) -> str:
    i = buf.find(b"\xff\xc0")
    if i < 0:
        return "no-op"
    w, h = rng.choice([(0, 0), (65535, 65535), (60000, 1), (1, 65535)])
    struct.pack_into(">HH", buf, i + 5, h, w)
    return f"JPEG frame {w}x{h}"


def png_bomb(path: Path, width: int, height: int, depth: int, colour: int) -> None:
    """A valid PNG of zeros whose decoded size is far beyond its file size.

    Identical blocks of rows deflate to identical bytes after a full flush, so
    one block is compressed and its bytes repeated: seconds for gigabytes.
    """
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    row = b"\x00" * (1 + -(-width * channels * depth // 8))
    rows_per_block = max(1, (1 << 22) // len(row))
    block = row * rows_per_block
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    comp.compress(block)
    comp.flush(zlib.Z_FULL_FLUSH)
    repeated = comp.compress(block) + comp.flush(zlib.Z_FULL_FLUSH)
    full, rest = divmod(height, rows_per_block)
    tail = comp.compress(row * rest) + comp.flush()
    adler = 1
    for _ in range(full):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(row * rest, adler)
    idat = b"\x78\xda" + repeated * full + tail + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    )


def _tiff_tile_bomb(path: Path) -> None:
    """A valid-looking tiled TIFF whose one deflate tile claims 65535 x 65535 pixels."""
    import numpy as np
    import tifffile

    with tifffile.TiffWriter(path) as tw:
        tw.write(np.zeros((256, 256, 3), np.uint8), tile=(256, 256), compression="zlib", photometric="rgb")
    buf = bytearray(path.read_bytes())
    _, ifds = _parse_tiff(bytes(buf))
    for e in ifds[0].entries:
        if e.tag in (256, 257, 322, 323):
            _put_uint(buf, e.pos + 2, 2, 4)
            _put_uint(buf, e.pos + 8, 4, 65535 if e.tag in (322, 323) else 60000)
    path.write_bytes(bytes(buf))


_TIFF_MUTATORS = [
    (_ifd_cycle, 2),
    (_forge_tag, 6),
    (_forge_tag_layout, 2),
    (_forge_entry_header, 2),
    (_truncate, 2),
    (_tile_bytes, 4),
    (_header_bytes, 2),
    (_tag_data_bytes, 2),
]
_PNG_MUTATORS = [(_forge_png_header, 3), (_truncate, 1), (lambda b, r: _random_bytes(b, r, 8, len(b)), 2)]
_JPEG_MUTATORS = [(_forge_jpeg_header, 2), (_truncate, 1), (lambda b, r: _random_bytes(b, r, 2, len(b)), 3)]


def make_cases(folder: Path, n: int, seed: int = 0, bombs: bool = True) -> list[tuple[Path, str]]:
    """``n`` mutants (plus a few fixed decompression bombs) as (path, what was done)."""
    rng = random.Random(seed)
    bases = make_base_slides(folder / "bases")
    cases: list[tuple[Path, str]] = [(p, "unchanged") for p in bases.values()]
    names = sorted(bases)
    for k in range(n):
        name = rng.choice(names)
        buf = bytearray(bases[name].read_bytes())
        if name.endswith(".png"):
            mutators = _PNG_MUTATORS
        elif name.endswith(".jpg"):
            mutators = _JPEG_MUTATORS
        else:
            mutators = _TIFF_MUTATORS
        fn = rng.choices([m for m, _ in mutators], weights=[w for _, w in mutators])[0]
        what = fn(buf, rng)
        path = folder / f"case{k:04d}_{name}"
        path.write_bytes(bytes(buf))
        cases.append((path, f"{name}: {what}"))
    cases += special_files(folder / "special") + extreme_aspect_slides(folder / "aspect") + cmyk_slides(folder / "cmyk")
    cases += dicom_series_slides(folder / "dicom") + aperio_mpp_slides(folder / "aperio")
    cases += jpeg_stream_slides(folder / "jpeg")
    cases += coarse_read_slides(folder / "coarse") + skewed_level_slides(folder / "skewed")
    cases += sparse_dicom_slides(folder / "sparse") + sparse_tiff_slides(folder / "sparse_tiff")
    cases += tiny_tile_slides(folder / "tiny")
    if bombs:
        specs = [
            ("bomb_1bit_30000.png", 30000, 30000, 1, 0),
            ("bomb_rgba16_16000.png", 16000, 16000, 16, 6),
            ("bomb_grey_40000.png", 40000, 40000, 1, 0),
        ]
        for name, w, h, depth, colour in specs:
            png_bomb(folder / name, w, h, depth, colour)
            cases.append((folder / name, f"PNG bomb {w}x{h}, {depth}-bit colour type {colour}"))
        _tiff_tile_bomb(folder / "bomb_tile_65535.tiff")
        cases.append((folder / "bomb_tile_65535.tiff", "tile 65535 x 65535 claimed"))
    return cases


def coarse_read_slides(folder: Path) -> list[tuple[Path, str]]:
    """A single-level 1024 px TIFF at 0.25 um/px, which :func:`_exercise` reads 64 times coarser (a
    512 px tile then covers 32,768 px of level 0, of which 1,024 exist: 3.2 GB read whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "single_1024.tiff"
    _write_tiff(path, _smooth_rgb(1024, 1024, seed=5), levels=1, tile=256, compression="jpeg")
    return [(path, "1024 px, one level, read 64 times coarser")]


def skewed_level_slides(folder: Path) -> list[tuple[Path, str]]:
    """A square TIFF whose second page is 512 x 128 px (2 x one way, 8 x the other: downsample 5 as
    the mean of both), then a true 64 x 64 level: a grid at 8 x the pixel size must not read the
    skewed page."""
    import cv2
    import tifffile

    folder.mkdir(parents=True, exist_ok=True)
    image = _smooth_rgb(1024, 1024, seed=6)
    path = folder / "skewed_level.tiff"
    res = dict(resolution=(4e4, 4e4), resolutionunit="CENTIMETER")
    kw: dict = dict(tile=(128, 128), compression="jpeg", photometric="rgb", metadata=None)
    with tifffile.TiffWriter(path) as tw:
        tw.write(image, **res, **kw)
        for w, h in ((512, 128), (64, 64)):
            tw.write(cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA), subfiletype=1, **kw)
    return [(path, "1024 x 1024 with a 512 x 128 page")]


def sparse_dicom_slides(folder: Path) -> list[tuple[Path, str]]:
    """A 1 MB TILED_SPARSE DICOM claiming 400,000 x 400,000 px with 64 frames: its thumbnail and tissue
    mask must cost the frames it stores, not the bands of the matrix it claims."""
    from helpers import write_sparse_dicom_level

    folder.mkdir(parents=True, exist_ok=True)
    image = _smooth_rgb(2048, 2048, seed=7)
    tiles = {
        (700 + i, 900 + j): image[j * 256 : (j + 1) * 256, i * 256 : (i + 1) * 256] for i in range(8) for j in range(8)
    }
    path = folder / "sparse_400000.dcm"
    write_sparse_dicom_level(path, 400_000, 400_000, tiles)
    return [(path, "TILED_SPARSE, 400,000 px square claimed, 64 frames")]


def sparse_tiff(path: Path, width: int, height: int, tiles: dict, tile: int = 512) -> None:
    """A tiled JPEG (YCbCr 4:2:0) TIFF of ``width x height`` px that stores only ``tiles`` (``{(tx,
    ty): tile_px RGB array}``): every other tile empty (TileByteCounts 0, background as OpenSlide
    reads it)."""
    import cv2
    import numpy as np
    import tifffile

    across, down = -(-width // tile), -(-height // tile)
    quality = [cv2.IMWRITE_JPEG_QUALITY, 85]
    streams = {at: cv2.imencode(".jpg", px[:, :, ::-1], quality)[1].tobytes() for at, px in tiles.items()}
    chunks = (streams.get((tx, ty), b"") for ty in range(down) for tx in range(across))
    with tifffile.TiffWriter(path) as tw:
        tw.write(
            chunks, shape=(height, width, 3), dtype=np.uint8, tile=(tile, tile), compression="jpeg",
            photometric="ycbcr", subsampling=(2, 2), resolution=(4e4, 4e4), resolutionunit="CENTIMETER",
            metadata=None,
        )  # fmt: skip


def sparse_tiff_slides(folder: Path) -> list[tuple[Path, str]]:
    """A 5 MB tiled TIFF (its tile tables) claiming 400,000 x 400,000 px that stores 9 of its 611,524 tiles: its
    thumbnail, tissue mask and coarse reads must cost the tiles it stores, not the bands of the
    size it claims."""
    folder.mkdir(parents=True, exist_ok=True)
    image = _smooth_rgb(1536, 1536, seed=9)
    tiles = {
        (300 + i, 400 + j): image[j * 512 : (j + 1) * 512, i * 512 : (i + 1) * 512] for i in range(3) for j in range(3)
    }
    path = folder / "sparse_400000.tiff"
    sparse_tiff(path, 400_000, 400_000, tiles)
    return [(path, "tiled TIFF, 400,000 px square claimed, 9 tiles stored")]


def tiny_tile_tiff(path: Path, width: int, height: int, tile: int = 1) -> None:
    """An uncompressed RGB TIFF of ``tile`` px square tiles, every tile's offset at the same bytes
    (a file of 8 bytes a tile: its tables)."""
    n = -(-width // tile) * -(-height // tile)
    entries = [
        (256, 4, 1, width),
        (257, 4, 1, height),
        (258, 3, 3, None),  # BitsPerSample 8, 8, 8 (out of line)
        (259, 3, 1, 1),
        (262, 3, 1, 2),
        (277, 3, 1, 3),
        (284, 3, 1, 1),
        (322, 3, 1, tile),
        (323, 3, 1, tile),
        (324, 4, n, None),
        (325, 4, n, None),
    ]
    ifd_at = 8
    extra_at = ifd_at + 2 + 12 * len(entries) + 4
    bits_at, data_at = extra_at, extra_at + 6
    offsets_at = data_at + 3 * tile * tile
    counts_at = offsets_at + 4 * n
    out = bytearray(b"II*\x00" + struct.pack("<I", ifd_at) + struct.pack("<H", len(entries)))
    for tag, typ, count, value in entries:
        value = {258: bits_at, 324: offsets_at, 325: counts_at}.get(tag, value)
        packed = struct.pack("<H", value) + b"\x00\x00" if typ == 3 and count == 1 else struct.pack("<I", value)
        out += struct.pack("<HHI", tag, typ, count) + packed
    out += struct.pack("<I", 0) + struct.pack("<HHH", 8, 8, 8) + bytes((200, 100, 50)) * (tile * tile)
    out += struct.pack("<I", data_at) * n + struct.pack("<I", 3 * tile * tile) * n
    path.write_bytes(bytes(out))


def tiny_tile_slides(folder: Path) -> list[tuple[Path, str]]:
    """A 1024 px square TIFF in 1 x 1 px tiles (8 MB of tables, a million tiles) and a DICOM level
    of 8 px frames: refused at open, naming the tile size."""
    from helpers import write_sparse_dicom_level

    folder.mkdir(parents=True, exist_ok=True)
    tiff = folder / "tiles_1px.tiff"
    tiny_tile_tiff(tiff, 1024, 1024)
    dicom = folder / "frames_8px.dcm"
    write_sparse_dicom_level(dicom, 1024, 1024, {(0, 0): _smooth_rgb(8, 8, seed=8)}, tile=8)
    return [(tiff, "1,048,576 tiles of 1 x 1 px"), (dicom, "16,384 frames of 8 x 8 px")]


def extreme_aspect_slides(folder: Path) -> list[tuple[Path, str]]:
    """Valid slides one pixel high or wide: a PNG 65,536 x 1 px and a tiled TIFF 1 x 65,536 px."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    line = _smooth_rgb(2, 65536, seed=4)[:1]
    wide, tall = folder / "wide_65536x1.png", folder / "tall_1x65536.tiff"
    cv2.imwrite(str(wide), line[:, :, ::-1])
    _write_tiff(tall, line.transpose(1, 0, 2).copy(), levels=1, tile=128, compression="zlib")
    return [(wide, "65,536 x 1 px"), (tall, "1 x 65,536 px, tiled")]


def cmyk_slides(folder: Path) -> list[tuple[Path, str]]:
    """Tiled and untiled TIFFs of CMYK inks (photometric SEPARATED): 200 of cyan, no black (RGB 55, 255, 255)."""
    import numpy as np
    import tifffile

    folder.mkdir(parents=True, exist_ok=True)
    inks = np.zeros((300, 400, 4), np.uint8)
    inks[..., 0] = 200
    cases = []
    for name, kw in (("cmyk_tiled.tiff", {"tile": (128, 128), "compression": "zlib"}), ("cmyk_strips.tiff", {})):
        tifffile.imwrite(folder / name, inks, photometric="separated", **kw)
        cases.append((folder / name, f"CMYK, {'tiled' if kw else 'strips'}"))
    return cases


def special_files(folder: Path) -> list[tuple[Path, str]]:
    """Slide names that are no regular file: a FIFO with no writer, a socket, links to them."""
    folder.mkdir(parents=True, exist_ok=True)
    cases = []
    fifo = folder / "fifo.tiff"
    os.mkfifo(fifo)
    cases.append((fifo, "a FIFO no one writes to"))
    sock = folder / "socket.svs"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))  # the file stays after the socket is closed
    cases.append((sock, "a Unix socket"))
    link = folder / "link_to_fifo.ndpi"
    link.symlink_to(fifo)
    cases.append((link, "a symbolic link to a FIFO"))
    return cases


def dicom_series_slides(folder: Path) -> list[tuple[Path, str]]:
    """DICOM WSI series among other things of their folder, and the expected outcome of each:
    a Secondary Capture of the slide's own series sorting first (the folder and a level file read,
    the capture alone refused), a FIFO beside a series (skipped by the dicom reader; named before
    OpenSlide, which opens every file of the folder, would wait on it), and a series of more level
    files than the worker may have open (:data:`OPEN_FILES`)."""
    import numpy as np
    from helpers import write_dicom_wsi, write_many_level_series, write_secondary_capture

    image = _smooth_rgb(256, 320, seed=6)
    cases: list[tuple[Path, str]] = []
    capture_first = folder / "capture_first"
    capture_first.mkdir(parents=True)
    levels = write_dicom_wsi(capture_first, "s", image, levels=2, jpeg="YBR_FULL_422", tile=128)
    import pydicom

    ds = pydicom.dcmread(levels[0], stop_before_pixels=True)
    uids = {"StudyInstanceUID": ds.StudyInstanceUID, "SeriesInstanceUID": ds.SeriesInstanceUID}
    write_secondary_capture(capture_first / "0_capture.dcm", uids)
    cases += [
        (capture_first, "success: a DICOM WSI folder whose first file is a Secondary Capture of its series"),
        (levels[1], "success: a level of a series beside a Secondary Capture of it"),
        (capture_first / "0_capture.dcm", "clean: a Secondary Capture alone"),
    ]
    for name, jpeg in (("fifo_beside_jpeg", "YBR_FULL_422"), ("fifo_beside_raw", None)):
        sub = folder / name
        sub.mkdir()
        level0 = write_dicom_wsi(sub, "s", np.ascontiguousarray(image[:128, :128]), levels=1, jpeg=jpeg, tile=128)[0]
        os.mkfifo(sub / "zz.dcm")
        outcome = "success" if jpeg else "clean"
        cases.append((level0, f"{outcome}: a FIFO beside a DICOM slide of {'JPEG' if jpeg else 'raw'} frames"))
    many = folder / "many_levels"
    many.mkdir()
    first = write_many_level_series(many, OPEN_FILES + 512)[0]
    cases.append((first, f"success: one series of {OPEN_FILES + 512} level files"))
    return cases


def aperio_mpp_slides(folder: Path) -> list[tuple[Path, str]]:
    """Aperio SVS whose MPP text OpenSlide reads as a number or not (read either way), and SVS
    truncated in their header, first IFD and second IFD (refused as truncated TIFF)."""
    import numpy as np
    import tifffile

    folder.mkdir(parents=True, exist_ok=True)
    image = _smooth_rgb(256, 256, seed=7)
    cases = []
    for i, text in enumerate(["0,25", "0x1p-2", "True", "1e400", "", "-inf"]):
        path = folder / f"mpp{i}.svs"
        description = f"Aperio Image Library v10.0.50\r\n256x256 -> 256x256 - |AppMag = 20|MPP = {text}"
        tifffile.imwrite(path, image, description=description, tile=(128, 128), photometric="rgb", metadata=None,
                         compression="jpeg")  # fmt: skip
        cases.append((path, f"success: Aperio MPP = {text!r}"))
    whole = folder / "whole.svs"
    with tifffile.TiffWriter(whole) as tw:
        for level in (image, np.ascontiguousarray(image[::2, ::2])):
            tw.write(level, tile=(128, 128), photometric="rgb", compression="jpeg", metadata=None,
                     description="Aperio Image Library v10.0.50\r\n256x256|MPP = 0.25")  # fmt: skip
    with tifffile.TiffFile(whole) as tif:
        second_ifd = tif.pages[1].offset
    data = whole.read_bytes()
    for name, end in (("header", 8), ("first_ifd", 30), ("second_ifd", second_ifd + 10)):
        path = folder / f"truncated_in_{name}.svs"
        path.write_bytes(data[:end])
        cases.append((path, f"clean: an SVS truncated in its {name.replace('_', ' ')}"))
    return cases


# -- one case, in a worker ---------------------------------------------------------


def _damage_tile(path: Path, how: str, tile: int = 5) -> None:
    """Stored tile ``tile`` of page 0 truncated (its second half zeroed), a sector of it overwritten,
    its frame header made to claim 12-bit samples, or the page's JPEGTables cut in half."""
    import numpy as np
    import tifffile

    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        off, n = page.dataoffsets[tile], page.databytecounts[tile]
        tables = page.tags.get(347)
    with open(path, "r+b") as f:
        if how == "truncated":
            f.seek(off + n // 2)
            f.write(b"\0" * (n - n // 2))
        elif how == "overwritten":
            f.seek(off + n // 2 - 256)
            f.write(bytes(np.random.default_rng(tile).integers(0, 255, 512, dtype=np.uint8)))
        elif how == "12-bit":
            f.seek(off)
            stream = f.read(n)
            at = off + stream.index(b"\xff\xc0") + 4
            f.seek(at)
            f.write(b"\x0c")
        elif how == "tables cut" and tables is not None:
            f.seek(tables.valueoffset + tables.count // 2)
            f.write(b"\0" * (tables.count - tables.count // 2))


def jpeg_stream_slides(folder: Path) -> list[tuple[Path, str]]:
    """Aperio SVS files as other writers lay them out (tests/helpers/slide_corpus.py) in each JPEG
    stream flavour, with a tile truncated or overwritten (read, the damage counted), a 12-bit stream
    in the 8-bit page (refused naming the tile), JPEGTables cut in half, streams of two colour
    spaces mixed in a level, and a tiled label after the levels."""
    from helpers.slide_corpus import BASE_FLAVOURS, aperio_layouts, write_layout

    folder.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[Path, str]] = []

    def layout(flavour: str, name: str = "aperio-reduced-flagged"):
        return next(lay for lay in aperio_layouts(flavour) if lay.name == name)

    for k, base in enumerate(BASE_FLAVOURS):
        for flavour, how in ((f"{base}+tables", "truncated"), (base, "overwritten")):
            path = folder / f"{flavour.replace('+', '_')}_{how}.svs"
            write_layout(path, layout(flavour))
            _damage_tile(path, how, tile=3 + k)
            cases.append((path, f"success: {flavour}, a tile {how} (counted as damaged)"))
    for flavour in ("ycbcr-jfif", "rgb-012+tables"):
        path = folder / f"{flavour.replace('+', '_')}_12bit.svs"
        write_layout(path, layout(flavour))
        _damage_tile(path, "12-bit")
        cases.append((path, f"clean: {flavour}, a 12-bit stream in the 8-bit page"))
    for name, flavour, how, what in (
        ("tables_cut.svs", "rgb-012+tables", "tables cut", "clean: JPEGTables cut in half (headers unreadable)"),
        ("mixed.svs", "rgb-012+tables", None, "success: RGB and YCbCr streams mixed in a level"),
        ("tiled_label.svs", "rgb-012+tables", None, "success: a tiled label page after the levels"),
    ):
        path = folder / name
        write_layout(path, layout(flavour, "aperio-tiled-label" if "label" in name else "aperio-mixed-streams"))
        if how:
            _damage_tile(path, how)
        cases.append((path, what))
    return cases


# Grids at these multiples of a slide's pixel size (where it has one), from the nearest finer level:
# through a pyramid's levels and past the last. Each picks a level of level 0's shape; the last,
# the largest shrink read (geometry.MAX_SHRINK), is read too: its 512 px tiles cover 32,768 px.
_COARSE_READS = (2, 8, 64)


def _exercise(path: str, backend: str) -> None:
    """What ``info`` and ``run`` do with a slide file, short of inference."""
    from wsi_pipeline.commands.info import describe
    from wsi_pipeline.file_identity import input_identity
    from wsi_pipeline.slide import open_slide
    from wsi_pipeline.slide.base import level_shape_agrees
    from wsi_pipeline.tiling.grid import TileGrid
    from wsi_pipeline.tiling.loader import TileLoader
    from wsi_pipeline.tiling.tissue import tissue_mask

    input_identity(path)  # a batch's resume key, taken before the slide is opened
    describe(path, backend)
    with open_slide(path, backend) as slide:
        mask = tissue_mask(slide, "otsu")
        grids = [TileGrid(slide, 128, 16, level=level) for level in sorted({0, slide.level_count - 1})]
        if slide.mpp is not None:
            for k in _COARSE_READS:
                grid = TileGrid(slide, 512, 64, mpp=slide.mpp[0] * k)
                w, h = slide.level_dimensions[grid.level]
                if not level_shape_agrees(*slide.dimensions, w, h):
                    raise AssertionError(f"a grid at {k} x the slide's pixel size reads level {grid.level}, {w}x{h} px")
            grids.append(grid)
        for grid in grids:
            tiles = grid.select(mask.tile_fractions(grid), 0.0)
            with TileLoader(slide, tiles, batch_size=4, workers=2) as loader:
                for _ in loader:
                    pass
        slide.get_thumbnail(256)


def run_case(path: str) -> dict:
    """The outcome of :func:`_exercise` with backend detection, and for a TIFF with each backend forced.

    "success" or "clean" (a project error naming the file) as the detected backend ends; any
    forced backend raising another exception type, or an error that does not name the file,
    makes the case "error" or "unnamed".
    """
    from wsi_pipeline.errors import WSIPipelineError

    tiff = False
    if stat.S_ISREG(os.stat(path).st_mode):  # a FIFO's open would wait for a writer
        with open(path, "rb") as f:
            tiff = f.read(2) in (b"II", b"MM")
    outcome: dict = {}
    for backend in ("auto", "tifffile", "openslide", "image") if tiff else ("auto",):
        try:
            _exercise(path, backend)
            result = {"outcome": "success"}
        except WSIPipelineError as exc:
            named = os.path.basename(path) in str(exc)
            result = {"outcome": "clean" if named else "unnamed", "detail": f"{type(exc).__name__}: {exc}"[:300]}
        except BaseException as exc:  # noqa: BLE001 - the point is to see what escapes
            result = {"outcome": "error", "detail": f"{backend}: {type(exc).__name__}: {exc}"[:300]}
        if backend == "auto":
            outcome = result
        elif result["outcome"] in ("error", "unnamed"):
            return result
    return outcome


def _worker_main(mem_bytes: int) -> None:
    import resource
    import warnings

    warnings.simplefilter("ignore")
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    import wsi_pipeline.commands.info  # noqa: F401  (imports paid before the limit)
    import wsi_pipeline.tiling.loader  # noqa: F401

    if mem_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(OPEN_FILES, hard), hard))
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        result = run_case(line.rstrip("\n"))
        proto.write(json.dumps(result) + "\n")
        proto.flush()


# -- the harness -------------------------------------------------------------------


# A case that goes this long without its worker's CPU time moving waits on something that never
# comes (a lock, a pipe): a hang that a CPU-time limit would not see.
IDLE_S = 120.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) of process ``pid`` and its live descendants, with what their
    ended children used; None where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS  # utime stime cutime cstime
        children: list[int] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.extend(int(c) for c in f.read().split())
    except (OSError, ValueError, IndexError):
        return None
    return total + sum(cpu_seconds(c) or 0.0 for c in children)


@dataclass
class _Case:
    """The case a worker runs: its index, and the worker's CPU time and the wall clock when it was
    sent and when that CPU time last moved."""

    index: int
    cpu_at_start: float | None
    cpu_seen: float | None
    moved_at: float


class _Worker:
    def __init__(self, mem_bytes: int):
        env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(mem_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        self.busy: _Case | None = None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("fuzz worker did not start")

    def send(self, index: int, path: Path) -> None:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        cpu = cpu_seconds(self.proc.pid)
        self.busy = _Case(index, cpu, cpu, time.monotonic())

    def cpu_used(self) -> float:
        """CPU seconds the case has used so far (where /proc cannot tell: seconds since it was sent)."""
        case = self.busy
        now, cpu = time.monotonic(), cpu_seconds(self.proc.pid)
        if cpu is None or case.cpu_at_start is None:
            return now - case.moved_at
        if cpu != case.cpu_seen:
            case.cpu_seen, case.moved_at = cpu, now
        return cpu - case.cpu_at_start

    def stalled(self) -> bool:
        """Whether the case's CPU time has stood still for :data:`IDLE_S`."""
        return self.busy.cpu_at_start is not None and time.monotonic() - self.busy.moved_at > IDLE_S

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_cases(
    cases: list[tuple[Path, str]], workers: int = 2, timeout_s: float = 20.0, mem_bytes: int = 3 << 30
) -> list[dict]:
    """Run every case in worker processes; a crash, a case past ``timeout_s`` of CPU time (the
    worker's, its helper processes' included: a machine busy with other work slows a case down,
    but does not make it use more), or one that makes no progress for :data:`IDLE_S` (its CPU
    time stands still) kills the worker. Each result holds the case's CPU seconds (``cpu_s``)."""
    results: list[dict | None] = [None] * len(cases)
    pending = list(range(len(cases)))[::-1]
    pool = [_Worker(mem_bytes) for _ in range(workers)]
    try:
        while pending or any(w.busy for w in pool):
            for w in pool:
                if w.busy is None and pending:
                    i = pending.pop()
                    w.send(i, cases[i][0])
            busy = [w for w in pool if w.busy]
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 0.5)
            for k, w in enumerate(pool):
                if not w.busy:
                    continue
                i, used = w.busy.index, w.cpu_used()
                if w.proc.stdout in ready:
                    line = w.proc.stdout.readline()
                    if line:
                        results[i] = {**json.loads(line), "cpu_s": round(used, 2)}
                        w.busy = None
                        continue
                    rc = w.proc.wait()
                    results[i] = {"outcome": "crash", "detail": f"worker exited with {rc}"}
                elif used > timeout_s:
                    results[i] = {"outcome": "timeout", "detail": f"no answer after {timeout_s:g} s of CPU time"}
                elif w.stalled():
                    results[i] = {"outcome": "timeout", "detail": f"no progress: CPU time unchanged for {IDLE_S:g} s"}
                else:
                    continue
                w.kill()
                pool[k] = _Worker(mem_bytes)
    finally:
        for w in pool:
            w.kill()
    for r, (path, what) in zip(results, cases, strict=True):
        r["case"] = f"{path.name} ({what})"
    return results  # type: ignore[return-value]


def summarize(results: list[dict]) -> Counter:
    return Counter(r["outcome"] for r in results)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker_main(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/wsi_fuzz")
    ap.add_argument("--timeout", type=float, default=20.0, help="CPU seconds a case may use")
    ap.add_argument("--mem-gib", type=float, default=3.0)
    ap.add_argument("--no-bombs", action="store_true")
    ap.add_argument("--report", help="write every case's outcome to this JSON file")
    args = ap.parse_args()
    t0 = time.monotonic()
    cases = make_cases(Path(args.dir), args.cases, args.seed, bombs=not args.no_bombs)
    t1 = time.monotonic()
    results = run_cases(cases, timeout_s=args.timeout, mem_bytes=int(args.mem_gib * (1 << 30)))
    for r in results:
        if r["outcome"] not in ("success", "clean"):
            print(f"{r['outcome']:8} {r['case']}: {r.get('detail', '')}")
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=1))
    counts = summarize(results)
    print(
        f"tried {len(results)}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"  (generate {t1 - t0:.1f} s, run {time.monotonic() - t1:.1f} s)"
    )


if __name__ == "__main__":
    main()
