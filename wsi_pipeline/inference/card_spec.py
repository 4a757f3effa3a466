"""What a model card holds: its fields as frozen dataclasses, and the limits and names they take.

:class:`ModelCard` and its parts are read and checked by :func:`~.card.load_card`
(docs/model_card.md); the decoders, the model-file check and the backends take
them from here, below the parser that fills them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelError
from .card_fields import Dim

CARD_SUFFIX = ".card.json"
SCHEMA_VERSION = 1
LAYOUTS = ("NHWC", "NCHW")
INPUT_DTYPES = ("uint8", "float32", "float16")
CHANNEL_ORDERS = ("RGB", "BGR")
HEATMAP_ACTIVATIONS = ("none", "sigmoid", "softmax")
PRECISIONS = ("fp32", "fp16", "int8")
OUTPUT_DTYPES = ("float32", "float16", "int32", "int64", "uint8", "bool")
# The card's ``format``: ``onnx`` (an ONNX graph; every backend runs it) or ``torch_export``
# (a program saved with ``torch.export.save``; only the torch backend runs it). Without the
# field the model file's extension decides: ``.pt2`` is ``torch_export``, anything else ``onnx``.
MODEL_FORMATS = ("onnx", "torch_export")
TORCH_EXPORT_SUFFIX = ".pt2"
# The largest tile, and so the largest model input side accepted (pixels): a tile is read, held
# and batched whole. The run's ``tile`` setting is bound by it too.
MAX_TILE = 4096
MAX_INPUT_SIDE = MAX_TILE
# Resolutions (micrometres per pixel) from 1 pm to 1 m: beyond, the grid's arithmetic overflows.
MIN_MPP, MAX_MPP = 1e-6, 1e6
# Detections a tile may give (``max_detections_per_tile``; the default where a card sets none). Beyond
# it the lowest scores are dropped before anything is allocated for them, and counted in summary.json.
DEFAULT_MAX_DETECTIONS_PER_TILE = 10_000
MAX_DETECTIONS_PER_TILE = 1_000_000


@dataclass(frozen=True)
class InputSpec:
    """The model's image input.

    ``size_hw`` is (height, width) in pixels of one tile. ``mean``/``std`` are
    per channel in the card's ``channel_order`` and in the input's value range
    (0..255 for uint8 tiles). With ``normalize_in_graph`` the graph applies
    them itself and the backend feeds raw pixels; otherwise the backend feeds
    ``(pixel - mean) / std`` in ``dtype``.
    """

    name: str
    size_hw: tuple[int, int]
    layout: str = "NHWC"
    dtype: str = "uint8"
    channel_order: str = "RGB"
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    normalize_in_graph: bool = True


@dataclass(frozen=True)
class OutputSpec:
    """One model output: its name, shape (ints fixed; strings or None dynamic) and dtype."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class DecoderSpec:
    """Which decoder turns the outputs into boxes (a name in :mod:`.decoder_registry`), and its parameters."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClassSpec:
    """An object class: display name and colour (``#rrggbb``)."""

    name: str
    color: str = "#ff0000"


@dataclass(frozen=True)
class HeatmapSpec:
    """The region heatmap output.

    ``output`` names a ``[B, C, H/stride, W/stride]`` output; ``stride`` is in
    tile pixels per heatmap cell; ``classes`` names the C channels;
    ``activation`` is what the decoder applies to the raw output to get
    probabilities (``none`` when the graph already outputs them).
    """

    output: str
    stride: int
    classes: tuple[str, ...]
    activation: str = "none"


@dataclass(frozen=True)
class ModelCard:
    """A validated model card. ``model_path`` is absolute; ``card_path`` is where it was read."""

    name: str
    version: str
    model_path: Path
    sha256: str
    input: InputSpec
    outputs: tuple[OutputSpec, ...]
    decoder: DecoderSpec
    classes: tuple[ClassSpec, ...]
    mpp: float | None = None
    heatmap: HeatmapSpec | None = None
    precision: str = "fp32"
    card_path: Path | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    format: str = "onnx"
    max_detections_per_tile: int | None = None  # None: DEFAULT_MAX_DETECTIONS_PER_TILE

    @property
    def detections_cap(self) -> int:
        """At most this many detections a tile: the rest, the lowest scores, are dropped and counted."""
        return self.max_detections_per_tile or DEFAULT_MAX_DETECTIONS_PER_TILE

    @property
    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]

    def output(self, name: str) -> OutputSpec:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        raise ModelError(f"{self.card_path}: no output named {name!r} (outputs: {[o.name for o in self.outputs]})")

    def to_dict(self) -> dict[str, Any]:
        """The card as the JSON document :func:`load_card` reads (model path relative to the card)."""
        base = self.card_path.parent if self.card_path is not None else self.model_path.parent
        model_file = os.path.relpath(self.model_path, base)
        doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "version": self.version,
            "model_file": model_file.replace(os.sep, "/"),
            "sha256": self.sha256,
            "precision": self.precision,
            "input": {
                "name": self.input.name,
                "size": list(self.input.size_hw),
                "layout": self.input.layout,
                "dtype": self.input.dtype,
                "channel_order": self.input.channel_order,
                "mean": list(self.input.mean),
                "std": list(self.input.std),
                "normalize_in_graph": self.input.normalize_in_graph,
            },
            "mpp": self.mpp,
            "outputs": [{"name": o.name, "shape": list(o.shape), "dtype": o.dtype} for o in self.outputs],
            "decoder": {"type": self.decoder.type, "params": dict(self.decoder.params)},
            "classes": [{"name": c.name, "color": c.color} for c in self.classes],
            "heatmap": None
            if self.heatmap is None
            else {
                "output": self.heatmap.output,
                "stride": self.heatmap.stride,
                "classes": list(self.heatmap.classes),
                "activation": self.heatmap.activation,
            },
        }
        if self.format != "onnx":
            doc["format"] = self.format
        if self.max_detections_per_tile is not None:  # left out when unset: older cards keep their digest
            doc["max_detections_per_tile"] = self.max_detections_per_tile
        doc.update(dict(self.extra))
        return doc
