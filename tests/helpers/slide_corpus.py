"""Slide files laid out as scanners, converters and anonymisers write them, for differential tests.

Written from the formats' descriptions (TIFF 6.0, Aperio's SVS note, JPEG's markers), with
tifffile as the container writer and the JPEG streams edited at the byte level, never through the
project's own writer. Each :class:`Layout` is one file; :func:`write_layout` writes it.

JPEG stream flavours (:data:`FLAVOURS`), as encoders and converters leave them:
``ycbcr-jfif`` (libjpeg's default), ``ycbcr-bare`` (no JFIF, component ids 1, 2, 3), ``rgb-adobe``
(APP14 transform 0, ids 'R', 'G', 'B'), ``rgb-ids`` (ids 'R', 'G', 'B', no APP14), ``rgb-012`` (ids
0, 1, 2, no APP14: libjpeg would take it for YCbCr), ``rgb-123`` (ids 1, 2, 3, no APP14),
``rgb-jfif`` (an RGB stream with a stray JFIF marker), ``ycbcr-adobe0`` (a YCbCr stream whose APP14
claims no transform); each ``+tables`` variant is abbreviated, its tables in JPEGTables. Aperio's
JPEG 2000 levels: ``j2k-rgb`` (compression 33005) and ``j2k-ycbcr`` (33003).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import cv2
import imagecodecs
import numpy as np
import simplejpeg
import tifffile

from . import smooth_rgb

_JFIF = b"\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"


def _segments(stream: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each header segment before the first scan."""
    out, i = [], 2
    while i + 4 <= len(stream):
        marker = stream[i + 1]
        if marker == 0xDA:
            out.append((marker, i, len(stream)))
            break
        n = int.from_bytes(stream[i + 2 : i + 4], "big")
        out.append((marker, i, i + 2 + n))
        i += 2 + n
    return out


def drop_segments(stream: bytes, markers: set[int]) -> bytes:
    """``stream`` without its header segments of ``markers`` (e.g. APP0 0xE0, APP14 0xEE)."""
    keep = [stream[s:e] for m, s, e in _segments(stream) if m not in markers]
    return stream[:2] + b"".join(keep)


def set_component_ids(stream: bytes, ids: tuple[int, int, int]) -> bytes:
    """``stream`` with its three components renamed ``ids`` in the frame and scan headers."""
    out = bytearray(stream)
    for m, s, _ in _segments(stream):
        if m in (0xC0, 0xC1, 0xC2):
            for k in range(3):
                out[s + 10 + 3 * k] = ids[k]
        elif m == 0xDA:
            for k in range(3):
                out[s + 5 + 2 * k] = ids[k]
    return bytes(out)


def abbreviate(stream: bytes) -> tuple[bytes, bytes]:
    """(tables, tile): the quantisation and Huffman tables as a tables-only stream, and the
    stream without them, as TIFF's JPEGTables keeps them."""
    segs = _segments(stream)
    tables = b"\xff\xd8" + b"".join(stream[s:e] for m, s, e in segs if m in (0xDB, 0xC4)) + b"\xff\xd9"
    return tables, drop_segments(stream, {0xDB, 0xC4})


# Aperio's JPEG 2000 compressions: 33003 holds Y, Cb, Cr planes without the codestream's colour
# transform, 33005 RGB (with it).
J2K_COMPRESSION = {"j2k-ycbcr": 33003, "j2k-rgb": 33005}


