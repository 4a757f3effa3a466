"""A DICOM whole-slide image's files: the series found, each level's header checked, its frames located.

A VL Whole Slide Microscopy series is a file per pyramid level (and files
for its label, overview and thumbnail images), in one folder. A slide is
opened from the folder or from any file of the series: the other files of
the folder with the same SeriesInstanceUID, PyramidUID and
ContainerIdentifier are its other levels (each file's first elements read
once, :mod:`.dicom_headline`).

Each level's encapsulated JPEG frames are located once at open by walking
the item headers of its Pixel Data (8 bytes read per frame; no pixel data
is read), after the header's claims (frame count, tile and matrix sizes)
are checked against the file's size, so a forged header costs neither
memory nor time beyond the file's own size. :func:`level_refusal` names what
the reader does not read (another transfer syntax, several focal planes,
frames split over several fragments ...); those slides go to OpenSlide.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pydicom
from pydicom.dataset import Dataset

from ..errors import SlideOpenError
from .dicom_headline import PHOTOMETRIC, CappedReader, Headline, headline, level_refusal, sop_name
from .tiff_file import MAX_TILE_BYTES, MAX_TILE_SIDE, small_tiles_refusal

# A level's grid of stored tiles (and so its offset tables, 16 bytes a tile) is at most this many
# tiles: 8M tiles of 256 px cover 5.5e11 pixels, far beyond any scan.
MAX_GRID_TILES = 1 << 23
# Whole-slide files of a folder looked at to find a series' other levels, and files of a folder
# looked at to find those (the first elements of each read once: 0.3 ms a file, 20 s for all).
MAX_SERIES_FILES = 4096
MAX_FOLDER_FILES = 1 << 16
# Image types (value 3 of ImageType) that are not pyramid levels.
NOT_LEVELS = ("LABEL", "OVERVIEW", "THUMBNAIL")

_ITEM = b"\xfe\xff\x00\xe0"  # (FFFE,E000) little endian
_SEQUENCE_END = b"\xfe\xff\xdd\xe0"  # (FFFE,E0DD)
_PIXEL_DATA = b"\xe0\x7f\x10\x00"  # (7FE0,0010)


def is_dicom_wsi(path: str) -> bool:
    """Whether ``path`` is a DICOM WSI file, or a folder holding one (first elements only)."""
    if os.path.isdir(path):
        return bool(_dicom_files(path))
    found = headline(path)
    return found is not None and found.is_wsi


def read_header(path: str, tags: list[str] | None = None) -> tuple[Dataset, int]:
    """A DICOM file's header up to its pixel data (only ``tags`` where given), and where its pixel data starts."""
    try:
        with CappedReader(path) as f:
            ds = pydicom.dcmread(f, stop_before_pixels=True, specific_tags=tags)
            list(ds)  # values are converted when first used: a damaged one fails here, named as such
            return ds, f.tell()
    except Exception as exc:  # pydicom raises many types on a damaged header
        raise SlideOpenError(path, f"unreadable DICOM header ({type(exc).__name__}: {exc})") from exc


def not_a_slide(path: str) -> str | None:
    """What the file at ``path`` is where it is a DICOM object other than a whole-slide image
    (a Secondary Capture, annotations ...); None for any other file."""
    found = headline(path)
    if found is None or found.is_wsi:
        return None
    return f"a DICOM object of SOP class {sop_name(found.sop)}, not a VL Whole Slide Microscopy image"


def _dicom_files(folder: str) -> dict[str, Headline]:
    """The first :data:`MAX_SERIES_FILES` VL Whole Slide Microscopy files of ``folder`` by name, with
    their headlines, among its first :data:`MAX_FOLDER_FILES` files: other DICOM objects (thousands
    of Secondary Captures, say) cost a short read each (:func:`.dicom_headline.headline`) and never
    crowd the slide out."""
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    paths = [p for p in (os.path.join(folder, n) for n in names) if os.path.isfile(p)][:MAX_FOLDER_FILES]
    wsi = {p: found for p in paths if (found := headline(p)) is not None and found.is_wsi}
    return dict(list(wsi.items())[:MAX_SERIES_FILES])


# What OpenSlide names a series' associated images, by image type.
ASSOCIATED_NAMES = {"LABEL": "label", "OVERVIEW": "macro", "THUMBNAIL": "thumbnail"}


def series_level_files(path: str) -> list[str]:
    """The files of the pyramid levels of the WSI series at ``path`` (folder or file), largest first.

    Label, overview and thumbnail images are left out. Raises SlideOpenError
    naming ``path`` where it holds no WSI series, several, or two levels of one size.
    """
    return series_files(path)[0]


