"""FP16 and INT8 (explicit Q/DQ) variants of an ONNX model, each with its own card.

TensorRT 10+ takes precision from the ONNX file itself, so the variants are
ONNX files:

- ``fp16``: float tensors of the network trunk converted to float16 with the
  converter shipped in ``onnxruntime.transformers.float16`` (the same code as
  onnxconverter-common), graph inputs/outputs kept in their types. Nodes that
  are not needed to compute any convolution (the in-graph decoding: peak
  extraction, TopK, index arithmetic) stay float32: index arithmetic in float16
  is wrong above 2048.
- ``int8``: ONNX Runtime's ``quantize_static`` in QDQ format, symmetric int8
  activations and per-channel symmetric int8 weights (what TensorRT expects
  of explicit quantization), calibrated on representative tiles. Only the
  trunk's convolutions are quantized; the output heads and the decoding stay
  float32.

The variant's card is the source card with ``precision``, ``model_file`` and
``sha256`` replaced.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import ConfigError, ModelError
from ..inference.card import file_sha256, load_card, require_onnx, write_card
from ..inference.card_spec import ModelCard
from ..inference.ort_backend import prepare_input

PRECISIONS = ("fp16", "int8")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
CALIBRATION_EXTENSIONS = (".jpg", ".jpeg", ".png")


def variant_path(model_path: str | os.PathLike[str], precision: str) -> Path:
    """``engines/NAME.onnx`` -> ``engines/NAME.int8.onnx`` (or ``.fp16.onnx``)."""
    p = Path(model_path)
    return p.with_name(f"{p.stem}.{precision}{p.suffix}")


def _convolution_nodes(model) -> tuple[set[str], set[str]]:
    """(names of Conv nodes, names of nodes that some Conv depends on)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    convs = {n.name for n in model.graph.node if n.op_type == "Conv"}
    upstream: set[str] = set()
    stack = [n for n in model.graph.node if n.op_type == "Conv"]
    while stack:
        node = stack.pop()
        for name in node.input:
            prod = producers.get(name)
            if prod is not None and prod.name not in upstream:
                upstream.add(prod.name)
                stack.append(prod)
    return convs, upstream


def _ensure_node_names(model) -> None:
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"


def _downstream_of_conv(model) -> set[str]:
    """Names of the nodes that depend on some Conv output (Conv nodes not included)."""
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    seen: set[str] = set()
    stack = [out for n in model.graph.node if n.op_type == "Conv" for out in n.output]
    while stack:
        for node in consumers.get(stack.pop(), []):
            if node.name not in seen:
                seen.add(node.name)
                stack.extend(node.output)
    return seen


def convert_fp16(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Write a float16 copy of ``src``: the convolution trunk in fp16, everything else unchanged.

    The trunk is every Conv and every node between two convolutions (ReLU,
    Add, Resize, ...). Its float initializers become fp16; a Cast to fp16 goes
    in front of each trunk input coming from outside, a Cast to fp32 after
    each trunk output used outside. Hand-written because the converter in
    onnxconverter-common / onnxruntime.transformers rounds every tensor
    between two blocked nodes through fp16, which breaks the in-graph index
    arithmetic (integers above 2048 are not exact in fp16).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    _ensure_node_names(model)
    convs, upstream = _convolution_nodes(model)
    trunk = convs | (upstream & _downstream_of_conv(model))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    float_tensors = {
        v.name
        for v in (*graph.input, *graph.value_info, *graph.output)
        if v.type.tensor_type.elem_type == TensorProto.FLOAT
    }
    producers = {out: node for node in graph.node for out in node.output}
    new_nodes = []
    casts_in: dict[str, str] = {}
    for node in graph.node:
        if node.name in trunk:
            for k, name in enumerate(node.input):
                if not name or (node.op_type == "Resize" and k > 0):
                    continue  # Resize's roi/scales/sizes keep their types
                if name in inits and inits[name].data_type == TensorProto.FLOAT:
                    init = inits[name]
                    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), name))
                elif name not in inits and (producers.get(name) is None or producers[name].name not in trunk):
                    if name not in casts_in:
                        casts_in[name] = f"{name}_fp16"
                        new_nodes.append(
                            helper.make_node(
                                "Cast", [name], [casts_in[name]], name=f"{name}_to_fp16", to=TensorProto.FLOAT16
                            )
                        )
                    node.input[k] = casts_in[name]
        new_nodes.append(node)
    # Trunk outputs read outside the trunk (or by the graph) go back to fp32.
    outside_reads = {name for n in graph.node if n.name not in trunk for name in n.input}
    outside_reads |= {o.name for o in graph.output}
    final = []
    renamed: dict[str, str] = {}
    for node in new_nodes:
        if node.name in trunk:
            for k, out in enumerate(node.output):
                if out in outside_reads:
                    half = f"{out}_fp16"
                    node.output[k] = half
                    renamed[out] = half
                    final.append(node)
                    final.append(helper.make_node("Cast", [half], [out], name=f"{out}_to_fp32", to=TensorProto.FLOAT))
                    break
            else:
                final.append(node)
            continue
        final.append(node)
    # Trunk consumers of a renamed output read the fp16 tensor directly.
    for node in final:
        if node.name in trunk:
            for k, name in enumerate(node.input):
                if name in renamed:
                    node.input[k] = renamed[name]
    del graph.node[:]
    graph.node.extend(final)
    del graph.value_info[:]
    del float_tensors
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))
    return Path(dst)


