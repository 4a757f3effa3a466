"""Opening a TIFF with tifffile only once its page chain is known to end.

tifffile follows each page's next-IFD pointer as it goes; a pointer set back
to an earlier page (a damaged or hostile file) makes it list pages for ever.
:func:`open_tifffile` walks the chain first, reading only the few bytes of
each IFD's entry count and next pointer, and refuses a chain that loops or
holds more than :data:`MAX_TIFF_PAGES` pages.
"""

from __future__ import annotations

import math
import os
import struct
from typing import BinaryIO

import tifffile

from ..errors import SlideError, SlideOpenError

# Pyramidal slides hold a few dozen pages; OME-TIFF stacks of planes a few thousand.
MAX_TIFF_PAGES = 16384
# A stored tile is decoded whole; larger claimed tiles are refused as forged
# geometry (real slides use 240 to 2048 px tiles: at most 12 MiB as RGB).
MAX_TILE_BYTES = 64 * 1024 * 1024
MAX_TILE_SIDE = 16384
# Tiles under this many pixels a side are refused on a level of more than SMALL_TILES_MAX tiles: each
# stored tile costs a read, a decode and a cache entry whatever its size (a 12.6 MB file of 1 x 1 px
# tiles took 79 s and ran out of memory), and TIFF asks for multiples of 16 anyway. A small image in
# small tiles is still read.
MIN_TILE_SIDE = 16
SMALL_TILES_MAX = 4096
# Tags a reader does arithmetic with, each one integer (BitsPerSample: one per sample): a forged type or
# count would reach the reader as a tuple or bytes and fail there with a bare TypeError.
_ONE_INTEGER_TAGS = {
    256: "ImageWidth",
    257: "ImageLength",
    259: "Compression",
    262: "PhotometricInterpretation",
    277: "SamplesPerPixel",
    278: "RowsPerStrip",
    284: "PlanarConfiguration",
    322: "TileWidth",
    323: "TileLength",
}
_BITS_PER_SAMPLE = 258


def page_name(page: tifffile.TiffPage) -> str:
    """A page's place as a person finds it: ``3`` in the main chain, ``0/SubIFD 1`` in page 0's SubIFDs."""
    index = page.treeindex
    if len(index) == 2:
        return f"{index[0]}/SubIFD {index[1]}"
    return "/".join(map(str, index))


def is_tiff(path: str) -> bool:
    """Whether ``path`` starts with a TIFF or BigTIFF signature."""
    with open(path, "rb") as f:
        magic = f.read(4)
    return magic[:2] in (b"II", b"MM") and magic[2:4] in (b"*\x00", b"\x00*", b"+\x00", b"\x00+")


def count_tiff_pages(path: str, max_pages: int = MAX_TIFF_PAGES) -> int:
    """The number of pages in the main IFD chain of the TIFF or BigTIFF at ``path``.

    The walk stops, as tifffile's does, at a null pointer or one past the end
    of the file. Raises :class:`SlideOpenError` if the chain comes back to a
    page already seen or is longer than ``max_pages``.
    """
    with open(path, "rb") as f:
        return count_pages_in(f, os.path.getsize(path), path, max_pages)


def count_pages_in(f: BinaryIO, size: int, path: str, max_pages: int = MAX_TIFF_PAGES) -> int:
    """:func:`count_tiff_pages` of the open binary file ``f`` of ``size`` bytes (``path`` names it)."""
    head = f.read(16)
    if len(head) < 8 or head[:2] not in (b"II", b"MM"):
        raise SlideOpenError(path, f"not a TIFF: expected the byte-order mark II or MM, found {head[:2]!r}")
    e = "<" if head[:2] == b"II" else ">"
    magic = struct.unpack(e + "H", head[2:4])[0]
    if magic == 42:
        offset = struct.unpack(e + "I", head[4:8])[0]
        count_fmt, entry_size, next_fmt = e + "H", 12, e + "I"
    elif magic == 43 and len(head) == 16:
        offset = struct.unpack(e + "Q", head[8:16])[0]
        count_fmt, entry_size, next_fmt = e + "Q", 20, e + "Q"
    else:
        raise SlideOpenError(path, f"not a TIFF: expected version 42 or 43 (BigTIFF), found {magic}")
    count_size, next_size = struct.calcsize(count_fmt), struct.calcsize(next_fmt)
    seen: dict[int, int] = {}
    while offset and offset + count_size <= size:
        if offset in seen:
            raise SlideOpenError(
                path,
                f"TIFF page chain loops: page {len(seen) - 1} points back to page {seen[offset]} "
                f"(IFD at byte {offset}); expected each page once and a chain that ends",
            )
        if len(seen) >= max_pages:
            raise SlideOpenError(path, f"TIFF has more than {max_pages} pages; expected a slide's pyramid")
        seen[offset] = len(seen)
        f.seek(offset)
        n = struct.unpack(count_fmt, f.read(count_size))[0]
        next_at = offset + count_size + n * entry_size
        if next_at + next_size > size:
            break
        f.seek(next_at)
        offset = struct.unpack(next_fmt, f.read(next_size))[0]
    return len(seen)


def open_tifffile_stream(path: str, stream: BinaryIO, size: int) -> tifffile.TiffFile:
    """:func:`open_tifffile` of an open binary ``stream`` of ``size`` bytes (a remote file), named ``path``."""
    count_pages_in(stream, size, path)
    stream.seek(0)
    try:
        return tifffile.TiffFile(stream)
    except SlideError:  # a request that failed, as it said
        raise
    except Exception as exc:  # tifffile raises many types on a damaged header
        raise SlideOpenError(path, f"not a readable TIFF: {exc}") from exc