def encode_tile(tile: np.ndarray, flavour: str, quality: int = 90) -> bytes:
    """``tile`` (RGB uint8) as one JPEG stream of ``flavour`` (module docstring; no ``+tables``),
    or a JPEG 2000 codestream for the ``j2k-`` flavours."""
    tile = np.ascontiguousarray(tile)
    if flavour == "j2k-rgb":
        return imagecodecs.jpeg2k_encode(tile, level=80, codecformat="J2K")
    if flavour == "j2k-ycbcr":
        ycc = cv2.cvtColor(tile, cv2.COLOR_RGB2YCrCb)[..., [0, 2, 1]]  # JFIF's full-range Y, Cb, Cr
        return imagecodecs.jpeg2k_encode(np.ascontiguousarray(ycc), level=80, codecformat="J2K", mct=False)
    if flavour.startswith("ycbcr"):
        s = simplejpeg.encode_jpeg(tile, quality=quality, colorspace="RGB", colorsubsampling="420")
        if flavour == "ycbcr-bare":
            s = drop_segments(s, {0xE0})
        elif flavour == "ycbcr-adobe0":
            s = drop_segments(s, {0xE0})
            s = s[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00" + s[2:]
        return s
    s = imagecodecs.jpeg8_encode(tile, level=quality, colorspace="RGB", outcolorspace="RGB")  # APP14 0, ids RGB
    if flavour == "rgb-adobe":
        return s
    s = drop_segments(s, {0xEE})
    if flavour == "rgb-012":
        s = set_component_ids(s, (0, 1, 2))
    elif flavour == "rgb-123":
        s = set_component_ids(s, (1, 2, 3))
    elif flavour == "rgb-jfif":
        s = s[:2] + _JFIF + s[2:]
    return s


BASE_FLAVOURS = ("ycbcr-jfif", "ycbcr-bare", "ycbcr-adobe0", "rgb-adobe", "rgb-ids", "rgb-012", "rgb-123", "rgb-jfif")
FLAVOURS = BASE_FLAVOURS + tuple(f"{f}+tables" for f in BASE_FLAVOURS)


def photometric_of(flavour: str) -> str:
    return "ycbcr" if flavour.startswith("ycbcr") else "rgb"


@dataclass(frozen=True)
class Page:
    """One TIFF page: a pyramid level (``downsample``, tiled) or an associated image (stripped).

    ``flavour``: JPEG stream flavour of a tiled page (``None``: the page's ``compression`` done by
    tifffile); ``subfiletype``: NewSubfileType; ``description``: ImageDescription or None.
    """

    downsample: int
    tiled: bool = True
    flavour: str | None = "ycbcr-jfif"
    compression: str = "jpeg"
    subfiletype: int = 0
    description: str | None = None
    size: tuple[int, int] | None = None  # (w, h) where not level 0's / downsample
    mixed: str | None = None  # a second flavour for every other tile
    tile: int | None = None  # the page's tile size where not the layout's
    subifd: bool = False  # written in page 0's SubIFDs (those pages follow page 0), not the main chain


@dataclass(frozen=True)
class Layout:
    """A TIFF file: its pages in order, level 0's size, tile size, container (BigTIFF)."""

    name: str
    pages: tuple[Page, ...]
    width: int = 1000
    height: int = 760
    tile: int = 240
    bigtiff: bool = False
    mpp_tags: bool = False  # resolution tags in cm on page 0
    seed: int = 7
    notes: tuple[str, ...] = field(default=())


def _aperio_desc(w0: int, h0: int, w: int, h: int, tile: int, first: bool) -> str:
    head = "Aperio Image Library v12.0.15 \r\n"
    size = f"{w0}x{h0} [0,0 {w0}x{h0}] ({tile}x{tile})" if first else f"{w0}x{h0} -> {w}x{h}"
    return head + size + " JPEG/RGB Q=90|AppMag = 40|StripeWidth = 992|ScanScope ID = SS1234|MPP = 0.2500"


def aperio_layouts(flavour: str = "rgb-012+tables", width: int = 1000, height: int = 760) -> list[Layout]:
    """Aperio layouts: the classic order and what converters and anonymisers change in it
    (level 0 of ``width`` x ``height``; sizes in the names' descriptions follow)."""
    w0, h0, t = width, height, 240

    def lvl(ds: int, sub: int = 0, fl: str = flavour, **kw) -> Page:
        w, h = -(-w0 // ds), -(-h0 // ds)
        return Page(ds, True, fl, "jpeg", sub, _aperio_desc(w0, h0, w, h, t, ds == 1), **kw)

    def assoc(what: str, sub: int, desc: bool = True, ds: int = 8) -> Page:
        text = f"Aperio Image Library v12.0.15 \r\n{what} {w0 // ds}x{h0 // ds}" if desc else None
        return Page(ds, False, None, "jpeg" if what != "label" else "lzw", sub, text)

    thumb = Page(8, False, None, "jpeg", 0, f"Aperio Image Library v12.0.15 \r\n{w0}x{h0} -> thumbnail |AppMag = 40")
    label, macro = assoc("label", 1, ds=4), assoc("macro", 9, ds=4)
    layouts = [
        Layout("aperio-classic", (lvl(1), thumb, lvl(4), lvl(16), label, macro)),
        Layout("aperio-reduced-flagged", (lvl(1), thumb, lvl(4, 1), lvl(16, 1), label, macro)),
        Layout("aperio-no-thumbnail", (lvl(1), lvl(4), lvl(16), label, macro)),
        Layout("aperio-no-thumbnail-flagged", (lvl(1), lvl(4, 1), lvl(16, 1), label, macro)),
        Layout("aperio-2x", (lvl(1), thumb, lvl(2), lvl(4), lvl(8), label, macro)),
        Layout("aperio-one-level", (lvl(1), thumb, label, macro)),
        Layout("aperio-no-label-macro", (lvl(1), thumb, lvl(4))),
        Layout("aperio-label-removed", (lvl(1), thumb, lvl(4), lvl(16), macro)),  # as anonymisers leave it
        Layout("aperio-macro-before-label", (lvl(1), thumb, lvl(4), lvl(16), macro, label)),
        Layout("aperio-thumbnail-after-levels", (lvl(1), lvl(4), lvl(16), thumb, label, macro)),
        # OpenSlide refuses these two (its levels must shrink in file order); the project reads them.
        Layout("aperio-tiled-thumbnail", (lvl(1), replace(lvl(8), description=thumb.description), lvl(4), label)),
        Layout("aperio-levels-out-of-order", (lvl(1), thumb, lvl(16), lvl(4), label, macro)),
        Layout("aperio-page-larger-than-level-0", (lvl(1), thumb, lvl(4), replace(lvl(1), size=(2000, 1520)))),
        Layout("aperio-assoc-undescribed", (lvl(1), thumb, lvl(4), assoc("label", 1, False), assoc("macro", 9, False))),
        Layout("aperio-uneven", (lvl(1), thumb, lvl(3), lvl(9)), width=1001, height=757),
        # Converters that re-tile the reduced levels, or write them without descriptions.
        Layout("aperio-tile-sizes", (lvl(1), thumb, replace(lvl(4), tile=128), replace(lvl(16), tile=512), label)),
        Layout("aperio-levels-undescribed", (lvl(1), thumb, replace(lvl(4), description=None), label, macro)),
        Layout("aperio-bigtiff", (lvl(1), thumb, lvl(4), lvl(16), label, macro), bigtiff=True),
        Layout("aperio-mixed-compression", (lvl(1), thumb, replace(lvl(4), flavour=None, compression="zlib"))),
        Layout("aperio-j2k-rgb", (lvl(1, fl="j2k-rgb"), thumb, lvl(4, fl="j2k-rgb"))),
        Layout("aperio-j2k-ycbcr", (lvl(1, fl="j2k-ycbcr"), thumb, lvl(4, fl="j2k-ycbcr"))),
        Layout("aperio-mixed-streams", (lvl(1, mixed="ycbcr-jfif"), thumb, lvl(4))),
        Layout(
            "aperio-tiled-label",
            (lvl(1), thumb, lvl(4), Page(1, True, flavour, "jpeg", 1, "label 480x240", size=(480, 240))),
            notes=("tiled label: OpenSlide reads it as a level; the project sets it apart",),
        ),
    ]
    return [replace(lay, width=w0 + (lay.width - 1000), height=h0 + (lay.height - 760)) for lay in layouts]


def generic_layouts(flavour: str = "ycbcr-jfif") -> list[Layout]:
    """Generic tiled TIFF layouts (OpenSlide's generic-tiff: page 0 and the tiled reduced pages)."""

    def lvl(ds: int, sub: int = 1, fl: str = flavour) -> Page:
        return Page(ds, True, fl, "jpeg", 0 if ds == 1 else sub)

    def sub(ds: int, flags: int = 1, **kw) -> Page:
        return replace(lvl(ds, flags), subifd=True, **kw)

    return [
        # Pyramids in page 0's SubIFDs, as tifffile's subifds= and libvips' tiffsave --subifd write
        # them (OpenSlide sees level 0 alone; the project reads the SubIFDs as levels).
        Layout("generic-subifds", (lvl(1), sub(2), sub(4)), mpp_tags=True),
        Layout("generic-subifds-unflagged", (lvl(1), sub(2, 0), sub(4, 0)), mpp_tags=True),
        Layout("generic-subifds-rgb", (lvl(1, fl="rgb-012"), sub(2, flavour="rgb-012"), sub(4, flavour="rgb-012"))),
        Layout("generic-subifds-bigtiff", (lvl(1), sub(2), sub(4)), bigtiff=True, mpp_tags=True),
        # SubIFDs that are not reduced copies of page 0: set apart, never level 0.
        Layout("generic-subifds-larger", (lvl(1), sub(2, size=(2000, 1520)), sub(4))),
        Layout("generic-subifds-stripped", (lvl(1), replace(sub(2), tiled=False, flavour=None), sub(4))),
        Layout("generic-subifds-page", (lvl(1), sub(2, 2), sub(4))),
        Layout("generic-pyramid", (lvl(1), lvl(2), lvl(4)), mpp_tags=True),
        Layout("generic-unflagged", (lvl(1), lvl(2, 0), lvl(4, 0)), mpp_tags=True),
        Layout("generic-out-of-order", (lvl(1), lvl(4), lvl(2)), mpp_tags=True),
        Layout("generic-one-level", (lvl(1),)),
        Layout("generic-tile-sizes", (lvl(1), replace(lvl(2), tile=512), replace(lvl(4), tile=128)), mpp_tags=True),
        Layout("generic-large-tiles", (lvl(1), lvl(2)), tile=512),
        Layout("generic-bigtiff", (lvl(1), lvl(2), lvl(4)), bigtiff=True, mpp_tags=True),
        Layout("generic-stripped-extra", (lvl(1), lvl(4), Page(8, False, None, "jpeg", 1)), mpp_tags=True),
        Layout("generic-deflate", (Page(1, True, None, "zlib"), Page(2, True, None, "zlib", 1))),
        Layout("generic-3x", (lvl(1), lvl(3), lvl(9)), mpp_tags=True),
        Layout("generic-kinds-per-level", (lvl(1), lvl(2, fl="rgb-adobe"), lvl(4, fl="rgb-012+tables")), mpp_tags=True),
        Layout("generic-described", (replace(lvl(1), description="converted by a tool"), lvl(2), lvl(4))),
    ]


def layout_image(layout: Layout) -> np.ndarray:
    return smooth_rgb(layout.height, layout.width, seed=layout.seed)


def _tiled_streams(img: np.ndarray, tile: int, flavour: str, mixed: str | None) -> tuple[list[bytes], bytes | None]:
    """The stored tiles of ``img`` (edge tiles padded by replication) in ``flavour``, and the
    JPEGTables where the flavour is abbreviated."""
    base, abbreviated = flavour.split("+")[0], flavour.endswith("+tables")
    h, w = img.shape[:2]
    padded = cv2.copyMakeBorder(img, 0, -h % tile, 0, -w % tile, cv2.BORDER_REPLICATE)
    streams, tables = [], None
    for k, (y, x) in enumerate((y, x) for y in range(0, h, tile) for x in range(0, w, tile)):
        fl = mixed.split("+")[0] if mixed and k % 2 else base
        s = encode_tile(padded[y : y + tile, x : x + tile], fl)
        if abbreviated and not fl.startswith("j2k"):
            tables, s = abbreviate(s)
        streams.append(s)
    return streams, tables


def write_layout(path, layout: Layout, image: np.ndarray | None = None) -> np.ndarray:
    """Write ``layout`` to ``path`` (level 0: ``image``, else :func:`layout_image`); returns level
    0's pixels before compression."""
    img = layout_image(layout) if image is None else image
    h0, w0 = img.shape[:2]
    n_subifds = sum(p.subifd for p in layout.pages)
    with tifffile.TiffWriter(path, bigtiff=layout.bigtiff) as tw:
        for i, page in enumerate(layout.pages):
            w, h = page.size or (-(-w0 // page.downsample), -(-h0 // page.downsample))
            pixels = cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA) if (w, h) != (w0, h0) else img
            kw: dict = dict(subfiletype=page.subfiletype, description=page.description, metadata=None)
            if i == 0 and n_subifds:
                kw["subifds"] = n_subifds
            if i == 0 and layout.mpp_tags:
                kw.update(resolution=(1e4 / 0.25, 1e4 / 0.25), resolutionunit="CENTIMETER")
            tile = page.tile or layout.tile
            if not page.tiled:
                tw.write(pixels, compression=page.compression, photometric="rgb", rowsperstrip=16, **kw)
            elif page.flavour is None:
                tw.write(pixels, tile=(tile, tile), compression=page.compression, photometric="rgb", **kw)
            elif page.flavour in J2K_COMPRESSION:
                streams, _ = _tiled_streams(pixels, tile, page.flavour, None)
                tw.write(
                    iter(streams),
                    shape=(h, w, 3),
                    dtype="uint8",
                    tile=(tile, tile),
                    compression=J2K_COMPRESSION[page.flavour],
                    photometric="rgb",
                    **kw,
                )
            else:
                streams, tables = _tiled_streams(pixels, tile, page.flavour, page.mixed)
                photometric = photometric_of(page.flavour)
                extra = [(347, 7, len(tables), tables, True)] if tables else []
                if photometric == "ycbcr":
                    kw["subsampling"] = (2, 2)
                else:  # tifffile tags JPEG of RGB samples YCbCr unless told the stored colour space
                    kw.update(subsampling=(1, 1), compressionargs={"outcolorspace": "RGB"})
                tw.write(
                    iter(streams),
                    shape=(h, w, 3),
                    dtype="uint8",
                    tile=(tile, tile),
                    compression="jpeg",
                    photometric=photometric,
                    extratags=extra,
                    **kw,
                )
    return img