def series_files(path: str) -> tuple[list[str], dict[str, str]]:
    """(:func:`series_level_files`, the series' associated images: ``{name: file}`` by OpenSlide's
    names, "label", "macro" (OVERVIEW), "thumbnail"). A slide is the series' images of one pyramid
    and container (:attr:`.dicom_headline.Headline.slide`): another scan of the same series is
    another slide, never a level of this one."""
    if os.path.isdir(path):
        headlines = _dicom_files(path)
        slides = {h.slide for h in headlines.values() if h.series and h.image_type not in NOT_LEVELS}
        if len(slides) != 1:
            found = "no" if not slides else f"{len(slides)}"
            raise SlideOpenError(
                path,
                f"folder holds {found} DICOM WSI slides (by series, pyramid and container; expected one: "
                "open a file of one)",
            )
        slide = slides.pop()
    else:
        own = headline(path)
        if own is None or not own.is_wsi:
            raise SlideOpenError(path, "not a DICOM VL Whole Slide Microscopy image")
        others = _dicom_files(os.path.dirname(os.path.abspath(path)))
        headlines = {p: h for p, h in others.items() if not os.path.samefile(p, path)}
        headlines[path] = own
        slide = own.slide
        if own.image_type in NOT_LEVELS:  # a label names its slide's pyramid and container, or not
            slides = {h.slide for h in headlines.values() if h.image_type not in NOT_LEVELS and own.of_slide(h.slide)}
            slide = slides.pop() if len(slides) == 1 else slide
    levels: dict[tuple[int, int], str] = {}
    associated: dict[str, str] = {}
    for p, found in headlines.items():
        if found.image_type in NOT_LEVELS:
            if found.of_slide(slide):
                associated.setdefault(ASSOCIATED_NAMES[found.image_type], p)
            continue
        if found.slide != slide:
            continue
        size = (found.width, found.height)
        if size in levels:
            raise SlideOpenError(
                path,
                f"two images of the series are {size[0]}x{size[1]} ({os.path.basename(levels[size])}, "
                f"{os.path.basename(p)}): concatenations, focal planes or duplicates are not read by this reader",
            )
        levels[size] = p
    if not levels:
        raise SlideOpenError(path, "the DICOM WSI series holds no VOLUME image")
    return [levels[size] for size in sorted(levels, key=lambda s: (-s[0] * s[1], -s[0]))], associated


def series_refusal(path: str) -> str | None:
    """:func:`level_refusal` of the first level that has one, naming its file; None: all are read."""
    for p in series_level_files(path):
        found = headline(p)
        reason = found.refusal if found is not None else "its first elements cannot be read"
        if reason is not None:
            return f"{os.path.basename(p)}: {reason}"
    return None


@dataclass
class DicomLevel:
    """One pyramid level: its file, geometry and frames' places (the stored-tile reader's level record)."""

    path: str
    header: Dataset
    width: int
    height: int
    tile_w: int
    tile_h: int
    tiles_across: int
    tiles_down: int
    offsets: np.ndarray  # per grid tile (ty * tiles_across + tx): the frame's first byte
    bytecounts: np.ndarray  # per grid tile: the frame's bytes (0: no frame, background)
    photometric: str  # "YCBCR" or "RGB"
    jpegtables: bytes | None = None


