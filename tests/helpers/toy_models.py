"""Tiny hand-built ONNX detectors with their cards, one per decoder type.

They stand in for a user's own exported model in tests and examples: each
takes ``[N, H, W, 3] uint8`` tiles and returns fixed detections scaled by the
tile's brightest pixel (``max / 255``), so that a white tile yields the
listed scores and a black tile yields zeros. Built with ``onnx.helper``
(needs the ``onnx`` package).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from wsi_pipeline.inference.card import file_sha256, load_card, write_card
from wsi_pipeline.inference.card_spec import ClassSpec, DecoderSpec, HeatmapSpec, InputSpec, ModelCard, OutputSpec

# Detections of a white tile, in tile pixels (xyxy) for the boxes_scores_labels model.
TOY_BOXES = np.array([[2, 3, 12, 14], [20, 20, 30, 28], [5, 5, 9, 9]], np.float32)
TOY_SCORES = np.array([0.9, 0.6, 0.2], np.float32)
TOY_LABELS = np.array([1, 0, 1], np.int64)
# Raw YOLO rows (cx, cy, w, h, class scores...) for the yolo model; rows 0 and 1
# overlap heavily with the same class, row 2 overlaps row 0 with another class.
TOY_YOLO_ROWS = np.array(
    [
        [10, 10, 8, 8, 0.90, 0.05],
        [11, 10, 8, 8, 0.80, 0.10],
        [10, 11, 8, 8, 0.10, 0.70],
        [25, 25, 6, 4, 0.30, 0.20],
        [40, 40, 4, 4, 0.01, 0.02],
    ],
    np.float32,
)


def _brightness(helper, TensorProto, nodes: list) -> str:
    """Nodes computing ``max(tile) / 255`` as ``[N, 1, 1]`` float from input ``image``."""
    nodes += [
        helper.make_node("Cast", ["image"], ["image_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["image_f"], ["max4"], keepdims=1, axes=[1, 2, 3]),
        helper.make_node("Squeeze", ["max4", "axis3"], ["max3"]),
        helper.make_node("Div", ["max3", "c255"], ["bright"]),
    ]
    return "bright"


def build_toy_onnx(path: str | os.PathLike[str], decoder: str, tile_px: int = 32, heatmap_value: float = 1.0) -> Path:
    """Write a toy model for ``decoder`` ("boxes_scores_labels" or "yolo") to ``path``.

    Its heatmap is ``heatmap_value`` times the brightness (NaN or infinity for a hostile model).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes: list = []
    inits = [
        numpy_helper.from_array(np.array([3], np.int64), "axis3"),
        numpy_helper.from_array(np.array(255.0, np.float32), "c255"),
    ]
    bright = _brightness(helper, TensorProto, nodes)
    if decoder == "boxes_scores_labels":
        inits += [
            numpy_helper.from_array(TOY_BOXES[None], "boxes_c"),
            numpy_helper.from_array(TOY_SCORES[None], "scores_c"),
            numpy_helper.from_array(TOY_LABELS[None].astype(np.float32), "labels_c"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ]
        nodes += [
            helper.make_node("Mul", [bright, "zero"], ["zero3"]),  # [N,1,1] zeros
            helper.make_node("Add", ["boxes_c", "zero3"], ["boxes"]),  # [N,3,4]
            helper.make_node("Squeeze", [bright, "axis2"], ["bright2"]),  # [N,1]
            helper.make_node("Mul", ["scores_c", "bright2"], ["scores"]),  # [N,3]
            helper.make_node("Squeeze", ["zero3", "axis2"], ["zero2"]),
            helper.make_node("Add", ["labels_c", "zero2"], ["labels_f"]),
            helper.make_node("Cast", ["labels_f"], ["labels"], to=TensorProto.INT64),
        ]
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "axis2"))
        outputs = [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["N", 3, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["N", 3]),
        ]
    elif decoder == "yolo":
        rows = TOY_YOLO_ROWS.T[None].copy()  # [1, 4+C, N]
        boxes_part = rows.copy()
        boxes_part[:, 4:] = 0
        scores_part = rows.copy()
        scores_part[:, :4] = 0
        inits += [
            numpy_helper.from_array(boxes_part, "yolo_boxes"),
            numpy_helper.from_array(scores_part, "yolo_scores"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ]
        nodes += [
            helper.make_node("Mul", [bright, "zero"], ["zero3"]),
            helper.make_node("Mul", ["yolo_scores", bright], ["scaled"]),  # scores scale with brightness
            helper.make_node("Add", ["yolo_boxes", "zero3"], ["boxes_b"]),
            helper.make_node("Add", ["boxes_b", "scaled"], ["output0"]),  # [N, 4+C, rows]
        ]
        outputs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", 6, len(TOY_YOLO_ROWS)])]
    else:
        raise ValueError(f"no toy model for decoder {decoder!r}")
    # A region heatmap [N, 1, H/8, W/8] equal to the brightness everywhere.
    s = tile_px // 8
    inits.append(numpy_helper.from_array(np.full((1, 1, s, s), heatmap_value, np.float32), "ones_hm"))
    nodes += [
        helper.make_node("Unsqueeze", [bright, "axis3"], ["bright4"]),
        helper.make_node("Mul", ["ones_hm", "bright4"], ["heatmap"]),
    ]
    outputs.append(helper.make_tensor_value_info("heatmap", TensorProto.FLOAT, ["N", 1, s, s]))
    graph = helper.make_graph(
        nodes,
        f"toy_{decoder}",
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["N", tile_px, tile_px, 3])],
        outputs,
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save(model, str(path))
    return path


def build_toy_model(
    folder: str | os.PathLike[str], decoder: str, tile_px: int = 32, heatmap_value: float = 1.0, **decoder_params
) -> ModelCard:
    """Write ``toy_DECODER.onnx`` and its card into ``folder``; return the loaded card."""
    folder = Path(folder)
    model_path = build_toy_onnx(folder / f"toy_{decoder}.onnx", decoder, tile_px, heatmap_value)
    s = tile_px // 8
    if decoder == "boxes_scores_labels":
        outputs = (
            OutputSpec("boxes", ("N", 3, 4)),
            OutputSpec("scores", ("N", 3)),
            OutputSpec("labels", ("N", 3), "int64"),
        )
    else:
        outputs = (OutputSpec("output0", ("N", 6, len(TOY_YOLO_ROWS))),)
    card = ModelCard(
        name=f"toy_{decoder}",
        version="1",
        model_path=model_path.resolve(),
        sha256=file_sha256(model_path),
        input=InputSpec("image", (tile_px, tile_px), "NHWC", "uint8", "RGB"),
        outputs=(*outputs, OutputSpec("heatmap", ("N", 1, s, s))),
        decoder=DecoderSpec(decoder, decoder_params),
        classes=(ClassSpec("a", "#ff0000"), ClassSpec("b", "#00ff00")),
        mpp=None,
        heatmap=HeatmapSpec("heatmap", 8, ("bright",), "none"),
    )
    return load_card(write_card(card))