def open_tifffile(path: str) -> tifffile.TiffFile:
    """``tifffile.TiffFile(path)`` once its page chain is checked; its errors as :class:`SlideOpenError`."""
    count_tiff_pages(path)
    try:
        return tifffile.TiffFile(path)
    except Exception as exc:  # tifffile raises many types on a damaged header
        from .tiff_truncation import tiff_truncation

        raise SlideOpenError(path, f"{tiff_truncation(path, MAX_TIFF_PAGES) or 'not a readable TIFF'}: {exc}") from exc


def check_page_data(path: str, page: tifffile.TiffPage, file_size: int) -> None:
    """Refuse a page whose claimed geometry its own tile or strip table cannot back.

    Checks, before any pixel is allocated: a size of at least 1 x 1, tiles
    of at most :data:`MAX_TILE_SIDE` px a side and :data:`MAX_TILE_BYTES`
    decoded, a table with an entry for every
    tile or strip the size needs, and data that ends inside the file.
    """

    def bad(reason: str) -> SlideOpenError:
        return SlideOpenError(path, f"page {page_name(page)}: {reason}")

    check_tag_types(path, page)
    width, height, spp = page.imagewidth, page.imagelength, max(1, page.samplesperpixel)
    if width < 1 or height < 1:
        raise bad(f"image claims {width}x{height} pixels")
    planes = spp if page.planarconfig == 2 else 1
    if page.is_tiled:
        tw, th = page.tilewidth, page.tilelength
        sample_bytes = max(1, -(-page.bitspersample // 8))
        if not (
            1 <= tw <= MAX_TILE_SIDE
            and 1 <= th <= MAX_TILE_SIDE
            and tw * th * max(spp, 3) * sample_bytes <= MAX_TILE_BYTES
        ):
            raise bad(
                f"tiles claim {tw}x{th} pixels; expected sides of at most {MAX_TILE_SIDE} px and at most "
                f"{MAX_TILE_BYTES // 2**20} MiB decoded (forged or damaged tile geometry)"
            )
        what, expected = f"{tw}x{th} tiles", math.ceil(width / tw) * math.ceil(height / th) * planes
        reason = small_tiles_refusal(width, height, tw, th)
        if reason is not None:
            raise bad(reason)
    else:
        rows = min(page.rowsperstrip or height, height)
        what, expected = f"strips of {rows} rows", math.ceil(height / rows) * planes
    offsets, counts = page.dataoffsets, page.databytecounts
    listed = min(len(offsets), len(counts))
    if listed < expected:
        raise bad(f"its table lists {listed} tiles or strips, expected {expected} for {width}x{height} in {what}")
    end = max((o + c for o, c in zip(offsets, counts, strict=False) if c), default=0)
    if end > file_size:
        raise bad(
            f"file is truncated or claims an impossible size: image data reaches byte {end} but the "
            f"file has {file_size} bytes ({width}x{height} claimed)"
        )


def small_tiles_refusal(width: int, height: int, tile_w: int, tile_h: int) -> str | None:
    """Why a ``width x height`` level stored in ``tile_w x tile_h`` tiles is refused as absurdly
    finely tiled (:data:`MIN_TILE_SIDE`, :data:`SMALL_TILES_MAX`), or None."""
    n = math.ceil(width / tile_w) * math.ceil(height / tile_h)
    if min(tile_w, tile_h) >= MIN_TILE_SIDE or n <= SMALL_TILES_MAX:
        return None
    return (
        f"{width}x{height} px stored in {tile_w}x{tile_h} px tiles, {n} of them; tiles under "
        f"{MIN_TILE_SIDE} px a side are read on a level of at most {SMALL_TILES_MAX} tiles "
        "(each costs a read and a decode: forged or damaged tile geometry)"
    )


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_tag_types(path: str, page: tifffile.TiffPage) -> None:
    """Refuse a page whose size, layout or coding tags are not single integers (a forged type or count)."""
    for code, value in ((t.code, t.value) for t in page.tags.values()):
        name = _ONE_INTEGER_TAGS.get(code)
        if name is not None:
            ok, expected = _is_integer(value), "one integer"
        elif code == _BITS_PER_SAMPLE:  # tifffile gives one integer where every sample has the same
            ok = _is_integer(value) or (
                isinstance(value, tuple) and len(value) > 0 and all(_is_integer(v) and v == value[0] for v in value)
            )
            name, expected = "BitsPerSample", "the same integer for every sample"
        else:
            continue
        if not ok:
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
            raise SlideOpenError(
                path,
                f"page {page_name(page)}: tag {name} ({code}): expected {expected}, found {shown} "
                "(a forged or damaged tag)",
            )


def is_cmyk(page: tifffile.TiffPage) -> bool:
    """Whether the page stores inks (photometric SEPARATED, CMYK), which only OpenSlide turns into RGB."""
    return page.photometric == tifffile.PHOTOMETRIC.SEPARATED


def refuse_cmyk(path: str, page: tifffile.TiffPage, reader: str) -> None:
    """SlideOpenError for a CMYK page read by a reader that would show its inks as RGB."""
    if is_cmyk(page):
        raise SlideOpenError(
            path,
            f"page {page_name(page)}: CMYK (photometric SEPARATED) is not RGB: the {reader} reader would show its "
            "inks as colours; the openslide backend converts a tiled one (--backend auto picks it), "
            "else convert the image to RGB",
        )


def check_tiff_data(path: str) -> None:
    """:func:`check_page_data` for every page of the TIFF at ``path`` (a file another library will read)."""
    size = os.path.getsize(path)
    with open_tifffile(path) as tif:
        for page in tif.pages:
            check_page_data(path, page, size)
