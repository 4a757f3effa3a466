"""Model cards: the JSON file beside each model that says how to feed and decode it.

A card ``engines/NAME.card.json`` describes ``engines/NAME.onnx`` (or a
``torch.export`` program ``NAME.pt2``, see :data:`MODEL_FORMATS`): the input
tensor (name, size, layout, dtype, channel order, normalisation), the
resolution the model was trained at (``mpp``, micrometres per pixel, or
``null`` for industrial models), every output (name, shape, dtype), the
decoder that turns the outputs into boxes, the object classes and the region
heatmap. :func:`load_card` validates all of it and refuses a model file whose
SHA-256, inputs or outputs differ from what the card says. The format is
documented in ``docs/model_card.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..validation import is_int
from .card_fields import FieldReader, parse_dim, read_card_json
from .card_spec import (
    CARD_SUFFIX,
    CHANNEL_ORDERS,
    HEATMAP_ACTIVATIONS,
    INPUT_DTYPES,
    LAYOUTS,
    MAX_DETECTIONS_PER_TILE,
    MAX_INPUT_SIDE,
    MAX_MPP,
    MIN_MPP,
    MODEL_FORMATS,
    OUTPUT_DTYPES,
    PRECISIONS,
    SCHEMA_VERSION,
    TORCH_EXPORT_SUFFIX,
    ClassSpec,
    DecoderSpec,
    HeatmapSpec,
    InputSpec,
    ModelCard,
    OutputSpec,
)
from .decoder_registry import decoder_types, validate_decoder_params
from .model_signature import verify_model_file
from .shipped import resolve_model, shipped_names


def format_for(model_path: str | os.PathLike[str]) -> str:
    """The model format a file's extension implies: ``torch_export`` for ``.pt2``, else ``onnx``."""
    return "torch_export" if Path(model_path).suffix.lower() == TORCH_EXPORT_SUFFIX else "onnx"


def require_onnx(card: ModelCard, what: str) -> None:
    """ModelError unless ``card`` names an ONNX model; ``what`` (e.g. "the ort backend") needs one."""
    if card.format != "onnx":
        raise ModelError(
            f"{card.model_path}: expected an ONNX model for {what}, found a torch.export "
            f"program (card {card.card_path}, format {card.format!r}); the torch backend "
            "runs it (--backend torch, or --backend auto)"
        )


def card_path_for(model_path: str | os.PathLike[str]) -> Path:
    """``engines/NAME.onnx`` -> ``engines/NAME.card.json``."""
    p = Path(model_path)
    return p.with_name(p.stem + CARD_SUFFIX) if p.suffix else p.with_name(p.name + CARD_SUFFIX)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_card(card: ModelCard, path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``card`` as JSON (to ``path``, or beside its model) and return the path."""
    out = Path(path) if path is not None else card_path_for(card.model_path)
    card = dataclasses.replace(card, card_path=out.resolve())
    out.write_text(json.dumps(card.to_dict(), indent=2) + "\n")
    return out


# -- parsing -------------------------------------------------------------------


_KNOWN_FIELDS = frozenset(
    {
        "max_detections_per_tile",
        "schema_version",
        "name",
        "version",
        "model_file",
        "sha256",
        "precision",
        "format",
        "input",
        "mpp",
        "outputs",
        "decoder",
        "classes",
        "heatmap",
    }
)


def parse_card(doc: Mapping[str, Any], card_path: str | os.PathLike[str]) -> ModelCard:
    """Validate a card's JSON document; ``card_path`` locates the model file and names errors."""
    path = Path(card_path).resolve()
    r = FieldReader(path)
    if not isinstance(doc, Mapping):
        raise r.fail("", "a JSON object", type(doc).__name__)
    schema = r.get(doc, "schema_version", "", int, "an int", SCHEMA_VERSION)
    if schema > SCHEMA_VERSION:
        raise r.fail("schema_version", f"<= {SCHEMA_VERSION}", schema)
    name = r.get(doc, "name", "", str, "a string")
    version = str(r.get(doc, "version", "", (str, int, float), "a string", "0"))
    model_file = _parse_model_file(r, doc, path)
    sha = r.get(doc, "sha256", "", str, "64 hex digits")
    if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha.lower()):
        raise r.fail("sha256", "64 hex digits", sha)
    precision = r.choice(doc, "precision", "", PRECISIONS, "fp32")
    model_format = _parse_format(r, doc, model_file)
    input_spec = _parse_input(r, doc)
    mpp = r.get(doc, "mpp", "", (int, float), "micrometres per pixel or null", None, optional=True)
    if mpp is not None and not (math.isfinite(mpp) and MIN_MPP <= mpp <= MAX_MPP):
        raise r.fail("mpp", f"a positive number from {MIN_MPP:g} to {MAX_MPP:g}, or null", mpp)
    outputs = _parse_outputs(r, doc)
    dec = r.get(doc, "decoder", "", dict, "an object {type, params}")
    decoder = DecoderSpec(
        type=r.choice(dec, "type", "decoder", decoder_types()),
        params=dict(r.get(dec, "params", "decoder", dict, "an object", {})),
    )
    classes = _parse_classes(r, doc)
    heatmap = _parse_heatmap(r, doc, [o.name for o in outputs])
    cap = r.get(doc, "max_detections_per_tile", "", int, "a positive int or null", None, optional=True)
    if cap is not None and not (is_int(cap) and 1 <= cap <= MAX_DETECTIONS_PER_TILE):
        raise r.fail("max_detections_per_tile", f"an int from 1 to {MAX_DETECTIONS_PER_TILE} or null", cap)
    card = ModelCard(
        name=name,
        version=version,
        model_path=(path.parent / model_file).resolve(),
        sha256=sha.lower(),
        input=input_spec,
        outputs=outputs,
        decoder=decoder,
        classes=classes,
        mpp=mpp,
        heatmap=heatmap,
        precision=precision,
        card_path=path,
        extra={k: v for k, v in doc.items() if k not in _KNOWN_FIELDS},
        format=model_format,
        max_detections_per_tile=cap,
    )
    validate_decoder_params(card)
    return card


