"""The slide readers, in the order they are asked whether they read a file.

:func:`~wsi_pipeline.slide.detect_backend` asks each reader of :data:`SLIDE_READERS` in turn
(:meth:`SlideReader.reads`, as openslide-python's ``OpenSlide.detect_format`` answers); the first
that says yes reads the file. What several readers look at (OpenSlide's vendor, a TIFF's layout)
is found once per file, when first asked, by the file's :class:`FormatProbe`.

A new reader is a :class:`SlideReader` subclass, added with :func:`register_reader`. Which files
of a folder are slides comes from the same readers (:func:`lists_slide`: each reader's
``suffixes``, or its own :meth:`SlideReader.lists` where it looks into the file).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import ClassVar

from ..errors import SlideOpenError
from ..plugins import READERS_GROUP, carry
from .base import Slide
from .image import PLAIN_IMAGE_EXTENSIONS, ImageSlide
from .tiff_file import MAX_TIFF_PAGES, is_cmyk, is_tiff, open_tifffile

log = logging.getLogger(__name__)

# OpenSlide formats that are plain tiled TIFF underneath and that the tifffile reader decodes to
# the same pixels (tests/test_storage_kinds.py compares them with OpenSlide's), only faster.
# Aperio SVS: its pyramid is tifffile's "Baseline" series; the thumbnail, label and macro pages are
# series of their own, never read as levels.
_TIFF_COMPATIBLE_VENDORS = {None, "generic-tiff", "aperio"}


class FormatProbe:
    """What the readers ask of the file at ``path``, each found once, when first asked."""

    def __init__(self, path: str):
        self.path = path
        self.extension = os.path.splitext(path)[1].lower()

    @functools.cached_property
    def vendor(self) -> str | None:
        """OpenSlide's ``detect_format`` of the file (None: OpenSlide does not read it, or is missing),
        asked in a helper process (:mod:`.isolated`): :class:`SlideOpenError` where OpenSlide crashes."""
        from .isolated import openslide_vendor

        return openslide_vendor(self.path)

    @functools.cached_property
    def tiff_layout(self) -> str | None:
        """``"tiled"``, ``"untiled"`` or ``"cmyk"`` (tiled CMYK) for a TIFF of a vendor whose TIFF
        the tifffile reader decodes as OpenSlide does; None for any other file."""
        vendor = self.vendor
        if not (os.path.isfile(self.path) and is_tiff(self.path) and vendor in _TIFF_COMPATIBLE_VENDORS):
            return None
        with open_tifffile(self.path) as tif:
            if not tif.series:  # else read as an untiled image, whose reader would say "not an image"
                from .tiff_truncation import tiff_truncation

                why = tiff_truncation(self.path, MAX_TIFF_PAGES) or "a TIFF of no image"
                raise SlideOpenError(self.path, why)
            tiled = tif.series[0].keyframe.is_tiled
            if tiled and is_cmyk(tif.series[0].keyframe):
                return "cmyk"
        return "tiled" if tiled else "untiled"


class SlideReader:
    """A reader of :data:`SLIDE_READERS`: its ``name`` (a ``backend`` of
    :func:`~wsi_pipeline.slide.open_slide`), whether it reads a file, and how it opens one."""

    name: ClassVar[str]
    # Where the name stands among the choices (BACKENDS, the CLI's --reader): the built-in
    # readers fastest first, readers added later after them.
    choice_order: ClassVar[int] = 100
    # The endings of the file names it reads, lower case: a folder's files that are slides (".ome.tif"
    # is covered by ".tif").
    suffixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def lists(cls, path: str) -> bool:
        """Whether a folder's file at ``path`` is a slide for this reader: its name ends with one of
        ``suffixes`` (a reader that tells its files by their content may look into the file instead)."""
        return bool(cls.suffixes) and path.lower().endswith(cls.suffixes)

    # Whether a damaged file can crash the process in the reader's native code (a segmentation
    # fault no Python handler sees): a batch then runs the slide in a child process, whatever
    # its time limit, so that the crash fails that slide alone (batch/slide_worker.py).
    may_crash: ClassVar[bool] = False

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        """Whether this reader reads ``path``: True, False, or the error saying why it does not
        (raised where no reader takes the file)."""
        raise NotImplementedError

    @classmethod
    def open(cls, path: str) -> Slide:
        """The slide at ``path``, opened with this reader."""
        raise NotImplementedError


class PlainImageReader(SlideReader):
    """PNG, JPEG, BMP and WebP by their extension, held in memory (:class:`ImageSlide`)."""

    name = "image"
    choice_order = 3
    suffixes = PLAIN_IMAGE_EXTENSIONS

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        return probe.extension in PLAIN_IMAGE_EXTENSIONS

    @classmethod
    def open(cls, path: str) -> Slide:
        return ImageSlide(path)


class DicomReader(SlideReader):
    """DICOM WSI series of JPEG Baseline frames (:class:`~.dicom_backend.DicomSlide`)."""

    name = "dicom"
    choice_order = 1
    suffixes = (".dcm",)

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        """True where the series is one it reads; the error of a DICOM WSI it refuses to read
        (what it refuses goes to OpenSlide, and the error is raised only where no reader takes it)."""
        from .dicom_file import is_dicom_wsi, not_a_slide, series_refusal

        if not is_dicom_wsi(path):
            reason = not_a_slide(path)  # another DICOM object: the error where no reader takes it
            return SlideOpenError(path, reason) if reason else False
        try:
            refusal = series_refusal(path)
        except SlideOpenError as exc:
            refusal = exc
        if refusal is None:
            return True
        log.info("%s: not read with the dicom reader: %s", path, refusal)
        return refusal if isinstance(refusal, SlideOpenError) else False

    @classmethod
    def open(cls, path: str) -> Slide:
        from .dicom_backend import DicomSlide

        return DicomSlide(path)


class TiledTiffReader(SlideReader):
    """Tiled TIFF, BigTIFF, OME-TIFF and Aperio SVS (:class:`~.tiff_backend.TiffSlide`): the fast path."""

    name = "tifffile"
    choice_order = 0
    suffixes = (".svs", ".tif", ".tiff")

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        return probe.tiff_layout == "tiled"

    @classmethod
    def open(cls, path: str) -> Slide:
        from .tiff_backend import TiffSlide

        return TiffSlide(path)


class UntiledTiffReader(PlainImageReader):
    """An untiled TIFF of those vendors, read as a plain image (in memory)."""

    suffixes = (".tif", ".tiff")

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        return probe.tiff_layout == "untiled"


class OpenSlideReader(SlideReader):
    """Every other format OpenSlide reads (NDPI, MRXS, SCN, other DICOM, ...), and tiled CMYK TIFF,
    whose inks OpenSlide alone turns into RGB (:class:`~.openslide_backend.OpenSlideSlide`)."""

    name = "openslide"
    choice_order = 2
    # OpenSlide's formats (https://openslide.org/formats/).
    suffixes = (".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif", ".dcm")
    may_crash = True  # its vendor parsers and decoders in C crash on some damaged files

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool | SlideOpenError:
        layout = probe.tiff_layout
        return layout == "cmyk" or (layout is None and probe.vendor is not None)

    @classmethod
    def open(cls, path: str) -> Slide:
        from .openslide_backend import OpenSlideSlide

        return OpenSlideSlide(path)


# The readers in the order they are asked (the first that reads a file opens it): plain images by
# their extension; DICOM WSI (a DICOM file may also be a TIFF); TIFF the tifffile reader decodes;
# the rest of what OpenSlide reads.
SLIDE_READERS: list[type[SlideReader]] = [
    PlainImageReader,
    DicomReader,
    TiledTiffReader,
    UntiledTiffReader,
    OpenSlideReader,
]


def register_reader(
    reader: type[SlideReader], before: type[SlideReader] | None = None, *, replace: bool = False
) -> None:
    """Add ``reader`` to :data:`SLIDE_READERS`: asked before ``before``, or after all the others.
    ValueError where its name is another reader's (as for decoders and formats), unless ``replace``:
    the name (``--reader NAME``) then gives whichever of them is asked first."""
    if reader in SLIDE_READERS:
        raise ValueError(f"slide reader {reader.__name__} is registered already")
    holder = reader_named(reader.name)
    if holder is not None and not replace:
        raise ValueError(
            f"slide reader {reader.__name__}: the name {reader.name!r} is taken by {holder.__module__}."
            f"{holder.__qualname__}; give it a name of its own"
        )
    SLIDE_READERS.insert(SLIDE_READERS.index(before) if before is not None else len(SLIDE_READERS), reader)


def _added_readers() -> list[type[SlideReader]]:
    """Every reader in its place, where one was registered from outside the package (what a helper
    process is handed); nothing otherwise."""
    added = any(not r.__module__.startswith("wsi_pipeline.") for r in SLIDE_READERS)
    return list(SLIDE_READERS) if added else []


def _restore_readers(readers: list[type[SlideReader]]) -> None:
    SLIDE_READERS[:] = readers


carry(_added_readers, _restore_readers, READERS_GROUP, whole=True)


def unregister_reader(reader: type[SlideReader]) -> None:
    """Remove ``reader`` from :data:`SLIDE_READERS`."""
    SLIDE_READERS.remove(reader)


def reader_names() -> tuple[str, ...]:
    """The names of the registered readers, once each, in their ``choice_order``."""
    names = dict.fromkeys(r.name for r in sorted(SLIDE_READERS, key=lambda r: r.choice_order))
    return tuple(names)


def lists_slide(path: str | os.PathLike[str]) -> bool:
    """Whether a folder's file at ``path`` is a slide: a reader of :data:`SLIDE_READERS` lists it."""
    path = os.fspath(path)
    return any(r.lists(path) for r in SLIDE_READERS)


