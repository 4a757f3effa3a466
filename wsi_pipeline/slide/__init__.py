"""Slide access: :func:`open_slide` picks a reader backend for a file.

Backends:

- ``tifffile``: tiled TIFF / BigTIFF / OME-TIFF and Aperio SVS, stored tiles
  decoded once and cached (the fast path for tile grids);
- ``dicom``: DICOM WSI series of JPEG Baseline frames, read frame by frame
  through the same decoded-tile cache;
- ``openslide``: the other formats OpenSlide reads (NDPI, MRXS, SCN, other DICOM, ...);
- ``image``: PNG, JPEG, BMP and untiled TIFF held in memory.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ..errors import SlideError, SlideOpenError
from ..special_files import refusal, special_kind
from .base import Slide
from .image import PLAIN_IMAGE_EXTENSIONS, ImageSlide
from .tiff_file import is_cmyk, is_tiff, open_tifffile

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tifffile", "dicom", "openslide", "image")

# OpenSlide formats that are plain tiled TIFF underneath and that the tifffile reader decodes to
# the same pixels (tests/test_storage_kinds.py compares them with OpenSlide's), only faster.
# Aperio SVS: its pyramid is tifffile's "Baseline" series; the thumbnail, label and macro pages are
# series of their own, never read as levels.
_TIFF_COMPATIBLE_VENDORS = {None, "generic-tiff", "aperio"}


def _open_backend(path: str, backend: str) -> Slide:
    if backend == "image":
        return ImageSlide(path)
    if backend == "tifffile":
        from .tiff_backend import TiffSlide

        return TiffSlide(path)
    if backend == "dicom":
        from .dicom_backend import DicomSlide

        return DicomSlide(path)
    if backend == "openslide":
        from .openslide_backend import OpenSlideSlide

        return OpenSlideSlide(path)
    raise ValueError(f"unknown slide backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise SlideOpenError(path, "no such file")
    if os.path.isdir(path):
        return  # DICOM series are folders; their reader decides.
    if kind := special_kind(path):  # a FIFO's open would wait for a writer
        raise SlideOpenError(path, refusal(kind))
    if not os.access(path, os.R_OK):
        raise SlideOpenError(path, "file is not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise SlideOpenError(path, "file is empty (0 bytes)")


def _dicom_refusal(path: str) -> str | SlideOpenError | None:
    """Why the dicom reader does not read ``path`` (a reason, or the error it raises); None: it does."""
    from .dicom_file import is_dicom_wsi, series_refusal

    if not is_dicom_wsi(path):
        return "not a DICOM WSI"
    try:
        refusal = series_refusal(path)
    except SlideOpenError as exc:
        refusal = exc
    if refusal is not None:
        log.info("%s: not read with the dicom reader: %s", path, refusal)
    return refusal


def detect_backend(path: str) -> str:
    """The fastest backend that reads ``path`` ("tifffile", "dicom", "openslide" or "image")."""
    _check_file(path)
    ext = os.path.splitext(path)[1].lower()
    if ext in PLAIN_IMAGE_EXTENSIONS:
        return "image"
    dicom_refusal = _dicom_refusal(path)
    if dicom_refusal is None:
        return "dicom"
    vendor: str | None = None
    try:
        import openslide

        vendor = openslide.OpenSlide.detect_format(path)
    except Exception:
        vendor = None
    if os.path.isfile(path) and is_tiff(path) and vendor in _TIFF_COMPATIBLE_VENDORS:
        with open_tifffile(path) as tif:
            tiled = bool(tif.series) and tif.series[0].keyframe.is_tiled
            if tiled and is_cmyk(tif.series[0].keyframe):  # OpenSlide alone turns inks into RGB
                return "openslide"
        return "tifffile" if tiled else "image"
    if vendor is not None:
        return "openslide"
    if isinstance(dicom_refusal, SlideOpenError):
        raise dicom_refusal
    raise SlideOpenError(
        path,
        "no reader recognises this file (expected a whole-slide format OpenSlide reads, "
        "a TIFF, or a PNG/JPEG/BMP image)",
    )


def open_slide(path: str | os.PathLike[str], backend: str = "auto") -> Slide:
    """Open a slide file with ``backend`` ("auto" picks the fastest that reads it).

    The result is a context manager; see :class:`Slide` for its API. Any
    failure to open the file is raised as :class:`SlideOpenError` (a
    :class:`SlideError`) naming it.

    >>> import tempfile, cv2, numpy as np, os
    >>> p = os.path.join(tempfile.mkdtemp(), "frame.png")
    >>> _ = cv2.imwrite(p, np.zeros((48, 64, 3), np.uint8))
    >>> with open_slide(p) as s:
    ...     s.dimensions, s.level_count, s.backend
    ((64, 48), 1, 'image')
    """
    path = os.fspath(path)
    if backend not in BACKENDS:
        raise ValueError(f"unknown slide backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    try:
        _check_file(path)
        if backend == "auto":
            backend = detect_backend(path)
        return _open_backend(path, backend)
    except SlideError:
        raise
    except MemoryError as exc:
        raise SlideOpenError(path, f"opening it as a {backend} slide needs more memory than is available") from exc
    except Exception as exc:  # the one boundary: whatever a reader library raises on a bad file
        raise SlideOpenError(path, f"cannot be opened as a {backend} slide ({type(exc).__name__}: {exc})") from exc


def as_slide(source: str | os.PathLike[str] | Slide | np.ndarray, backend: str = "auto") -> Slide:
    """A :class:`Slide` from a path, an open slide (returned as is) or an RGB array."""
    if isinstance(source, Slide):
        return source
    if isinstance(source, np.ndarray):
        return ImageSlide.from_array(source)
    return open_slide(source, backend)


__all__ = ["Slide", "ImageSlide", "open_slide", "as_slide", "detect_backend", "BACKENDS"]
