"""A first model card for one's own ONNX model, and a check of a card before a run.

:func:`draft_card` reads what the ONNX file itself says through onnxruntime
(the graph's input and outputs: names, shapes, dtypes; the producer and the
model's metadata), guesses the input's layout (NHWC or NCHW, from the axis
of size 3) and tile size, and hashes the file. What the file cannot say is
left as a string starting with :data:`TODO` (the decoder, the classes, the
resolution ``mpp``; for a float input also ``mean`` and ``std``): such a
card is refused by :func:`~.card.load_card`, and :func:`check_card` lists
every field still to fill in. Guesses that may be wrong (layout, channel
order, precision, normalisation) are listed under the card's ``card_init``
key, which the parser keeps as an extra field.

:func:`check_card` then validates a filled-in card with the card's own
rules (:func:`~.card.load_card`: fields, SHA-256, the graph against the
card, the decoder's parameters) and runs one blank tile through ONNX
Runtime and the decoder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError, UsageError
from .card import card_path_for, file_sha256, format_for, load_card
from .card_fields import Dim, read_card_json
from .card_spec import INPUT_DTYPES, SCHEMA_VERSION, ModelCard
from .decoder_registry import decoder_types
from .model_signature import ort_session, ort_signature

TODO = "TODO"
CARD_INIT_KEY = "card_init"


def guess_layout(shape: tuple[Dim, ...], where: str) -> tuple[str, tuple[Dim, Dim]]:
    """(``NHWC`` or ``NCHW``, (height, width)) of a 4-d image input, from its axis of 3 channels."""
    if len(shape) != 4:
        raise ModelError(
            f"{where}: expected a 4-d image input (N x H x W x 3 or N x 3 x H x W), found shape {list(shape)}"
        )
    if shape[3] == 3 and shape[1] != 3:
        return "NHWC", (shape[1], shape[2])
    if shape[1] == 3:
        return "NCHW", (shape[2], shape[3])
    raise ModelError(f"{where}: expected 3 colour channels in axis 1 (NCHW) or 3 (NHWC), found shape {list(shape)}")


def draft_card(
    model_path: str | os.PathLike[str], card_path: str | os.PathLike[str] | None = None, name: str | None = None
) -> dict[str, Any]:
    """The JSON document of a first card for ``model_path`` (see the module docstring)."""
    model = Path(model_path)
    if format_for(model) != "onnx":
        raise ModelError(
            f"{model}: expected an ONNX model, found a torch.export program; card init reads "
            "ONNX graphs only: write a .pt2's card by hand (docs/model_card.md, format "
            "torch_export) and check it with card check"
        )
    if not model.is_file():
        raise ModelError(f"{model}: ONNX model not found")
    card_file = Path(card_path) if card_path is not None else card_path_for(model)
    sess = ort_session(model)
    inputs = ort_signature(sess.get_inputs())
    outputs = ort_signature(sess.get_outputs())
    if len(inputs) != 1:
        raise ModelError(f"{model}: the pipeline feeds one image input; the graph has {len(inputs)}: {sorted(inputs)}")
    ((in_name, (in_dtype, in_shape)),) = inputs.items()
    if in_dtype not in INPUT_DTYPES:
        raise ModelError(f"{model}: input {in_name!r}: expected one of {list(INPUT_DTYPES)}, found {in_dtype}")
    layout, (h, w) = guess_layout(in_shape, f"{model}: input {in_name!r}")
    fixed = isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0
    size: Any = [h, w] if fixed else f"{TODO}: [height, width] of one tile in pixels (the graph's are dynamic)"
    guessed = ["input.layout", "input.channel_order", "precision"]
    if in_dtype == "uint8":
        # A uint8 tensor cannot carry normalised values: the graph normalises, if at all.
        norm: dict[str, Any] = {"mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0], "normalize_in_graph": True}
        guessed.append("input.normalize_in_graph")
    else:
        norm = {
            "mean": f"{TODO}: per-channel mean in 0..255 units, e.g. [0, 0, 0] (with std [255, 255, 255] "
            "for a model that takes 0..1)",
            "std": f"{TODO}: per-channel std in 0..255 units, e.g. [255, 255, 255]",
            "normalize_in_graph": False,
        }
        guessed.append("input.normalize_in_graph")
    meta = sess.get_modelmeta()
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "name": name or model.stem,
        # onnxruntime reports an unset model_version as the largest int64
        "version": str(meta.version) if 0 < meta.version < 2**63 - 1 else "0",
        "model_file": os.path.relpath(model.resolve(), card_file.resolve().parent).replace(os.sep, "/"),
        "sha256": file_sha256(model),
        "precision": "fp16" if in_dtype == "float16" else "fp32",
        "input": {"name": in_name, "size": size, "layout": layout, "dtype": in_dtype, "channel_order": "RGB", **norm},
        "mpp": f"{TODO}: micrometres per pixel the model was trained at, or null (images without a scale: "
        "level 0 is read as it is)",
        "outputs": [{"name": n, "shape": list(s), "dtype": d} for n, (d, s) in outputs.items()],
        "decoder": {
            "type": f"{TODO}: one of {', '.join(decoder_types())} (docs/model_card.md, Decoders)",
            "params": {},
        },
        "classes": f'{TODO}: the object classes in label order, e.g. [{{"name": "nucleus", "color": "#7b2cbf"}}]',
        "heatmap": None,
        CARD_INIT_KEY: {
            "guessed": guessed,
            "note": "heatmap is null: set it if an output is a region map [B, C, H/stride, W/stride]",
            "onnx": {
                "producer": meta.producer_name,
                "graph": meta.graph_name,
                "description": meta.description,
                "metadata": dict(meta.custom_metadata_map),
            },
        },
    }
    return doc


def write_draft_card(
    model_path: str | os.PathLike[str],
    card_path: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
) -> tuple[Path, list[str]]:
    """Write :func:`draft_card` (beside the model by default); return its path and the fields to fill in.

    Refuses (UsageError) to replace an existing card unless ``force``.
    """
    out = Path(card_path) if card_path is not None else card_path_for(model_path)
    if out.exists() and not force:
        raise UsageError(f"{out}: a card is already there; choose another path, or --force (force=True) to replace it")
    doc = draft_card(model_path, out, name)
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return out, todo_fields(doc)


def todo_fields(doc: Any, where: str = "") -> list[str]:
    """Paths (``decoder.type``, ``classes``) of the values still starting with :data:`TODO`."""
    found: list[str] = []
    if isinstance(doc, str) and doc.startswith(TODO):
        found.append(where)
    elif isinstance(doc, dict):
        for k, v in doc.items():
            if not (where == "" and k == CARD_INIT_KEY):
                found += todo_fields(v, f"{where}.{k}" if where else str(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += todo_fields(v, f"{where}[{i}]")
    return found


def check_card(card_path: str | os.PathLike[str], run: bool = True) -> ModelCard:
    """Validate a card: no :data:`TODO` left, :func:`~.card.load_card`'s checks, and (``run``) one blank
    tile through ONNX Runtime and the decoder. Raises ModelError or ModelError naming the card."""
    path = Path(card_path)
    doc = read_card_json(path)
    try:
        todo = todo_fields(doc)
    except RecursionError:  # parsed just short of the interpreter's depth
        raise ModelError(f"{path}: not valid JSON: nested too deeply") from None
    if todo:
        raise ModelError(f"{path}: fields still to fill in: {', '.join(todo)}")
    card = load_card(path)
    if run:
        from .backend import create_backend
        from .decoders import decode

        # A torch.export program runs with torch only: on the CPU here, like ORT for an ONNX model.
        backend = (
            create_backend(card, "ort")
            if card.format == "onnx"
            else create_backend(card, "torch", device="cpu", precision="fp32")
        )
        try:
            h, w = card.input.size_hw
            decode(backend.infer(np.zeros((1, h, w, 3), np.uint8)), card)
        except Exception as exc:  # whatever a user's graph or a mismatched decoder raises
            raise ModelError(f"{path}: one blank tile through the model and the decoder failed: {exc}") from exc
        finally:
            backend.close()
    return card