def slide_suffixes() -> tuple[str, ...]:
    """The file name endings the registered readers read, sorted, once each."""
    return tuple(sorted({s for r in SLIDE_READERS for s in r.suffixes}))


def reader_named(name: str) -> type[SlideReader] | None:
    """The first registered reader called ``name``, or None."""
    return next((r for r in SLIDE_READERS if r.name == name), None)


def first_reader(path: str) -> type[SlideReader]:
    """The first reader of :data:`SLIDE_READERS` that reads ``path``; raises the first refusal
    error a reader gave where none does, else :class:`SlideOpenError` listing what is read."""
    probe = FormatProbe(path)
    refusal: SlideOpenError | None = None
    for reader in SLIDE_READERS:
        answer = reader.reads(path, probe)
        if isinstance(answer, SlideOpenError):
            refusal = refusal or answer
        elif answer:
            return reader
    if refusal is not None:
        raise refusal
    raise SlideOpenError(
        path,
        f"no reader recognises this file (expected a file the readers {', '.join(reader_names())} read: "
        f"{' '.join(slide_suffixes())})",
    )


__all__ = [
    "FormatProbe",
    "SlideReader",
    "SLIDE_READERS",
    "register_reader",
    "lists_slide",
    "slide_suffixes",
    "unregister_reader",
    "reader_names",
    "reader_named",
    "first_reader",
]
