"""Slides read through OpenSlide: every vendor format it knows, DICOM included."""

from __future__ import annotations

import os

import numpy as np
import openslide

from ..errors import SlideOpenError, TileReadError
from ..io.detections import parse_color
from ..special_files import kind_of_mode
from .base import Slide, checked_mpp, composite_rgba
from .tiff_file import check_tiff_data, is_tiff


def _background_colour(value: str | None) -> tuple[int, int, int]:
    """OpenSlide's background colour property (``RRGGBB``); white where it is missing or unreadable."""
    try:
        return parse_color(value) if value else (255, 255, 255)
    except ValueError:
        return (255, 255, 255)


def special_companion(path: str) -> str | None:
    """A FIFO, socket or device among the files OpenSlide opens besides ``path`` (every file of a
    DICOM slide's folder, of a MIRAX slide's data folder), said with its path; None where there is
    none. OpenSlide would wait on a FIFO there for ever."""
    vendor = openslide.OpenSlide.detect_format(path)
    if vendor == "dicom":
        folder, why = (path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))), "folder"
    elif vendor == "mirax":
        folder, why = os.path.splitext(path)[0], "data folder"
    else:
        return None
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    for entry in entries:
        try:
            kind = kind_of_mode(entry.stat().st_mode)  # links followed, as OpenSlide's open follows them
        except OSError:
            continue
        if kind:
            return f"{entry.path} is {kind}, not a regular file (OpenSlide opens every file of the slide's {why})"
    return None


class OpenSlideSlide(Slide):
    """A slide opened with :class:`openslide.OpenSlide`."""

    backend = "openslide"

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        if os.path.isfile(self.path) and is_tiff(self.path):
            # OpenSlide allocates what a TIFF's tags claim (and aborts the process when it cannot).
            check_tiff_data(self.path)
        if companion := special_companion(self.path):
            raise SlideOpenError(self.path, companion)
        try:
            self._osr = openslide.OpenSlide(self.path)
        except openslide.OpenSlideUnsupportedFormatError as exc:
            raise SlideOpenError(self.path, "not a format OpenSlide recognises") from exc
        except openslide.OpenSlideError as exc:
            raise SlideOpenError(self.path, f"OpenSlide cannot open it: {exc}") from exc
        props = dict(self._osr.properties)
        self._properties = props
        self._vendor = props.get(openslide.PROPERTY_NAME_VENDOR)
        self._level_dimensions = [tuple(map(int, d)) for d in self._osr.level_dimensions]
        self._level_downsamples = [float(d) for d in self._osr.level_downsamples]
        self._mpp = checked_mpp(
            self.path,
            props.get(openslide.PROPERTY_NAME_MPP_X),
            props.get(openslide.PROPERTY_NAME_MPP_Y),
        )
        self.background_rgb = _background_colour(props.get(openslide.PROPERTY_NAME_BACKGROUND_COLOR))

    @property
    def associated_image_names(self) -> tuple[str, ...]:
        return tuple(self._osr.associated_images)

    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        try:
            img = self._osr.read_region((x0_level0, y0_level0), level, (w, h))
        except openslide.OpenSlideError as exc:
            raise TileReadError(self.path, f"OpenSlide read failed: {exc}", (x0_level0, y0_level0), level) from exc
        return composite_rgba(np.asarray(img), self.background_rgb)

    def close(self) -> None:
        if not self._closed:
            self._osr.close()
        super().close()
