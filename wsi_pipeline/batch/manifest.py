"""``DIR/manifest.json``: every slide's status, error, counts and times, saved atomically."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..io.atomic import write_json
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
        if self.path.is_file():
            try:
                with open(self.path, encoding="utf-8") as f:
                    doc = json.load(f)
                self.slides = dict(doc.get("slides", {}))
            except (OSError, ValueError, AttributeError, TypeError):
                log.warning("%s: unreadable, starting a new manifest (finished slide folders are kept)", self.path)
            else:
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


def now() -> str:
    """The time as the manifest and the log write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
