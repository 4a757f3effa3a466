"""A DICOM file's first elements, read once: which object and slide it is, and whether the dicom
reader reads it.

Finding a series' files means looking at every file of its folder, and a run asks more than once
(which reader takes the file, whether it refuses the series, opening it): each file's first
elements, up to its pyramid's focal planes and optical paths, are read once (a few hundred bytes
to a few KiB, whatever the file's size) and kept by the file's identity (device, inode, size,
modification time), so a changed file is read again. A slide is a series' images of one
PyramidUID and ContainerIdentifier: two scans sharing a SeriesInstanceUID are two slides.
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import pydicom
import pydicom.filereader
from pydicom.dataset import Dataset
from pydicom.uid import JPEGBaseline8Bit, VLWholeSlideMicroscopyImageStorage

from ..errors import SpecialFileError
from ..special_files import open_regular, open_regular_fd

# Headlines kept: every file of the largest folder looked at (dicom_file.MAX_FOLDER_FILES), a
# few hundred bytes each.
MAX_KEPT = 1 << 16
# Photometric interpretation of JPEG frames -> how they are stored (TIFF's names).
PHOTOMETRIC = {"YBR_FULL_422": "YCBCR", "YBR_FULL": "YCBCR", "RGB": "RGB"}
# The last element read: NumberOfOpticalPaths (0048,0302) and TotalPixelMatrixFocalPlanes (0048,0303)
# come after every other tag of the headline; the per-frame positions (5200,9230) are not read.
_LAST_TAG = 0x00480303
_TAGS = [
    0x00080008,  # ImageType
    0x00080016,  # SOPClassUID
    0x00080019,  # PyramidUID
    0x0020000E,  # SeriesInstanceUID
    0x00280002,  # SamplesPerPixel
    0x00280004,  # PhotometricInterpretation
    0x00280100,  # BitsAllocated
    0x00400512,  # ContainerIdentifier
    0x00480006,  # TotalPixelMatrixColumns
    0x00480007,  # TotalPixelMatrixRows
    0x00480302,  # NumberOfOpticalPaths
    0x00480303,  # TotalPixelMatrixFocalPlanes
]


class CappedReader(io.BufferedReader):
    """A file whose large reads ask for no more than is left in it: a forged element length
    makes pydicom read short (and fail) instead of allocating what the length claims."""

    def __init__(self, path: str):
        super().__init__(io.FileIO(open_regular_fd(path), "rb"))
        self._size = os.fstat(self.fileno()).st_size

    def read(self, size: int | None = -1, /) -> bytes:
        if size is not None and size > 1 << 16:
            size = max(0, min(size, self._size - self.tell()))
        return super().read(size)


@dataclass(frozen=True, slots=True)
class Headline:
    """What a DICOM file's first elements say: its SOP class, the slide it belongs to (series,
    pyramid, container), its image type (value 3 of ImageType), total pixel matrix, and what about
    it the dicom reader does not read (:func:`level_refusal`; None: nothing)."""

    sop: str
    series: str | None
    pyramid: str | None
    container: str | None
    image_type: str
    width: int
    height: int
    refusal: str | None

    @property
    def is_wsi(self) -> bool:
        return self.sop == VLWholeSlideMicroscopyImageStorage

    @property
    def slide(self) -> tuple[str | None, str | None, str | None]:
        """Which slide the file is an image of: (SeriesInstanceUID, PyramidUID, ContainerIdentifier)."""
        return self.series, self.pyramid, self.container

    def of_slide(self, slide: tuple[str | None, str | None, str | None]) -> bool:
        """Whether the file is an image of ``slide`` (a :attr:`slide`): its series, and its pyramid and
        container where it names them (a label or overview may leave them out)."""
        return self.series == slide[0] and all(
            mine is None or mine == theirs for mine, theirs in zip(self.slide[1:], slide[1:], strict=True)
        )


def is_dicom_file(path: str) -> bool:
    """Whether ``path`` is a regular file with the DICOM preamble's ``DICM`` at byte 128."""
    try:
        with open_regular(path) as f:
            head = f.read(132)
    except (OSError, SpecialFileError):
        return False
    return len(head) == 132 and head[128:] == b"DICM"


_kept: OrderedDict[tuple[int, ...], Headline | None] = OrderedDict()
_kept_lock = threading.Lock()


def headline(path: str) -> Headline | None:
    """The :class:`Headline` of the DICOM file at ``path``, read once per file identity (the
    answer kept for the next question); None where it is not a DICOM file with a SOP class, or
    cannot be read. Never opens a FIFO or device."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not os.path.isfile(path):
        return None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _kept_lock:
        if key in _kept:
            _kept.move_to_end(key)
            return _kept[key]
    found = read_headline(path)
    with _kept_lock:
        _kept[key] = found
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    return found


def read_headline(path: str) -> Headline | None:
    """:func:`headline`, read from the file now."""
    if not is_dicom_file(path):
        return None
    try:
        with CappedReader(path) as f:
            ds = pydicom.filereader.read_partial(
                f, stop_when=lambda tag, vr, length: tag > _LAST_TAG, specific_tags=_TAGS
            )
            sop = ds.get("SOPClassUID")
            if not sop:
                return None
            values = ds.get("ImageType") or []
            return Headline(
                str(sop),
                _text(ds, "SeriesInstanceUID"),
                _text(ds, "PyramidUID"),
                _text(ds, "ContainerIdentifier"),
                str(values[2]).upper() if len(values) > 2 else "",
                int(ds.get("TotalPixelMatrixColumns") or 0),
                int(ds.get("TotalPixelMatrixRows") or 0),
                level_refusal(ds),
            )
    except Exception:  # damaged: pydicom raises many types
        return None


def _text(ds: Dataset, name: str) -> str | None:
    value = str(ds.get(name) or "").strip()
    return value or None


def level_refusal(ds: Dataset) -> str | None:
    """What about a level's header the reader does not read (OpenSlide may), or None."""
    meta = getattr(ds, "file_meta", None)
    syntax = meta.get("TransferSyntaxUID") if meta is not None else None
    if syntax != JPEGBaseline8Bit:
        name = getattr(syntax, "name", None) or str(syntax)
        return f"its frames are {name} (this reader reads JPEG Baseline, {JPEGBaseline8Bit})"
    photometric = str(ds.get("PhotometricInterpretation", ""))
    if photometric not in PHOTOMETRIC:
        return f"photometric interpretation {photometric!r} (expected one of {', '.join(PHOTOMETRIC)})"
    if ds.get("SamplesPerPixel") != 3 or ds.get("BitsAllocated") != 8:
        return f"{ds.get('SamplesPerPixel')} samples of {ds.get('BitsAllocated')} bits (expected 3 of 8)"
    for name, what in (("TotalPixelMatrixFocalPlanes", "focal planes"), ("NumberOfOpticalPaths", "optical paths")):
        if int(ds.get(name) or 1) != 1:
            return f"{ds.get(name)} {what} (this reader reads one)"
    return None


def sop_name(uid: str) -> str:
    """A SOP class UID with its name, where pydicom knows it."""
    name = pydicom.uid.UID(uid).name
    return f"{uid} ({name})" if name != uid else uid