def _parse_model_file(r: FieldReader, doc: Mapping[str, Any], card_path: Path) -> str:
    """The card's ``model_file``: a path inside the card's folder."""
    model_file = r.get(doc, "model_file", "", str, "a path relative to the card")
    # The model lives in the card's folder or below it: a card cannot point at any file on the machine,
    # neither by its path nor through a symbolic link (links are resolved before the check).
    if "\x00" in model_file or os.path.isabs(model_file):
        raise r.fail("model_file", "a path inside the card's folder", model_file)
    inside = os.path.realpath(os.path.join(card_path.parent, model_file))
    if os.path.commonpath([inside, str(card_path.parent)]) != str(card_path.parent):
        shown = (
            model_file
            if os.path.normpath(os.path.join(card_path.parent, model_file)) == inside
            else f"{model_file} -> {inside}"
        )
        raise r.fail("model_file", "a path inside the card's folder (symbolic links resolved)", shown)
    return model_file


def _parse_format(r: FieldReader, doc: Mapping[str, Any], model_file: str) -> str:
    """The card's ``format``, which must be the one the model file's extension implies."""
    implied = format_for(model_file)
    model_format = r.choice(doc, "format", "", MODEL_FORMATS, implied)
    if model_format != implied:
        raise r.fail(
            "format",
            f"{implied!r} for the model file {model_file!r} (a torch.export program ends in {TORCH_EXPORT_SUFFIX})",
            model_format,
        )
    return model_format


def _parse_input(r: FieldReader, doc: Mapping[str, Any]) -> InputSpec:
    """The card's ``input``."""
    inp = r.get(doc, "input", "", dict, "an object")
    size = r.get(inp, "size", "input", list, "[height, width] in pixels")
    if len(size) != 2 or not all(is_int(v) and 0 < v <= MAX_INPUT_SIDE for v in size):
        raise r.fail("input.size", f"[height, width], two ints from 1 to {MAX_INPUT_SIDE}", size)
    input_spec = InputSpec(
        name=r.get(inp, "name", "input", str, "the graph input's name"),
        size_hw=(size[0], size[1]),
        layout=r.choice(inp, "layout", "input", LAYOUTS, "NHWC"),
        dtype=r.choice(inp, "dtype", "input", INPUT_DTYPES, "uint8"),
        channel_order=r.choice(inp, "channel_order", "input", CHANNEL_ORDERS, "RGB"),
        mean=r.triple(inp, "mean", "input", (0.0, 0.0, 0.0)),
        std=r.triple(inp, "std", "input", (1.0, 1.0, 1.0)),
        normalize_in_graph=r.get(inp, "normalize_in_graph", "input", bool, "true or false", True),
    )
    if any(s == 0 for s in input_spec.std):
        raise r.fail("input.std", "non-zero values", list(input_spec.std))
    if (
        input_spec.dtype == "uint8"
        and not input_spec.normalize_in_graph
        and (input_spec.mean != (0.0, 0.0, 0.0) or input_spec.std != (1.0, 1.0, 1.0))
    ):
        raise r.fail(
            "input.normalize_in_graph",
            "true for a uint8 input with mean/std (a uint8 tensor cannot carry normalised values)",
            False,
        )
    return input_spec


