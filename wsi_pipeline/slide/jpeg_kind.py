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


def _frame(stream: bytes) -> tuple[int | None, list[tuple[int, int, int]], int | None, bool]:
    """(SOF marker, components as (id, h, v), Adobe transform, JFIF present) from the headers
    before the first scan. Raises ValueError where the headers are malformed."""
    if len(stream) < 4 or stream[0] != 0xFF or stream[1] != 0xD8:
        raise ValueError("not a JPEG stream (no SOI marker)")
    i, sof, comps, transform, jfif = 2, None, [], None, False
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
            sof = marker
            count = body[5]
            if len(body) < 6 + 3 * count:
                raise ValueError("frame header shorter than its component count")
            comps = [(body[6 + 3 * k], body[7 + 3 * k] >> 4, body[7 + 3 * k] & 15) for k in range(count)]
        elif marker == 0xEE and body[:5] == b"Adobe" and len(body) >= 12:
            transform = body[11]
        elif marker == 0xE0 and body[:5] == b"JFIF\x00":
            jfif = True
        i += 2 + length
    return sof, comps, transform, jfif


def jpeg_kind(stream: bytes, photometric: str | None = None) -> JpegKind:
    """The kind of a self-contained JPEG stream (tables spliced in or not: only headers are read).

    ``photometric``: what the container says (TIFF ``"YCBCR"``/``"RGB"``/``"MINISBLACK"``, DICOM
    ``"YBR_FULL_422"``/``"YBR_FULL"``/``"RGB"``), which decides the colour space as the
    container's readers (libtiff, OpenSlide, tifffile) apply it; without it the stream's markers
    decide as libjpeg does (Adobe transform flag, then JFIF, then component identifiers R, G, B,
    else YCbCr for three components). Raises ValueError for a stream without a frame header.
    """
    sof, comps, transform, jfif = _frame(stream)
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
    if transform is not None:
        colour = "ycbcr" if transform == 1 else "rgb"
    elif jfif:
        colour = "ycbcr"
    elif [c for c, _, _ in comps[:3]] == [ord("R"), ord("G"), ord("B")]:
        colour = "rgb"
    else:
        colour = "ycbcr"
    return JpegKind(colour, subsampling, baseline, "markers")


__all__ = ["JpegKind", "jpeg_kind"]
