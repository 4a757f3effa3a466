"""What a finished slide's outputs depend on, so that a resumed batch never keeps a stale result.

A slide's ``summary.json`` records its :class:`RunKey` (a hash of the
result-deciding settings, of the whole model card with its model's SHA-256,
and of the mask file's content) and its input's identity
(:func:`~wsi_pipeline.file_identity.input_identity`). A rerun keeps the slide only when
both still match, and otherwise says why it is redone. An edit the sampled
fingerprint misses changes the modification time; a file replaced by another
changes the inode. Identities recorded before the time and inode were (or
without them) are compared on what they hold.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, UsageError
from ..inference.card_spec import ModelCard
from ..io.formats import DEFAULT_FORMATS

KEY_FORMAT = 2

# What each part of the key covers, for the log line of a redone slide.
PART_NAMES = {"settings": "the settings", "card": "the model card", "model": "the model file", "mask": "the mask file"}


def settings_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def mask_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a mask file; UsageError naming it when it cannot be read or is no mask."""
    from ..inference.card import file_sha256

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise UsageError(f"{p}: mask file not found (--tissue file needs --mask PATH of an image or GeoJSON)")
    if p.lower().endswith((".geojson", ".json")):
        from ..tiling.tissue import geojson_polygons

        try:
            geojson_polygons(p)
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
    # How the slide files are fingerprinted (config.slide_hash): not a part, it decides no result.
    slide_hash: str = "sampled"

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
        parts = {"settings": settings_digest(settings), "card": settings_digest(card_doc), "model": card.sha256[:16]}
        if config.mask:
            parts["mask"] = mask_sha256(config.mask)[:16]
        return cls(parts, config.slide_hash)

    @property
    def value(self) -> str:
        return settings_digest({"format": KEY_FORMAT, **self.parts})

    def changes_from(self, recorded: dict[str, Any] | None) -> list[str]:
        """What differs from the parts a summary recorded (names from :data:`PART_NAMES`)."""
        if not isinstance(recorded, dict):
            return ["the settings or model (recorded by an older version)"]
        names = sorted(set(self.parts) | set(recorded))
        return [PART_NAMES.get(n, n) for n in names if self.parts.get(n) != recorded.get(n)]


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
    if recorded.get("hash", "sampled") != identity.get("hash", "sampled"):
        return f"the slide file's fingerprint was taken otherwise (slide_hash {identity.get('hash', 'sampled')})"
    if recorded.get("fingerprint") != identity["fingerprint"]:
        return "the slide file changed (same size, different content)"
    # Compared where recorded: folders written before they were keep their results.
    if "inode" in recorded and recorded["inode"] != identity.get("inode"):
        return "the slide file changed (replaced by another file of the same size and sampled content)"
    if "mtime_ns" in recorded and recorded["mtime_ns"] != identity.get("mtime_ns"):
        return "the slide file changed (modified since its run: same size and sampled content)"
    return None
