"""Whether a model file is what its card says: the graph's input and outputs against the card's.

An ONNX graph's signature is read with ``onnx`` (or onnxruntime without it); a ``.pt2`` is checked
to be a ``torch.export`` archive here and its signature by the torch backend
(:func:`check_signature_matches_card`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from .card_fields import Dim

if TYPE_CHECKING:
    from .card_spec import ModelCard

# ONNX TensorProto element types -> card dtype names.
_ONNX_ELEM_TYPES = {1: "float32", 2: "uint8", 6: "int32", 7: "int64", 9: "bool", 10: "float16"}
# onnxruntime NodeArg.type strings -> card dtype names.
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(uint8)": "uint8",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
    "tensor(float16)": "float16",
}


def verify_model_file(card: ModelCard) -> None:
    """Raise ModelError unless the card's model file is what the card describes.

    An ONNX model's input and output names, dtypes and fixed dims must match the card (read with
    ``onnx``, or ``onnxruntime`` without it); a ``.pt2`` must be a ``torch.export`` archive.
    ``load_card(..., verify_model=True)`` calls it; a caller that loads the card where the model
    does not run (a batch's parent process) leaves it to the process that builds the pipeline.
    """
    if card.format == "torch_export":
        import zipfile

        if not zipfile.is_zipfile(card.model_path):
            raise ModelError(
                f"{card.model_path}: not a torch.export program: expected the zip archive "
                "torch.export.save writes, found another kind of file"
            )
    elif card.model_path.suffix == ".onnx":
        check_onnx_matches_card(card)


def _onnx_signature(
    model_path: Path,
) -> tuple[dict[str, tuple[str, tuple[Dim, ...]]], dict[str, tuple[str, tuple[Dim, ...]]]]:
    """{name: (dtype, shape)} of the graph's real inputs and of its outputs."""
    try:
        import onnx
    except ImportError:
        onnx = None
    if onnx is not None:
        try:
            model = onnx.load(str(model_path), load_external_data=False)
        except Exception as exc:  # onnx raises DecodeError and others for a corrupt file
            raise ModelError(f"{model_path}: cannot be read as ONNX: {exc}") from exc
        initializers = {init.name for init in model.graph.initializer}

        def sig(values) -> dict[str, tuple[str, tuple[Dim, ...]]]:
            out = {}
            for v in values:
                if v.name in initializers:
                    continue
                t = v.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
                out[v.name] = (_ONNX_ELEM_TYPES.get(t.elem_type, f"onnx-type-{t.elem_type}"), dims)
            return out

        return sig(model.graph.input), sig(model.graph.output)
    sess = ort_session(model_path)
    return ort_signature(sess.get_inputs()), ort_signature(sess.get_outputs())


def ort_session(model_path: str | os.PathLike[str]) -> Any:
    """An onnxruntime CPU session of the model, or ModelError naming the file."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ModelError(f"{model_path}: cannot be loaded by onnxruntime: {exc}") from exc


def ort_signature(args: Sequence[Any]) -> dict[str, tuple[str, tuple[Dim, ...]]]:
    """{name: (card dtype name, shape)} of onnxruntime NodeArgs (a session's inputs or outputs)."""
    return {a.name: (_ORT_TYPES.get(a.type, a.type), tuple(a.shape)) for a in args}


def _dims_conflict(expected: Dim, found: Dim) -> bool:
    return isinstance(expected, int) and isinstance(found, int) and expected != found


def check_onnx_matches_card(card: ModelCard) -> None:
    """Raise ModelError unless the ONNX file's input/outputs agree with the card."""
    check_signature_matches_card(card, *_onnx_signature(card.model_path))


def check_signature_matches_card(
    card: ModelCard,
    inputs: Mapping[str, tuple[str, tuple[Dim, ...]]],
    outputs: Mapping[str, tuple[str, tuple[Dim, ...]]],
) -> None:
    """Raise ModelError unless a model's ``{name: (dtype, shape)}`` input and outputs agree with the card."""
    where = f"{card.model_path} (card {card.card_path})"
    if len(inputs) != 1 or card.input.name not in inputs:
        raise ModelError(f"{where}: input: expected one input named {card.input.name!r}, found {sorted(inputs)}")
    dtype, shape = inputs[card.input.name]
    if dtype != card.input.dtype:
        raise ModelError(f"{where}: input {card.input.name!r} dtype: expected {card.input.dtype}, found {dtype}")
    h, w = card.input.size_hw
    expected_shape: tuple[Dim, ...] = (None, h, w, 3) if card.input.layout == "NHWC" else (None, 3, h, w)
    if len(shape) != 4 or any(_dims_conflict(e, f) for e, f in zip(expected_shape, shape, strict=True)):
        raise ModelError(
            f"{where}: input {card.input.name!r} shape: expected {card.input.layout} "
            f"{list(expected_shape)}, found {list(shape)}"
        )
    expected_names = [o.name for o in card.outputs]
    if sorted(expected_names) != sorted(outputs):
        raise ModelError(f"{where}: outputs: expected {sorted(expected_names)}, found {sorted(outputs)}")
    for spec in card.outputs:
        dtype, shape = outputs[spec.name]
        if dtype != spec.dtype:
            raise ModelError(f"{where}: output {spec.name!r} dtype: expected {spec.dtype}, found {dtype}")
        if len(shape) != len(spec.shape) or any(_dims_conflict(e, f) for e, f in zip(spec.shape, shape, strict=True)):
            raise ModelError(f"{where}: output {spec.name!r} shape: expected {list(spec.shape)}, found {list(shape)}")
