"""Which pages of a TIFF are its pyramid levels and associated images, by OpenSlide's rules.

tifffile's series heuristics guess a pyramid from page shapes and flags, and
other writers' files defeat them: an SVS whose reduced pages are flagged
NewSubfileType 1 came out as one level, one without a thumbnail lost its 4x
level. OpenSlide's rules are the reference for what a slide file holds:

- Aperio (page 0 tiled, ImageDescription starting with "Aperio"): every tiled
  page of the main chain is a level, whatever its NewSubfileType; stripped
  pages are associated images: page 1 is the thumbnail, others the label
  (NewSubfileType 1) or the macro (NewSubfileType 9), else not shown.
- Generic tiled TIFF: page 0 and every tiled page flagged reduced-resolution
  (NewSubfileType bit 0), largest first; no associated images.
- OME-TIFF: the levels of the first image's SubIFDs (OME's own pyramid rule,
  which tifffile follows; OpenSlide reads such a file as generic TIFF and sees
  its level 0 only).

Two checks go beyond OpenSlide, which would read such pages as levels or
refuse the file: a tiled page whose aspect ratio is not level 0's within
rounding (a tiled label or macro) is not a level, and Aperio levels out of
order are sorted by size (OpenSlide refuses the file). Each is recorded in
``TiffPyramid.notes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tifffile

from .base import level_shape_agrees

APERIO_PREFIX = "Aperio"
# Pixels by which a level's width or height may differ from level 0's divided by its downsample
# (writers round each level's size up or down, some from the level above).
LEVEL_ROUNDING_PX = 2.0
_REDUCED = 1  # NewSubfileType bit 0: a reduced-resolution version of another page
_APERIO_ASSOCIATED = {1: "label", 9: "macro"}


@dataclass
class TiffPyramid:
    """A TIFF's ``vendor`` ("aperio", "ome-tiff", "tiff"), its level pages (largest first), its
    associated images by name, and ``notes``: pages set apart from OpenSlide's rule, and why."""

    vendor: str
    levels: list[tifffile.TiffPage]
    associated: dict[str, tifffile.TiffPage] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def is_aperio(page0: tifffile.TiffPage) -> bool:
    """OpenSlide's test for an Aperio slide: page 0 tiled, its description starting "Aperio"."""
    return bool(page0.is_tiled) and (page0.description or "").startswith(APERIO_PREFIX)


def _main_chain(tif: tifffile.TiffFile) -> list[tifffile.TiffPage]:
    tif.pages.useframes = False
    return [p for p in tif.pages if isinstance(p, tifffile.TiffPage)]


def _keep_consistent(
    pages: list[tifffile.TiffPage], notes: list[str], note_order: bool = True
) -> list[tifffile.TiffPage]:
    """``pages`` largest first (noted where ``note_order`` and they were not), without those whose
    aspect ratio is not the largest's."""
    pages = sorted(pages, key=lambda p: -p.imagewidth)
    if note_order and [p.index for p in pages] != sorted(p.index for p in pages):
        notes.append(f"pages {[p.index for p in pages]} are levels out of order: sorted by size")
    w0, h0 = pages[0].imagewidth, pages[0].imagelength
    kept = [pages[0]]
    for p in pages[1:]:
        if level_shape_agrees(w0, h0, p.imagewidth, p.imagelength, LEVEL_ROUNDING_PX):
            kept.append(p)
        else:
            notes.append(
                f"page {p.index} ({p.imagewidth}x{p.imagelength}) is not a level: its aspect ratio is not "
                f"level 0's ({w0}x{h0})"
            )
    return kept


def _aperio(pages: list[tifffile.TiffPage]) -> TiffPyramid:
    notes: list[str] = []
    tiled = [p for p in pages if p.is_tiled]
    associated: dict[str, tifffile.TiffPage] = {}
    for i, p in enumerate(pages):
        if p.is_tiled:
            continue
        name = "thumbnail" if i == 1 else _APERIO_ASSOCIATED.get(int(p.subfiletype))
        if name is not None and name not in associated:
            associated[name] = p
    return TiffPyramid("aperio", _keep_consistent(tiled, notes), associated, notes)


def _generic(pages: list[tifffile.TiffPage], vendor: str) -> TiffPyramid:
    notes: list[str] = []
    levels = [pages[0]] + [p for p in pages[1:] if p.is_tiled and int(p.subfiletype) & _REDUCED]
    return TiffPyramid(vendor, _keep_consistent(levels, notes, note_order=False), {}, notes)


def _ome(tif: tifffile.TiffFile) -> TiffPyramid:
    series = tif.series[0]
    pages = [lvl.keyframe for lvl in series.levels] if series.levels else [series.keyframe]
    notes: list[str] = []
    return TiffPyramid("ome-tiff", _keep_consistent(pages, notes), {}, notes)


def tiff_pyramid(tif: tifffile.TiffFile) -> TiffPyramid:
    """The levels and associated images of ``tif`` (module docstring); its page 0 is level 0.

    Raises ValueError where the file holds no page.
    """
    pages = _main_chain(tif)
    if not pages:
        raise ValueError("TIFF holds no image")
    if is_aperio(pages[0]):
        return _aperio(pages)
    if tif.is_ome and tif.series:
        return _ome(tif)
    return _generic(pages, "bigtiff" if tif.is_bigtiff else "tiff")


__all__ = ["TiffPyramid", "is_aperio", "tiff_pyramid"]
