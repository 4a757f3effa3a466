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

Checks beyond OpenSlide, which would read such pages as levels, miss them or
refuse the file, each recorded in ``TiffPyramid.notes``:

- a generic TIFF's page 0 whose SubIFDs hold reduced copies of it (as
  tifffile's ``subifds=`` and libvips' ``tiffsave --subifd`` write a pyramid)
  has those as its levels: OpenSlide sees level 0 alone and a run would decode
  all of it for a tissue mask;
- page 0 is level 0 whatever else the file holds: a page larger than it, of
  another aspect ratio (a tiled label or macro) or, in SubIFDs, of another
  kind (not tiled, other samples, other flags) is not a level;
- Aperio levels out of order are sorted by size (OpenSlide refuses the file).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tifffile

from .base import level_shape_agrees
from .tiff_file import page_name

APERIO_PREFIX = "Aperio"
# Pixels by which a level's width or height may differ from level 0's divided by its downsample
# (writers round each level's size up or down, some from the level above).
LEVEL_ROUNDING_PX = 2.0
_REDUCED = 1  # NewSubfileType bit 0: a reduced-resolution version of another page
# A pyramid has a few dozen levels; more SubIFDs than this on page 0 are not read as levels.
MAX_SUBIFD_LEVELS = 64
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
    """``pages[0]`` (level 0), then the others largest first (noted where ``note_order`` and they
    were not), without those larger than level 0 or whose aspect ratio is not its own."""
    first = pages[0]
    rest = sorted(pages[1:], key=lambda p: -p.imagewidth)
    if note_order and [p.treeindex for p in rest] != sorted(p.treeindex for p in rest):
        notes.append(f"pages {[page_name(p) for p in rest]} are levels out of order: sorted by size")
    w0, h0 = first.imagewidth, first.imagelength
    kept = [first]
    for p in rest:
        if p.imagewidth > w0 or p.imagelength > h0:
            notes.append(
                f"page {page_name(p)} ({p.imagewidth}x{p.imagelength}) is not a level: it is larger than "
                f"level 0 ({w0}x{h0}, page {page_name(first)})"
            )
        elif level_shape_agrees(w0, h0, p.imagewidth, p.imagelength, LEVEL_ROUNDING_PX):
            kept.append(p)
        else:
            notes.append(
                f"page {page_name(p)} ({p.imagewidth}x{p.imagelength}) is not a level: its aspect ratio is not "
                f"level 0's ({w0}x{h0})"
            )
    return kept


def _subifd_levels(tif: tifffile.TiffFile, page0: tifffile.TiffPage, notes: list[str]) -> list[tifffile.TiffPage]:
    """The SubIFDs of ``page0`` that are reduced copies of it: tiled, of its samples and type,
    flagged reduced-resolution or not flagged at all; the others noted and passed over."""
    offsets = tuple(page0.subifds or ())
    if len(offsets) > MAX_SUBIFD_LEVELS:
        notes.append(f"page 0 lists {len(offsets)} SubIFDs, more than {MAX_SUBIFD_LEVELS}: none read as levels")
        return []
    size = tif.filehandle.size
    pages = []
    for i, offset in enumerate(offsets):
        where = f"page 0/SubIFD {i}"
        if not 8 <= offset < size:
            notes.append(f"{where} is not a level: its offset {offset} is outside the file ({size} bytes)")
            continue
        try:
            tif.filehandle.seek(offset)
            page = tifffile.TiffPage(tif, (page0.index, i))
        except Exception as exc:  # tifffile raises its own and struct's errors on a damaged IFD
            notes.append(f"{where} is not a level: its IFD cannot be read ({exc})")
            continue
        kind = _other_kind(page, page0)
        if kind:
            notes.append(f"{where} ({page.imagewidth}x{page.imagelength}) is not a level: {kind}")
            continue
        pages.append(page)
    return pages


def _other_kind(page: tifffile.TiffPage, page0: tifffile.TiffPage) -> str | None:
    """How ``page`` is not a reduced copy of ``page0``, or None where it is one."""
    if not page.is_tiled:
        return "it is not tiled"
    if (page.samplesperpixel, page.dtype) != (page0.samplesperpixel, page0.dtype):
        return (
            f"it holds {page.samplesperpixel} samples of {page.dtype}, level 0 {page0.samplesperpixel} of {page0.dtype}"
        )
    flags = int(page.subfiletype)
    if flags not in (0, _REDUCED):
        return f"its NewSubfileType is {flags}, not 1 (reduced resolution) or 0"
    return None


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


def _generic(tif: tifffile.TiffFile, pages: list[tifffile.TiffPage], vendor: str) -> TiffPyramid:
    notes: list[str] = []
    levels = [pages[0]] + [p for p in pages[1:] if p.is_tiled and int(p.subfiletype) & _REDUCED]
    subifds = _subifd_levels(tif, pages[0], notes) if pages[0].subifds else []
    sizes = {(p.imagewidth, p.imagelength) for p in levels}
    taken = [p for p in subifds if (p.imagewidth, p.imagelength) not in sizes]
    if taken:
        notes.append(
            f"levels taken from page 0's SubIFDs: {', '.join(page_name(p) for p in taken)} "
            "(OpenSlide reads level 0 alone)"
        )
    return TiffPyramid(vendor, _keep_consistent(levels + taken, notes, note_order=False), {}, notes)


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
    return _generic(tif, pages, "bigtiff" if tif.is_bigtiff else "tiff")


__all__ = ["TiffPyramid", "is_aperio", "tiff_pyramid"]
