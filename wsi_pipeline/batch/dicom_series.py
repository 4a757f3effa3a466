"""The files of a folder that make one DICOM whole-slide image: a slide per series."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("wsi_pipeline")


def one_file_per_dicom_series(paths: list[Path], named: Collection[Path] = ()) -> list[Path]:
    """Keep the first ``.dcm`` file of each DICOM whole-slide series (SeriesInstanceUID) in a folder.

    A DICOM whole-slide image is a series of VL Whole Slide Microscopy files in one folder (a file
    per pyramid level, thumbnail, label...); OpenSlide opens the whole slide from any of them, so
    the series is one slide. Only those files group: another DICOM object beside them (a
    Secondary Capture, the annotations or maps a run wrote, even with the slide's
    SeriesInstanceUID) is no slide; it is left out, with a warning per folder, unless it is one
    of ``named`` (a file the user named, which then fails as a slide of its own). A ``.dcm`` file
    that is not DICOM or cannot be read stays, to fail as a slide. Each file's first elements alone
    are read (:func:`~wsi_pipeline.slide.dicom_file.series_identity`), one file open at a time.
    Other paths pass unchanged.
    """
    from pydicom.uid import VLWholeSlideMicroscopyImageStorage

    from ..slide.dicom_file import series_identity

    kept: list[Path] = []
    first: dict[tuple[str, str], Path] = {}
    not_slides: dict[Path, list[tuple[Path, str]]] = {}
    named_keys = {os.path.realpath(p) for p in named}
    for p in paths:
        found = series_identity(str(p)) if p.suffix.lower() == ".dcm" and p.is_file() else None
        if found is None:
            kept.append(p)
            continue
        sop, uid = found
        if sop != VLWholeSlideMicroscopyImageStorage or uid is None:
            if os.path.realpath(p) in named_keys:
                kept.append(p)  # fails as a slide, saying what it is
            else:
                not_slides.setdefault(p.parent, []).append((p, sop))
            continue
        key = (os.path.realpath(p.parent), uid)
        if key in first:
            log.info("%s: DICOM series %s, the same slide as %s", p, uid, first[key])
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
            _sop_name(sop),
            VLWholeSlideMicroscopyImageStorage,
        )
    return kept


def _sop_name(uid: str) -> str:
    from pydicom.uid import UID

    name = UID(uid).name
    return f"{uid} ({name})" if name != uid else uid