def _parse_outputs(r: FieldReader, doc: Mapping[str, Any]) -> tuple[OutputSpec, ...]:
    """The card's ``outputs``, at least one, names unique."""
    outputs_doc = r.get(doc, "outputs", "", list, "a list of {name, shape, dtype}")
    if not outputs_doc:
        raise r.fail("outputs", "at least one output", outputs_doc)
    outputs = []
    for i, o in enumerate(outputs_doc):
        where = f"outputs[{i}]"
        if not isinstance(o, dict):
            raise r.fail(where, "an object", o)
        shape = r.get(o, "shape", where, list, "a list of dims")
        outputs.append(
            OutputSpec(
                name=r.get(o, "name", where, str, "a string"),
                shape=tuple(parse_dim(r, d, f"{where}.shape[{j}]") for j, d in enumerate(shape)),
                dtype=r.choice(o, "dtype", where, OUTPUT_DTYPES, "float32"),
            )
        )
    names = [o.name for o in outputs]
    if len(set(names)) != len(names):
        raise r.fail("outputs", "unique names", names)
    return tuple(outputs)


def _parse_classes(r: FieldReader, doc: Mapping[str, Any]) -> tuple[ClassSpec, ...]:
    """The card's ``classes``: names, or ``{name, color}`` objects."""
    classes_doc = r.get(doc, "classes", "", list, "a list of {name, color}")
    if not classes_doc:
        raise r.fail("classes", "at least one class", classes_doc)
    classes = []
    for i, c in enumerate(classes_doc):
        where = f"classes[{i}]"
        if isinstance(c, str):
            classes.append(ClassSpec(c))
            continue
        if not isinstance(c, dict):
            raise r.fail(where, "an object {name, color}", c)
        color = r.get(c, "color", where, str, "#rrggbb", "#ff0000")
        if len(color) != 7 or color[0] != "#" or any(ch not in "0123456789abcdefABCDEF" for ch in color[1:]):
            raise r.fail(f"{where}.color", "#rrggbb", color)
        classes.append(ClassSpec(r.get(c, "name", where, str, "a string"), color))
    return tuple(classes)


def _parse_heatmap(r: FieldReader, doc: Mapping[str, Any], output_names: list[str]) -> HeatmapSpec | None:
    """The card's ``heatmap`` (one of ``output_names``), or None."""
    hm = r.get(doc, "heatmap", "", dict, "an object or null", None, optional=True)
    if hm is None:
        return None
    stride = r.get(hm, "stride", "heatmap", int, "a positive int (tile pixels per cell)")
    if stride <= 0:
        raise r.fail("heatmap.stride", "a positive int", stride)
    hm_classes = r.get(hm, "classes", "heatmap", list, "a list of channel names")
    if not hm_classes or not all(isinstance(c, str) for c in hm_classes):
        raise r.fail("heatmap.classes", "a non-empty list of strings", hm_classes)
    heatmap = HeatmapSpec(
        output=r.get(hm, "output", "heatmap", str, "an output name"),
        stride=stride,
        classes=tuple(hm_classes),
        activation=r.choice(hm, "activation", "heatmap", HEATMAP_ACTIVATIONS, "none"),
    )
    if heatmap.output not in output_names:
        raise r.fail("heatmap.output", f"one of the outputs {output_names}", heatmap.output)
    return heatmap


def load_card(path: str | os.PathLike[str], *, verify_sha256: bool = True, verify_model: bool = True) -> ModelCard:
    """Read and validate a model card.

    ``path`` is the card (``NAME.card.json``) or the model file beside it.
    With ``verify_sha256`` the model file must hash to the card's ``sha256``
    (an ONNX file or a ``.pt2`` program alike); with ``verify_model`` an
    ONNX model's input and output names, dtypes and fixed dims must match
    the card (read with ``onnx``, or ``onnxruntime`` without it), and a
    ``.pt2`` must be a ``torch.export`` archive (its signature is checked
    when the torch backend loads it: reading it needs torch).
    A shipped model may be named alone (``defects_industrial``, :func:`~.shipped.resolve_model`).
    Raises ModelError for a malformed card and for a missing or
    mismatching model file.
    """
    p = resolve_model(path)
    if not p.name.endswith(CARD_SUFFIX) and p.suffix != ".json":
        p = card_path_for(p)
    if not p.is_file():
        names = ", ".join(shipped_names()) or "none found"
        raise ModelError(
            f"{p}: model card not found (expected a JSON card beside the model, or the name of a shipped "
            f"model: {names})"
        )
    card = parse_card(read_card_json(p), p)
    if not card.model_path.is_file():
        raise ModelError(f"{p}: model_file {card.model_path} does not exist")
    if verify_sha256:
        found = file_sha256(card.model_path)
        if found != card.sha256:
            raise ModelError(
                f"{card.model_path}: SHA-256 does not match its card {p}: expected {card.sha256}, found {found}"
            )
    if verify_model:
        verify_model_file(card)
    return card


# The card's fields and limits are defined in card_spec and handed on here, where cards are read.
__all__ = ["card_path_for", "file_sha256", "format_for", "load_card", "parse_card", "require_onnx", "write_card"]
