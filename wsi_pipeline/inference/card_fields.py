"""Reading a model card's JSON: the file as a small JSON text, and field access whose errors name the field.

Every error is a :class:`~wsi_pipeline.errors.ModelError` that names the card file and, for a
field, its path in the document (``input.size``, ``outputs[1].shape[0]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ModelError, SpecialFileError
from ..special_files import open_regular
from ..validation import is_instance, is_int, is_number

# A card is a few KB; anything far larger is not one.
MAX_CARD_BYTES = 1 << 20

Dim = int | str | None  # a fixed size, or a symbolic name / None for a dynamic axis


class FieldReader:
    """Field access on the card's JSON with errors that name the file and field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, expected: str, found: Any) -> ModelError:
        return ModelError(f"{self.path}: field {where!r}: expected {expected}, found {found!r}")

    def get(
        self,
        obj: Mapping[str, Any],
        key: str,
        where: str,
        kinds: type | tuple[type, ...],
        expected: str,
        default: Any = ...,
        optional: bool = False,
    ) -> Any:
        full = f"{where}.{key}" if where else key
        if key not in obj or (optional and obj[key] is None):
            if default is not ...:
                return default
            raise ModelError(f"{self.path}: missing field {full!r} ({expected})")
        value = obj[key]
        if not is_instance(value, kinds):
            raise self.fail(full, expected, value)
        return value

    def choice(self, obj: Mapping[str, Any], key: str, where: str, choices: Sequence[str], default: Any = ...) -> str:
        value = self.get(obj, key, where, str, f"one of {list(choices)}", default)
        if value not in choices:
            raise self.fail(f"{where}.{key}" if where else key, f"one of {list(choices)}", value)
        return value

    def triple(self, obj: Mapping[str, Any], key: str, where: str, default: Any) -> tuple[float, float, float]:
        value = self.get(obj, key, where, list, "a list of 3 numbers", default)
        if isinstance(value, tuple):
            return value
        if len(value) != 3 or not all(is_number(v) for v in value):
            raise self.fail(f"{where}.{key}", "a list of 3 numbers", value)
        return tuple(float(v) for v in value)  # type: ignore[return-value]


def parse_dim(reader: FieldReader, value: Any, where: str) -> Dim:
    if value is None or isinstance(value, str):
        return value
    if is_int(value) and value >= 0:
        return value
    raise reader.fail(where, "a non-negative int, a string (dynamic axis) or null", value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_card_json(path: Path) -> Any:
    """The card's JSON document; ModelError for a file that is not a small UTF-8 JSON text of plain numbers."""
    try:
        with open_regular(path, "rb") as f:  # a FIFO would wait for a writer for ever
            raw = f.read(MAX_CARD_BYTES + 1)
    except SpecialFileError as exc:
        raise ModelError(f"{path}: cannot read the model card: {exc.kind}, not a regular file") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the model card: {exc.strerror or exc}") from None
    if len(raw) > MAX_CARD_BYTES:
        raise ModelError(
            f"{path}: not a model card: expected at most {MAX_CARD_BYTES} bytes of JSON, found a larger file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(
            f"{path}: not valid JSON: expected UTF-8 text, found byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        ) from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ModelError(f"{path}: not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers of thousands of digits
        raise ModelError(f"{path}: not valid JSON: {exc}") from None
