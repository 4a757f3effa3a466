"""``DIR/manifest.json``: every slide's status, error, counts and times, saved atomically."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import SpecialFileError
from ..io.atomic import write_json
from ..special_files import open_regular
from .folder import MANIFEST, SLIDES_DIR, OutputFolderError

log = logging.getLogger("wsi_pipeline")


class Manifest:
    """``DIR/manifest.json``: one record per slide name, saved atomically on every change.

    A failed save raises :class:`OutputFolderError`: the batch can no longer
    record what it does, so it stops.
    """

    def __init__(self, out_dir: Path):
        self.path = out_dir / MANIFEST
        self._lock = threading.Lock()
        self.slides: dict[str, dict[str, Any]] = {}
        if not os.path.lexists(self.path):
            return
        try:
            doc = _read_manifest(self.path)
        except _DamagedManifest as exc:
            aside = _set_aside(self.path)
            kept = f"set aside as {aside.name}" if aside else "left as it is (it could not be moved aside)"
            log.warning("%s: %s; %s, a new manifest is started (finished slide folders are kept)", self.path, exc, kept)
            return
        self.slides = doc["slides"]
        if doc.get("format") == 1:
            log.warning(
                "%s: written by an older version, whose slide folders (DIR/<name>/) are not "
                "reused; slides now go to DIR/%s/<name>/",
                self.path,
                SLIDES_DIR,
            )

    def update(self, name: str, **fields: Any) -> None:
        self.update_records({name: fields})

    def update_records(self, records: dict[str, dict[str, Any]]) -> None:
        """Update several slides' records in one save."""
        with self._lock:
            for name, fields in records.items():
                self.slides.setdefault(name, {}).update(fields)
            try:
                write_json(self.path, {"format": 2, "updated": now(), "slides": self.slides})
            except OSError as exc:
                raise OutputFolderError(
                    f"{self.path}: cannot record the batch's progress ({exc.strerror or exc}); the run stops. "
                    "Finished slides are kept: free space or fix the folder, then run again"
                ) from None


class _DamagedManifest(Exception):
    """Why a manifest cannot be read as one (its text says what was expected and what was found)."""


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` as ``{"format": ..., "slides": {name: record}}``, every record an object;
    :class:`_DamagedManifest` saying what is wrong otherwise. A link or special file is not read."""
    try:
        with open_regular(path, "r", follow_links=False, encoding="utf-8") as f:
            doc = json.load(f)
    except SpecialFileError as exc:
        raise _DamagedManifest(f"{exc.kind}, not a regular file") from None
    except OSError as exc:
        raise _DamagedManifest(f"unreadable ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested past the parser's depth
        raise _DamagedManifest(f"not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict):
        raise _DamagedManifest(f"expected a JSON object, found {type(doc).__name__}")
    slides = doc.get("slides", {})
    if not isinstance(slides, dict):
        raise _DamagedManifest(f'expected "slides" to be an object of records by name, found {type(slides).__name__}')
    bad = next((name for name, record in slides.items() if not isinstance(record, dict)), None)
    if bad is not None:
        found = type(slides[bad]).__name__
        raise _DamagedManifest(f'expected the record of slide "{bad}" to be an object, found {found}')
    return {**doc, "slides": slides}


def _set_aside(path: Path) -> Path | None:
    """Rename a damaged manifest to ``manifest.damaged-<time>.json`` beside it (kept for whoever looks
    into it, out of the run's way); None where it cannot be renamed."""
    aside = path.with_name(f"{path.stem}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}{path.suffix}")
    try:
        os.replace(path, aside)
    except OSError:
        return None
    return aside


def now() -> str:
    """The time as the manifest and the log write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
