"""What kind of JPEG a slide's stored tiles hold: colour space and chroma subsampling.

GPU decoders differ by kind: torchvision's nvJPEG converts every 3-component stream from YCbCr,
so RGB JPEG (Aperio's usual choice: no colour transform) decoded there gets the wrong colours;
nvImageCodec decodes it exactly when told to apply no conversion. The kind is read from the
container's tags (TIFF Photometric and YCbCrSubSampling, DICOM PhotometricInterpretation) and
from the stream's own markers (SOF sampling factors, the Adobe APP14 transform flag, JFIF, the
component identifiers), never guessed.

The markers are parsed here rather than by a library: the decoders answer only after decoding
(imagecodecs, simplejpeg) or need a GPU (nvImageCodec's code-stream info), and a kind must be known
before choosing the decoder. Only the segment headers before the first scan are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# SOF markers of the DCT processes (baseline, extended, progressive; Huffman and arithmetic).
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_SUBSAMPLING = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0", (4, 1): "4:1:1"}


@dataclass(frozen=True)
class JpegKind:
    """A JPEG stream's colour space (``"ycbcr"``, ``"rgb"``, ``"grey"``, ``"cmyk"``), chroma
    subsampling (``"4:2:0"``, ``"4:2:2"``, ``"4:4:4"``, ... ; ``None`` for one component),
    whether it is baseline (SOF0/SOF1: what nvJPEG's batched decoders take), and where the
    colour space was read (``"tag"`` or ``"markers"``)."""

    colour: str
    subsampling: str | None
    baseline: bool
    colour_from: str

    @property
    def name(self) -> str:
        """``"YCbCr 4:2:0"``, ``"RGB"``, ... (as recorded in ``summary.json``)."""
        if self.colour == "ycbcr":
            return f"YCbCr {self.subsampling}"
        if self.colour == "rgb":
            return "RGB" if self.subsampling == "4:4:4" else f"RGB {self.subsampling}"
        return {"grey": "grey", "cmyk": "CMYK"}.get(self.colour, self.colour)


@dataclass(frozen=True)
class JpegHeader:
    """What a JPEG stream's segments before its first scan say.

    ``sof``: the frame marker (None without one); ``precision``: bits per sample; ``components``:
    (id, h, v) per component; ``adobe_transform``: the last Adobe APP14 transform flag (None
    without one); ``jfif``: whether a JFIF APP0 is present; ``colour_segments``: (start, end) byte
    spans of the JFIF and Adobe segments, which decide the colour space of an untold decoder;
    ``scan_at``: the byte where the first scan (or the end of the headers) begins.
    """

    sof: int | None
    precision: int
    components: tuple[tuple[int, int, int], ...]
    adobe_transform: int | None
    jfif: bool
    colour_segments: tuple[tuple[int, int], ...]
    scan_at: int

    def untold_colour(self) -> str | None:
        """The colour space libjpeg (and decoders that follow it: nvJPEG, nvImageCodec) gives a
        3-component stream when not told one: JFIF, then the Adobe transform flag, then component
        ids R, G, B, else YCbCr. None for other component counts."""
        if len(self.components) != 3:
            return None
        if self.jfif:
            return "ycbcr"
        if self.adobe_transform is not None:
            return "rgb" if self.adobe_transform == 0 else "ycbcr"
        ids = [c for c, _, _ in self.components]
        return "rgb" if ids == [ord("R"), ord("G"), ord("B")] else "ycbcr"


def read_header(stream: bytes) -> JpegHeader:
    """The :class:`JpegHeader` of ``stream`` (tables spliced in or not: only headers are read).

    Raises ValueError where the headers are malformed.
    """
    if len(stream) < 4 or stream[0] != 0xFF or stream[1] != 0xD8:
        raise ValueError("not a JPEG stream (no SOI marker)")
    i, sof, precision, comps, transform, jfif, spans = 2, None, 8, (), None, False, []
    n = len(stream)
    while i + 4 <= n:
        if stream[i] != 0xFF:
            raise ValueError(f"expected a marker at byte {i}, found 0x{stream[i]:02x}")
        marker = stream[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan or end of image: the headers are over
            break
        length = int.from_bytes(stream[i + 2 : i + 4], "big")
        if length < 2 or i + 2 + length > n:
            raise ValueError(f"segment 0x{marker:02x} at byte {i} runs past the stream's end")
        body = stream[i + 4 : i + 2 + length]
        if marker in _SOF_MARKERS and len(body) >= 6:
            sof, precision, count = marker, body[0], body[5]
            if len(body) < 6 + 3 * count:
                raise ValueError("frame header shorter than its component count")
            comps = tuple((body[6 + 3 * k], body[7 + 3 * k] >> 4, body[7 + 3 * k] & 15) for k in range(count))
        elif marker == 0xEE and body[:5] == b"Adobe" and len(body) >= 12:
            transform = body[11]
            spans.append((i, i + 2 + length))
        elif marker == 0xE0 and body[:5] == b"JFIF\x00":
            jfif = True
            spans.append((i, i + 2 + length))
        i += 2 + length
    return JpegHeader(sof, precision, comps, transform, jfif, tuple(spans), min(i, n))


def _adobe_segment(transform: int) -> bytes:
    """An Adobe APP14 segment (version 100, no flags) with ``transform`` (0: none, 1: YCbCr)."""
    return b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00" + bytes([transform])


def told_stream(stream: bytes, colour: str, header: JpegHeader | None = None) -> bytes:
    """``stream`` whose markers say ``colour`` (``"rgb"`` or ``"ycbcr"``) to any decoder.

    The container decides a stored JPEG's colour space (TIFF Photometric, DICOM Photometric
    Interpretation), as libtiff and OpenSlide decode it, whatever the stream's own markers say.
    A decoder that takes no colour space (simplejpeg, which reports corrupt data; nvJPEG) follows
    the markers instead (:meth:`JpegHeader.untold_colour`): where they disagree, the JFIF and Adobe
    segments are dropped and an Adobe segment with the container's transform put after SOI. The
    stream is returned as it is where they agree (the usual case) or it is not 3-component.
    Hand-written because no JPEG decoder binding exposes both libjpeg's ``jpeg_color_space`` and
    its corrupt-data warnings. Raises ValueError for malformed headers or samples of other
    than 8 bits.
    """
    header = read_header(stream) if header is None else header
    if header.precision != 8:
        raise ValueError(f"{header.precision}-bit JPEG stream; expected 8-bit samples")
    untold = header.untold_colour()
    if untold is None or untold == colour:
        return stream
    pieces, pos = [stream[:2], _adobe_segment(0 if colour == "rgb" else 1)], 2
    for start, end in header.colour_segments:
        pieces.append(stream[pos:start])
        pos = end
    pieces.append(stream[pos:])
    return b"".join(pieces)


def jpeg_kind(stream: bytes, photometric: str | None = None) -> JpegKind:
    """The kind of a self-contained JPEG stream (tables spliced in or not: only headers are read).

    ``photometric``: what the container says (TIFF ``"YCBCR"``/``"RGB"``/``"MINISBLACK"``, DICOM
    ``"YBR_FULL_422"``/``"YBR_FULL"``/``"RGB"``), which decides the colour space as the
    container's readers (libtiff, OpenSlide, tifffile) apply it; without it the stream's markers
    decide as libjpeg does (:meth:`JpegHeader.untold_colour`). Raises ValueError for a stream without a frame header.
    """
    header = read_header(stream)
    sof, comps = header.sof, header.components
    if sof is None or not comps:
        raise ValueError("JPEG stream has no frame header before its first scan")
    baseline = sof in (0xC0, 0xC1)
    if len(comps) == 1:
        return JpegKind("grey", None, baseline, "markers")
    if len(comps) == 4:
        return JpegKind("cmyk", None, baseline, "markers")
    factors = (comps[0][1] // max(comps[1][1], 1), comps[0][2] // max(comps[1][2], 1)) if len(comps) >= 2 else (1, 1)
    same_chroma = all((h, v) == (comps[1][1], comps[1][2]) for _, h, v in comps[1:])
    subsampling = _SUBSAMPLING.get(factors, "other") if same_chroma else "other"
    p = (photometric or "").upper()
    if p in ("RGB",):
        return JpegKind("rgb", subsampling, baseline, "tag")
    if p.startswith("YCBCR") or p.startswith("YBR"):
        return JpegKind("ycbcr", subsampling, baseline, "tag")
    return JpegKind(header.untold_colour() or "ycbcr", subsampling, baseline, "markers")


def stream_parts(tables: bytes | np.ndarray | None, data: Any) -> tuple:
    """The pieces of a TIFF JPEG tile as a self-contained stream: the level's JPEGTables spliced in.

    tables: SOI ... EOI; tile: SOI ... EOI. Result: SOI + tables body + tile body.
    ``data``: bytes or a uint8 array (the pieces are slices of it).
    """
    if tables is None or len(tables) < 4 or len(data) < 2:
        return (data,)
    return data[:2], tables[2:-2], data[2:]


def with_tables(tables: bytes | None, data: bytes) -> bytes:
    """A TIFF JPEG tile as a self-contained JPEG stream (:func:`stream_parts`)."""
    return b"".join(stream_parts(tables, data))


# How a whole JPEG stream ends: its EOI marker (FF D9), or that and the one 0x00 pad byte DICOM adds
# to an odd-length frame.
EOI_ENDINGS = (b"\xff\xd9", b"\xff\xd9\x00")


def stream_ends_with_eoi(data: bytes) -> bool:
    """Whether the stream ``data`` ends as :data:`EOI_ENDINGS` says (one stream; :func:`ends_with_eoi`
    checks many in one array)."""
    return data.endswith(EOI_ENDINGS)


def ends_with_eoi(buf: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Whether each stream ``buf[starts[k] : starts[k] + counts[k]]`` ends as :data:`EOI_ENDINGS`
    says (array operations over every stream at once; :func:`stream_ends_with_eoi` checks one)."""
    ends = starts + counts
    ok = np.zeros(len(starts), bool)
    for pad in (0, 1):
        fit = counts >= 2 + pad
        e = np.where(fit, ends - pad, 2)
        tail = (buf[np.maximum(e - 2, 0)] == 0xFF) & (buf[np.maximum(e - 1, 0)] == 0xD9)
        if pad:
            tail &= buf[np.maximum(ends - 1, 0)] == 0
        ok |= fit & tail
    return ok


def same_headers(buf: np.ndarray, starts: np.ndarray, counts: np.ndarray, ref: np.ndarray | None) -> np.ndarray:
    """Whether each stream of ``buf`` begins with the header bytes ``ref`` (all False without one)."""
    if ref is None or not len(ref):
        return np.zeros(len(starts), bool)
    fit = counts >= len(ref)
    idx = np.minimum(starts[:, None] + np.arange(len(ref))[None, :], len(buf) - 1)
    return fit & (buf[idx] == ref[None, :]).all(axis=1)


__all__ = [
    "JpegHeader",
    "JpegKind",
    "EOI_ENDINGS",
    "ends_with_eoi",
    "jpeg_kind",
    "read_header",
    "same_headers",
    "stream_ends_with_eoi",
    "stream_parts",
    "told_stream",
    "with_tables",
]
