"""The files of a folder that make one DICOM whole-slide image: a slide per series."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("wsi_pipeline")


def one_file_per_dicom_series(paths: list[Path], named: Collection[Path] = ()) -> list[Path]:
    """Keep the first ``.dcm`` file of each DICOM whole-slide image in a folder.

    A DICOM whole-slide image is a series of VL Whole Slide Microscopy files in one folder (a file
    per pyramid level, thumbnail, label...); OpenSlide opens the whole slide from any of them, so
    the series is one slide: the files of one SeriesInstanceUID, PyramidUID and ContainerIdentifier
    (two scans sharing a series UID are two slides). Only those files group: another DICOM object
    beside them (a Secondary Capture, the annotations or maps a run wrote, even with the slide's
    SeriesInstanceUID) is no slide; it is left out, with a warning per folder, unless it is one
    of ``named`` (a file the user named, which then fails as a slide of its own). A ``.dcm`` file
    that is not DICOM or cannot be read stays, to fail as a slide. Each file's first elements alone
    are read, once (:func:`~wsi_pipeline.slide.dicom_headline.headline`), one file open at a time.
    Other paths pass unchanged.
    """
    from pydicom.uid import VLWholeSlideMicroscopyImageStorage

    from ..slide.dicom_file import NOT_LEVELS
    from ..slide.dicom_headline import headline, sop_name

    kept: list[Path] = []
    first: dict[tuple[str, tuple[str | None, ...]], Path] = {}
    not_slides: dict[Path, list[tuple[Path, str]]] = {}
    named_keys = {os.path.realpath(p) for p in named}
    found_of = {p: headline(str(p)) if p.suffix.lower() == ".dcm" and p.is_file() else None for p in paths}
    levels: dict[str, set[tuple[str | None, ...]]] = {}  # folder -> the slides its level files are of
    for p, found in found_of.items():
        if found is not None and found.is_wsi and found.series and found.image_type not in NOT_LEVELS:
            levels.setdefault(os.path.realpath(p.parent), set()).add(found.slide)
    for p in paths:
        found = found_of[p]
        if found is None:
            kept.append(p)
            continue
        if found.image_type in NOT_LEVELS and any(map(found.of_slide, levels.get(os.path.realpath(p.parent), ()))):
            continue  # a label or overview of a slide whose levels stand for it
        if not found.is_wsi or found.series is None:
            if os.path.realpath(p) in named_keys:
                kept.append(p)  # fails as a slide, saying what it is
            else:
                not_slides.setdefault(p.parent, []).append((p, found.sop))
            continue
        key = (os.path.realpath(p.parent), found.slide)
        if key in first:
            log.info("%s: DICOM series %s, the same slide as %s", p, found.series, first[key])
            continue
        first[key] = p
        kept.append(p)
    for folder, files in not_slides.items():
        p, sop = files[0]
        log.warning(
            "%s: %d DICOM file(s) that are not whole-slide images skipped (%s: SOP class %s, expected %s)",
            folder,
            len(files),
            p.name,
            sop_name(sop),
            VLWholeSlideMicroscopyImageStorage,
        )
    return kept
