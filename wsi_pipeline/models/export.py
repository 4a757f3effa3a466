"""Export a trained :class:`CenterNetSmall` to ONNX and write its model card."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..inference.card import card_path_for, file_sha256, write_card
from ..inference.card_spec import ClassSpec, DecoderSpec, HeatmapSpec, InputSpec, ModelCard, OutputSpec
from .net import OBJECT_STRIDE, REGION_STRIDE, CenterNetSmall, DetectorWithDecode

OPSET = 17
INPUT_NAME = "image"
OUTPUT_NAMES = ("boxes", "scores", "labels", "heatmap")


def export_onnx(net: CenterNetSmall, path: str | os.PathLike[str], top_k: int, tile_px: int = 512) -> Path:
    """Write the uint8-NHWC-in, boxes/scores/labels/heatmap-out graph (dynamic batch) to ``path``."""
    model = DetectorWithDecode(net, top_k=top_k, tile_size_px=tile_px).eval()
    example = torch.zeros(1, tile_px, tile_px, 3, dtype=torch.uint8)
    output_names = OUTPUT_NAMES if net.num_region_classes else OUTPUT_NAMES[:3]
    axes = {name: {0: "batch"} for name in (INPUT_NAME, *output_names)}
    path = Path(path)
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns that the fixed tile size becomes a constant: intended.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # The TorchScript-based exporter writes one self-contained file with
        # plain ONNX ops; the dynamo exporter would add external data files.
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=[INPUT_NAME],
            output_names=list(output_names),
            dynamic_axes=axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    return path


def card_for_export(
    model_path: str | os.PathLike[str],
    *,
    name: str,
    version: str,
    class_names: Sequence[str],
    class_colors: Sequence[str],
    region_classes: Sequence[str],
    top_k: int,
    mpp: float | None,
    score_threshold: float,
    nms_iou: float | None = None,
    tile_px: int = 512,
    extra: dict[str, Any] | None = None,
) -> ModelCard:
    """The card of an exported :class:`DetectorWithDecode` graph (sha256 of the file filled in)."""
    from .net import IMAGENET_MEAN_RGB, IMAGENET_STD_RGB

    model_path = Path(model_path).resolve()
    s = tile_px // REGION_STRIDE
    return ModelCard(
        name=name,
        version=version,
        model_path=model_path,
        sha256=file_sha256(model_path),
        input=InputSpec(
            INPUT_NAME,
            (tile_px, tile_px),
            "NHWC",
            "uint8",
            "RGB",
            tuple(round(v, 4) for v in IMAGENET_MEAN_RGB),
            tuple(round(v, 4) for v in IMAGENET_STD_RGB),
            True,
        ),
        outputs=(
            OutputSpec("boxes", ("batch", top_k, 4), "float32"),
            OutputSpec("scores", ("batch", top_k), "float32"),
            OutputSpec("labels", ("batch", top_k), "int32"),
            *([OutputSpec("heatmap", ("batch", len(region_classes), s, s), "float32")] if region_classes else []),
        ),
        decoder=DecoderSpec(
            "centernet",
            {
                "boxes": "boxes",
                "scores": "scores",
                "labels": "labels",
                "score_threshold": float(score_threshold),
                **({} if nms_iou is None else {"iou_threshold": nms_iou}),
            },
        ),
        classes=tuple(ClassSpec(n, c) for n, c in zip(class_names, class_colors, strict=True)),
        mpp=mpp,
        heatmap=HeatmapSpec("heatmap", REGION_STRIDE, tuple(region_classes), "none") if region_classes else None,
        precision="fp32",
        card_path=card_path_for(model_path),
        extra={"object_stride": OBJECT_STRIDE, **(extra or {})},
    )


def export_with_card(net: CenterNetSmall, model_path: str | os.PathLike[str], **card_kwargs: Any) -> ModelCard:
    """Export ``net`` to ``model_path`` and write ``NAME.card.json`` beside it; return the card."""
    export_onnx(net, model_path, top_k=card_kwargs["top_k"], tile_px=card_kwargs.get("tile_px", 512))
    card = card_for_export(model_path, **card_kwargs)
    write_card(card)
    return card
