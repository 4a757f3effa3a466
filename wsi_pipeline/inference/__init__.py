"""Model cards, output decoders and inference backends.

``load_card`` reads and checks a model card; ``create_backend(card, "ort")``
runs the model on ``N x H x W x 3 uint8`` tiles; ``decode`` turns a batch's
outputs into one :class:`TileDetections` per tile (boxes in tile pixels).
"""

from __future__ import annotations

from .backend import BACKENDS, Backend, create_backend
from .card import card_path_for, file_sha256, load_card, write_card
from .card_spec import ClassSpec, DecoderSpec, HeatmapSpec, InputSpec, ModelCard, OutputSpec
from .decoders import DECODERS, decode, get_decoder  # registers the built-in decoders
from .tile_detections import TileDetections

__all__ = [
    "BACKENDS",
    "DECODERS",
    "Backend",
    "ClassSpec",
    "DecoderSpec",
    "HeatmapSpec",
    "InputSpec",
    "ModelCard",
    "OutputSpec",
    "TileDetections",
    "card_path_for",
    "create_backend",
    "decode",
    "file_sha256",
    "get_decoder",
    "load_card",
    "write_card",
]
