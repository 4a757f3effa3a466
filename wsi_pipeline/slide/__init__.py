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

import os

import numpy as np

from ..errors import SlideError, SlideOpenError
from ..remote.address import is_remote
from ..special_files import link_loops, refusal, special_kind
from .base import Slide
from .image import ImageSlide
from .readers import SLIDE_READERS, SlideReader, first_reader, reader_named, reader_names
from .tiff_file import MAX_TIFF_PAGES
from .tiff_truncation import tiff_truncation

# The names of the readers of SLIDE_READERS ("tifffile", "dicom", "openslide", "image"), "auto" first.
BACKENDS = ("auto", *reader_names())


def _open_backend(path: str, backend: str) -> Slide:
    reader = reader_named(backend)
    if reader is None:
        raise ValueError(f"unknown slide backend {backend!r}; expected one of {', '.join(_backend_choices())}")
    slide = reader.open(path)
    if not isinstance(slide, Slide):  # a plugin's reader: what it gave would fail far from here
        raise SlideOpenError(
            path,
            f"slide reader {backend!r} ({reader.__module__}.{reader.__qualname__}) opened it as "
            f"{type(slide).__name__}, expected a Slide",
        )
    return slide


def _backend_choices() -> tuple[str, ...]:
    """:data:`BACKENDS` as the registry holds them now (with the readers added since import)."""
    return ("auto", *reader_names())


def _check_file(path: str) -> None:
    if link_loops(path):
        raise SlideOpenError(path, "a symbolic link that loops (it never reaches a file)")
    if not os.path.exists(path):
        raise SlideOpenError(path, "no such file")
    if os.path.isdir(path):
        try:
            with os.scandir(path) as entries:
                next(entries, None)
        except OSError as exc:
            raise SlideOpenError(path, f"folder cannot be read ({exc.strerror or exc})") from None
        return  # DICOM series are folders; their reader decides.
    if kind := special_kind(path):  # a FIFO's open would wait for a writer
        raise SlideOpenError(path, refusal(kind))
    if not os.access(path, os.R_OK):
        raise SlideOpenError(path, "file is not readable (permission denied)")
    if os.path.getsize(path) == 0:
        raise SlideOpenError(path, "file is empty (0 bytes)")


def detect_backend(path: str) -> str:
    """The fastest backend that reads ``path`` ("tifffile", "dicom", "openslide" or "image"): the
    first of :data:`~.readers.SLIDE_READERS` that reads it."""
    _check_file(path)
    return first_reader(path).name


def open_slide(path: str | os.PathLike[str], backend: str = "auto") -> Slide:
    """Open a slide file with ``backend`` ("auto" picks the fastest that reads it), or a tiled TIFF or
    SVS at a remote address (``https://``, ``http://``, ``s3://``: :mod:`.remote_tiff`).

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
    choices = _backend_choices()
    if backend not in choices:
        raise ValueError(f"unknown slide backend {backend!r}; expected one of {', '.join(choices)}")
    if is_remote(path):  # https://, http://, s3://: a tiled TIFF or SVS read by range requests
        from .remote_tiff import open_remote_slide

        return open_remote_slide(path, backend)
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
        truncated = tiff_truncation(path, MAX_TIFF_PAGES) if os.path.isfile(path) else None
        what = f"{truncated}; " if truncated else ""
        how = "cannot be opened" if backend == "auto" else f"cannot be opened as a {backend} slide"
        raise SlideOpenError(path, f"{what}{how} ({type(exc).__name__}: {exc})") from exc


def reader_may_crash(path: str | os.PathLike[str]) -> bool:
    """Whether the reader that would open ``path`` (backend "auto") may crash the process on a
    damaged file (:attr:`SlideReader.may_crash`: OpenSlide); False where no reader takes it (it
    then fails as a slide without opening it). The choice itself asks OpenSlide only for the
    file's vendor (``detect_format``), not to open it, and that in a helper process
    (:mod:`.isolated`): a crash there makes the file one no reader takes."""
    path = os.fspath(path)
    try:
        _check_file(path)
        return first_reader(path).may_crash
    except Exception:  # refused, or a reader library's error on a bad file: opening it fails the same way
        return False


def as_slide(source: str | os.PathLike[str] | Slide | np.ndarray, backend: str = "auto") -> Slide:
    """A :class:`Slide` from a path, an open slide (returned as is) or an RGB array."""
    if isinstance(source, Slide):
        return source
    if isinstance(source, np.ndarray):
        return ImageSlide.from_array(source)
    return open_slide(source, backend)


__all__ = [
    "Slide",
    "ImageSlide",
    "SlideReader",
    "SLIDE_READERS",
    "open_slide",
    "as_slide",
    "detect_backend",
    "reader_may_crash",
    "BACKENDS",
]