def read_level(path: str, fd: int) -> DicomLevel:
    """The level in the DICOM file ``path`` (open as ``fd``), checked; SlideOpenError naming what is wrong."""

    def bad(reason: str) -> SlideOpenError:
        return SlideOpenError(path, reason)

    file_size = os.fstat(fd).st_size
    ds, pixel_data_at = read_header(path)
    reason = level_refusal(ds)
    if reason is not None:
        raise bad(f"{reason}; open it with the openslide backend")
    width, height = int(ds.get("TotalPixelMatrixColumns") or 0), int(ds.get("TotalPixelMatrixRows") or 0)
    tile_w, tile_h = int(ds.get("Columns") or 0), int(ds.get("Rows") or 0)
    if width < 1 or height < 1:
        raise bad(f"total pixel matrix claims {width}x{height} pixels")
    if not (1 <= tile_w <= MAX_TILE_SIDE and 1 <= tile_h <= MAX_TILE_SIDE and tile_w * tile_h * 3 <= MAX_TILE_BYTES):
        raise bad(
            f"frames claim {tile_w}x{tile_h} pixels; expected sides of at most {MAX_TILE_SIDE} px and at most "
            f"{MAX_TILE_BYTES // 2**20} MiB decoded (forged or damaged frame geometry)"
        )
    across, down = math.ceil(width / tile_w), math.ceil(height / tile_h)
    reason = small_tiles_refusal(width, height, tile_w, tile_h)
    if reason is not None:
        raise bad(reason)
    if across * down > MAX_GRID_TILES:
        raise bad(
            f"{width}x{height} pixels in {tile_w}x{tile_h} frames is {across * down} tiles "
            f"(at most {MAX_GRID_TILES}; forged or damaged geometry)"
        )
    frames = int(ds.get("NumberOfFrames") or 1)
    # Each frame takes an 8-byte item header at least.
    if not 1 <= frames <= min(across * down, (file_size - pixel_data_at) // 8):
        raise bad(
            f"claims {frames} frames; a {across}x{down} tile grid and a file of {file_size} bytes "
            f"hold at most {min(across * down, max(0, file_size - pixel_data_at) // 8)}"
        )
    starts, lengths = _frame_items(path, fd, pixel_data_at, frames, file_size)
    cells = _frame_cells(path, ds, frames, tile_w, tile_h, across, down)
    offsets = np.zeros(across * down, np.int64)
    bytecounts = np.zeros(across * down, np.int64)
    offsets[cells], bytecounts[cells] = starts, lengths
    photometric = PHOTOMETRIC[str(ds.PhotometricInterpretation)]
    return DicomLevel(path, ds, width, height, tile_w, tile_h, across, down, offsets, bytecounts, photometric)


def _frame_items(path: str, fd: int, at: int, frames: int, file_size: int) -> tuple[np.ndarray, np.ndarray]:
    """First byte and length of each frame's fragment, from the item headers after the offset table."""

    def bad(reason: str) -> SlideOpenError:
        return SlideOpenError(path, f"pixel data: {reason}")

    head = os.pread(fd, 12, at)
    if len(head) < 12 or head[:4] != _PIXEL_DATA:
        raise bad(f"no Pixel Data element at byte {at}")
    if head[8:12] != b"\xff\xff\xff\xff":
        raise bad("not encapsulated (defined length) although the transfer syntax is JPEG")
    starts = np.empty(frames, np.int64)
    lengths = np.empty(frames, np.int64)
    pos = at + 12
    for i in range(-1, frames + 1):  # -1: the Basic Offset Table; frames: the delimiter
        item = os.pread(fd, 8, pos)
        if len(item) < 8:
            raise bad(f"file ends at byte {file_size} inside the frame items (item {i + 1} of {frames + 1})")
        tag, n = item[:4], int.from_bytes(item[4:], "little")
        if tag == _SEQUENCE_END:
            if i == frames:
                break
            raise bad(f"holds {max(0, i)} frames, the header claims {frames}")
        if tag != _ITEM:
            raise bad(f"expected an item at byte {pos}, found tag {tag.hex()}")
        if i == frames:
            raise bad("frames are split over several fragments (not read by this reader; use the openslide backend)")
        if pos + 8 + n > file_size:
            what = "the basic offset table" if i < 0 else f"frame {i}"
            raise bad(f"{what} claims {n} bytes at byte {pos + 8}, past the end of the file ({file_size} bytes)")
        if i >= 0:
            starts[i], lengths[i] = pos + 8, n
        pos += 8 + n
    return starts, lengths


def _frame_cells(path: str, ds: Dataset, frames: int, tile_w: int, tile_h: int, across: int, down: int) -> np.ndarray:
    """The grid tile (``ty * across + tx``) of each frame: row order for TILED_FULL, else the
    frames' positions in the Per-Frame Functional Groups."""
    if ds.get("DimensionOrganizationType") == "TILED_FULL":
        if frames != across * down:
            need = across * down
            raise SlideOpenError(path, f"TILED_FULL with {frames} frames; a {across}x{down} tile grid needs {need}")
        return np.arange(frames, dtype=np.int64)
    groups = ds.get("PerFrameFunctionalGroupsSequence")
    if groups is None or len(groups) != frames:
        n = 0 if groups is None else len(groups)
        raise SlideOpenError(path, f"TILED_SPARSE with {frames} frames but {n} per-frame positions")
    cols = np.empty(frames, np.int64)
    rows = np.empty(frames, np.int64)
    for i, group in enumerate(groups):
        try:
            pos = group.PlanePositionSlideSequence[0]
            cols[i] = int(pos.ColumnPositionInTotalImagePixelMatrix) - 1
            rows[i] = int(pos.RowPositionInTotalImagePixelMatrix) - 1
        except Exception as exc:  # missing or damaged: pydicom raises many types
            raise SlideOpenError(path, f"frame {i} has no readable position in the pixel matrix") from exc
    on_grid = (cols % tile_w == 0) & (rows % tile_h == 0) & (cols >= 0) & (rows >= 0)
    on_grid &= (cols < across * tile_w) & (rows < down * tile_h)
    if not on_grid.all():
        i = int(np.flatnonzero(~on_grid)[0])
        raise SlideOpenError(
            path,
            f"frame {i} lies at pixel ({cols[i] + 1}, {rows[i] + 1}), not on the {tile_w}x{tile_h} tile grid "
            "of the pixel matrix (not read by this reader; use the openslide backend)",
        )
    cells = rows // tile_h * across + cols // tile_w
    if len(np.unique(cells)) != frames:
        raise SlideOpenError(path, "two frames lie at the same place of the pixel matrix")
    return cells