class TileCalibrationReader:
    """An ``onnxruntime.quantization.CalibrationDataReader`` over ``N x H x W x 3 uint8`` tiles.

    Feeds batches of ``batch`` tiles, converted to the card's input format.
    """

    def __init__(self, tiles: np.ndarray, card: ModelCard, batch: int = 8):
        self.tiles = tiles
        self.card = card
        self.batch = batch
        self._it: Iterator[dict[str, np.ndarray]] | None = None

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, len(self.tiles), self.batch):
            yield {self.card.input.name: prepare_input(self.tiles[i : i + self.batch], self.card)}

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = self._batches()
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = None


def load_calibration_tiles(
    source: str | os.PathLike[str], size_hw: tuple[int, int], limit: int | None = None
) -> np.ndarray:
    """Tiles for calibration: a folder of JPEG/PNG files (sorted by name, searched
    recursively) or a ``.npz`` holding an ``N x H x W x 3 uint8`` array ``tiles``.

    Tiles of another size are resized (area interpolation) to ``size_hw``.
    Returns ``N x H x W x 3 uint8`` RGB.
    """
    import cv2

    src = Path(source)
    if src.is_file() and src.suffix == ".npz":
        with np.load(src) as data:
            if "tiles" not in data:
                raise ConfigError(f"{src}: expected an array named 'tiles', found {sorted(data.files)}")
            tiles = list(data["tiles"][:limit])
    elif src.is_dir():
        files = sorted(p for p in src.rglob("*") if p.suffix.lower() in CALIBRATION_EXTENSIONS)
        if limit is not None:
            files = files[:limit]
        tiles = []
        for f in files:
            img = cv2.imread(str(f), cv2.IMREAD_COLOR)
            if img is None:
                raise ConfigError(f"{f}: cannot be decoded as an image")
            tiles.append(img[..., ::-1])
    else:
        raise ConfigError(f"{src}: calibration data: expected a folder of tiles or a .npz file, found neither")
    if not tiles:
        raise ConfigError(f"{src}: calibration data: expected at least one tile, found none")
    h, w = size_hw
    out = np.empty((len(tiles), h, w, 3), np.uint8)
    for i, t in enumerate(tiles):
        if t.ndim != 3 or t.shape[2] != 3:
            raise ConfigError(f"{src}: calibration tile {i}: expected HxWx3, found {list(t.shape)}")
        out[i] = t if t.shape[:2] == (h, w) else cv2.resize(t, (w, h), interpolation=cv2.INTER_AREA)
    return out


def quantize_int8(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], card: ModelCard, tiles: np.ndarray, method: str = "minmax"
) -> Path:
    """Write an explicit-Q/DQ int8 copy of ``src`` calibrated on ``tiles`` (``N x H x W x 3 uint8``)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in CALIBRATION_METHODS:
        raise ConfigError(f"calibration method: expected one of {list(CALIBRATION_METHODS)}, found {method!r}")
    calib = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    with tempfile.TemporaryDirectory(prefix="wsi-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # Shape inference and graph cleanup, as onnxruntime recommends before quantizing.
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        model = onnx.load(str(prepared))
        _ensure_node_names(model)
        onnx.save(model, str(prepared))
        convs, upstream = _convolution_nodes(model)
        # The output heads (convolutions no other convolution reads) stay
        # float: they are 1x1 and cheap, and their logits set the scores
        # that the score threshold cuts.
        quantized = convs & upstream
        exclude = [n.name for n in model.graph.node if n.name not in quantized]
        quantize_static(
            str(prepared),
            str(dst),
            TileCalibrationReader(tiles, card),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["Conv"],
            nodes_to_exclude=exclude,
            calibrate_method=calib,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "CalibTensorRangeSymmetric": True},
        )
    return Path(dst)


def make_variant(
    model: str | os.PathLike[str] | ModelCard,
    precision: str,
    calibration: str | os.PathLike[str] | np.ndarray | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    method: str = "minmax",
    limit: int | None = None,
) -> ModelCard:
    """Make the ``precision`` variant of a model and write its card; return the new card.

    ``model``: a card, or a card/model path. ``calibration`` (int8 only): a
    folder of tiles, a ``.npz`` or an ``N x H x W x 3 uint8`` array; ``limit``
    caps the tiles used. ``out`` defaults to ``NAME.PRECISION.onnx`` beside
    the source model.
    """
    card = model if isinstance(model, ModelCard) else load_card(model)
    require_onnx(card, "quantization")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision: expected one of {list(PRECISIONS)}, found {precision!r}")
    if card.precision != "fp32":
        raise ModelError(f"{card.model_path}: expected an fp32 source model, found precision {card.precision}")
    dst = Path(out) if out is not None else variant_path(card.model_path, precision)
    if dst.resolve() == card.model_path:
        raise ConfigError(f"{dst}: output must differ from the source model")
    if precision == "fp16":
        convert_fp16(card.model_path, dst)
    else:
        if calibration is None:
            raise ConfigError("int8 needs calibration tiles (--calibration FOLDER or .npz)")
        tiles = (
            calibration[:limit]
            if isinstance(calibration, np.ndarray)
            else load_calibration_tiles(calibration, card.input.size_hw, limit)
        )
        quantize_int8(card.model_path, dst, card, tiles, method)
    extra = dict(card.extra)
    extra["source_model"] = {"file": card.model_path.name, "sha256": card.sha256}
    if precision == "int8":
        extra["calibration"] = {
            "method": method,
            "tiles": int(len(tiles)),
            "source": (
                None if isinstance(calibration, np.ndarray) else os.path.basename(os.path.normpath(str(calibration)))
            ),
        }
    new = dataclasses.replace(
        card, model_path=dst.resolve(), sha256=file_sha256(dst), precision=precision, card_path=None, extra=extra
    )
    path = write_card(new)
    return load_card(path)
