"""What a finished slide's outputs depend on, so that a resumed batch never keeps a stale result.

A slide's ``summary.json`` records its :class:`RunKey` (a hash of the
result-deciding settings, of the whole model card with its model's SHA-256,
and of the mask file's content) and its input's identity (size and a
fingerprint of the file's first and last 64 KiB and 16 blocks of 4 KiB
spread between them; for a slide that is a folder, its files' names and
sizes). A rerun keeps the slide only when both still match, and otherwise
says why it is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from .config import RunConfig
from .errors import ConfigError, UsageError
from .inference.card import ModelCard
from .io.formats import DEFAULT_FORMATS
from .special_files import kind_of_mode, special_kind

KEY_FORMAT = 2
HEAD_BYTES = TAIL_BYTES = 64 << 10
SAMPLES = 16
SAMPLE_BYTES = 4 << 10

# What each part of the key covers, for the log line of a redone slide.
PART_NAMES = {"settings": "the settings", "card": "the model card", "model": "the model file", "mask": "the mask file"}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def mask_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a mask file; UsageError naming it when it cannot be read or is no mask."""
    from .inference.card import file_sha256

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise UsageError(f"{p}: mask file not found (--tissue file needs --mask PATH of an image or GeoJSON)")
    if p.lower().endswith((".geojson", ".json")):
        from .tiling.tissue import _geojson_polygons

        try:
            _geojson_polygons(p)
        except (ConfigError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise UsageError(f"{p}: not a usable mask: {exc}") from None
    try:
        return file_sha256(p)
    except OSError as exc:
        raise UsageError(f"{p}: cannot read the mask file: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class RunKey:
    """The result-deciding inputs shared by every slide of a batch, as named hashes."""

    parts: dict[str, str]

    @classmethod
    def of(cls, config: RunConfig, card: ModelCard) -> RunKey:
        """The key of ``config`` and ``card`` (reads the mask file, UsageError when it is not one)."""
        settings = config.result_key()
        for k in ("model", "mask"):  # paths do not matter, contents do
            settings.pop(k, None)
        # Another set of output files is another result (a rerun writes the files now asked for);
        # the default set is left out, so keys made before formats could be chosen stay valid.
        if tuple(settings.get("formats", DEFAULT_FORMATS)) == DEFAULT_FORMATS:
            settings.pop("formats", None)
        card_doc = card.to_dict()
        parts = {"settings": _digest(settings), "card": _digest(card_doc), "model": card.sha256[:16]}
        if config.mask:
            parts["mask"] = mask_sha256(config.mask)[:16]
        return cls(parts)

    @property
    def value(self) -> str:
        return _digest({"format": KEY_FORMAT, **self.parts})

    def changes_from(self, recorded: dict[str, Any] | None) -> list[str]:
        """What differs from the parts a summary recorded (names from :data:`PART_NAMES`)."""
        if not isinstance(recorded, dict):
            return ["the settings or model (recorded by an older version)"]
        names = sorted(set(self.parts) | set(recorded))
        return [PART_NAMES.get(n, n) for n in names if self.parts.get(n) != recorded.get(n)]


def input_identity(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{"size", "fingerprint"}`` of a slide file (or of a folder slide: its files' names and sizes),
    or None when it cannot be read (the run then fails it)."""
    if os.path.isdir(path):
        return _folder_identity(path)
    if special_kind(path):  # never opened: a FIFO waits for a writer, a device may not end
        return None
    try:
        # Without waiting: a FIFO opened for reading would wait for a writer (refused when read as a slide).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if kind_of_mode(st.st_mode):
                return None
            size = st.st_size
            h = hashlib.sha256()
            h.update(f.read(HEAD_BYTES))
            if size > HEAD_BYTES + TAIL_BYTES:
                step = (size - HEAD_BYTES - TAIL_BYTES) // (SAMPLES + 1)
                for i in range(1, SAMPLES + 1):
                    f.seek(HEAD_BYTES + i * step)
                    h.update(f.read(SAMPLE_BYTES))
            if size > HEAD_BYTES:
                f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
                h.update(f.read(TAIL_BYTES))
    except (OSError, ValueError):
        return None
    return {"size": size, "fingerprint": h.hexdigest()[:32]}


def _folder_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    entries = []
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                entries.append((os.path.relpath(full, path), os.path.getsize(full)))
            except OSError:
                continue
    entries.sort()
    listing = json.dumps(entries).encode("utf-8", "surrogateescape")
    return {"size": sum(n for _, n in entries), "fingerprint": hashlib.sha256(listing).hexdigest()[:32]}


def why_redo(
    summary: dict[str, Any] | None, key: RunKey, identity: dict[str, Any] | None, missing: list[str]
) -> str | None:
    """Why a slide folder with ``summary`` (None: none readable) is not a result of ``key`` on this
    input; None when it is one."""
    if summary is None:
        return "its summary.json is missing or unreadable"
    if missing:
        return f"its outputs are incomplete (no {', '.join(missing)})"
    if summary.get("run_key") != key.value:
        return f"{' and '.join(key.changes_from(summary.get('run_key_parts')))} changed"
    recorded = summary.get("input")
    if identity is None or not isinstance(recorded, dict):
        return "the slide file's identity is unknown"
    if recorded.get("size") != identity["size"]:
        return f"the slide file changed (size {recorded.get('size')} -> {identity['size']} bytes)"
    if recorded.get("fingerprint") != identity["fingerprint"]:
        return "the slide file changed (same size, different content)"
    return None
