"""The decoders a card may name: one :class:`DecoderEntry` each, and the checks of a card's decoder params.

A decoder is added with one call, :func:`register_decoder`: its name (the card's
``decoder.type``), its parameter table, its decode functions (per tile and per
batch) and whether a CUDA executor compacts its outputs on the device before the
copy back. The card parser, :func:`~.decoders.decode` and the executor all read
this registry. The built-in decoders (``centernet``, ``boxes_scores_labels``,
``yolo``) are registered by :mod:`.decoders`, which the package imports.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ModelError
from ..plugins import DECODERS_GROUP, carry
from ..validation import is_instance

if TYPE_CHECKING:
    import numpy as np

    from .card_spec import ModelCard
    from .tile_detections import BatchDetections, TileDetections

# A decoder's parameters: ``{name: (accepted types, default)}``.
ParamTable = Mapping[str, tuple[type | tuple[type, ...], Any]]


class BatchDecoder(Protocol):
    """A decoder's batch function: one batch's raw model outputs -> its detections as arrays.

    ``outputs``: ``{output name: array}``, each ``[B, ...]`` for a batch of ``B`` tiles (numpy on
    the host); ``card``: the model card, its params read with :func:`decoder_params`. Returns a
    :class:`~.tile_detections.BatchDetections`: ``boxes Mx4 float32`` xyxy in tile pixels of the
    model input (origin top-left, x right, y down), ``scores M float32``, ``labels M int64`` (indices
    into the card's classes), every tile's rows back to back and ``counts`` (``B int64``) saying how
    many each; ``heatmaps``: :func:`~.decoders.card_heatmaps` (None: attached by
    :func:`~.decoders.decode_batch`). The function must be defined at module level (it is sent to the
    processes a run starts by its module's name).
    """

    def __call__(self, outputs: Mapping[str, np.ndarray], card: ModelCard) -> BatchDetections: ...


class Decoder(Protocol):
    """A decoder's per-tile function: the same detections as its :class:`BatchDecoder`, one
    :class:`~.tile_detections.TileDetections` per tile (``BatchDetections.tiles()`` gives them)."""

    def __call__(self, outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]: ...


@dataclass(frozen=True)
class DecoderEntry:
    """One decoder a card may name.

    Args:
        name: the card's ``decoder.type``.
        params: ``{param: (accepted types, default)}``; a card's unknown or mistyped param is refused.
        decode: a batch's raw outputs -> one :class:`~.tile_detections.TileDetections` per tile.
        decode_batch: the same detections as one :class:`~.tile_detections.BatchDetections`.
        compacts_on_device: a CUDA executor sorts the rows the decoder keeps to the front on the
            device and copies back only those (the params must name ``boxes [B,N,4]``, ``scores
            [B,N]`` and ``labels [B,N]`` outputs; ``label_offset`` and ``num_detections`` are
            honoured where the table has them); otherwise the outputs are copied back whole.
        output_params: the params whose values name model outputs (each must be one of the
            card's outputs; null leaves it out): what the decoder reads.
        choices: ``{param: allowed values}`` for params limited to a few values.
    """

    name: str
    params: ParamTable
    decode: Decoder
    decode_batch: BatchDecoder
    compacts_on_device: bool = False
    output_params: tuple[str, ...] = ()
    choices: Mapping[str, Sequence[Any]] = field(default_factory=dict)


_REGISTRY: dict[str, DecoderEntry] = {}
DECODER_REGISTRY: Mapping[str, DecoderEntry] = types.MappingProxyType(_REGISTRY)


def register_decoder(entry: DecoderEntry, *, replace: bool = False) -> DecoderEntry:
    """Add ``entry`` to the decoders cards may name; ValueError where its name is taken (unless ``replace``)."""
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"decoder {entry.name!r} is already registered")
    missing = [k for k in (*entry.output_params, *entry.choices) if k not in entry.params]
    if missing:
        raise ValueError(f"decoder {entry.name!r}: expected params for {missing}, found {sorted(entry.params)}")
    _REGISTRY[entry.name] = entry
    return entry


def _added_decoders() -> list[DecoderEntry]:
    """The entries registered from outside the package (what a helper process is handed)."""
    return [e for e in _REGISTRY.values() if not e.decode.__module__.startswith("wsi_pipeline.")]


def _restore_decoders(entries: list[DecoderEntry]) -> None:
    for entry in entries:
        if entry.name not in _REGISTRY:
            register_decoder(entry)


carry(_added_decoders, _restore_decoders, DECODERS_GROUP)


def unregister_decoder(name: str) -> None:
    """Remove the decoder named ``name`` (nothing where there is none)."""
    _REGISTRY.pop(name, None)


def decoder_types() -> tuple[str, ...]:
    """The names a card's ``decoder.type`` may take now, in registration order."""
    return tuple(_REGISTRY)


def decoder_entry(card: ModelCard) -> DecoderEntry:
    """The registry entry of the decoder ``card`` names; ModelError where none is registered."""
    try:
        return _REGISTRY[card.decoder.type]
    except KeyError:
        raise ModelError(
            f"{card.card_path}: field 'decoder.type': expected one of {list(_REGISTRY)}, found {card.decoder.type!r}"
        ) from None


class EntryField(Mapping[str, Any]):
    """A live read-only view ``{decoder name: entry.<attribute>}`` of the registry."""

    def __init__(self, attribute: str):
        self._attribute = attribute

    def __getitem__(self, name: str) -> Any:
        return getattr(_REGISTRY[name], self._attribute)

    def __iter__(self):
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._attribute!r}: {dict(self)!r})"


def decoder_params(card: ModelCard) -> dict[str, Any]:
    """The card's decoder params with defaults filled in."""
    table = decoder_entry(card).params
    params = {k: default for k, (_, default) in table.items()}
    params.update(card.decoder.params)
    return params


def validate_decoder_params(card: ModelCard) -> None:
    """Raise ModelError for unknown, mistyped or inconsistent decoder params of ``card``."""
    entry = decoder_entry(card)
    table = entry.params
    where = card.card_path
    for key, value in card.decoder.params.items():
        if key not in table:
            raise ModelError(
                f"{where}: field 'decoder.params.{key}': expected one of "
                f"{sorted(table)} for decoder {entry.name!r}, found unknown key"
            )
        kinds = table[key][0]
        if not is_instance(value, kinds):
            raise ModelError(f"{where}: field 'decoder.params.{key}': expected {_kind_name(kinds)}, found {value!r}")
    params = decoder_params(card)
    names = {o.name for o in card.outputs}
    for key in entry.output_params:
        if params[key] is not None and params[key] not in names:
            raise ModelError(
                f"{where}: field 'decoder.params.{key}': expected one of the outputs "
                f"{sorted(names)}, found {params[key]!r}"
            )
    for key, allowed in entry.choices.items():
        if params[key] not in allowed:
            raise ModelError(
                f"{where}: field 'decoder.params.{key}': expected one of {list(allowed)}, found {params[key]!r}"
            )
    for key in ("score_threshold", "iou_threshold"):
        if params.get(key) is not None and not 0.0 <= float(params[key]) <= 1.0:
            raise ModelError(
                f"{where}: field 'decoder.params.{key}': expected a number in [0, 1], found {params[key]!r}"
            )


def decode_names(card: ModelCard) -> list[str]:
    """The output names the decoder reads (heatmap included)."""
    p = decoder_params(card)
    names = [p[k] for k in decoder_entry(card).output_params if p.get(k)]
    if card.heatmap is not None:
        names.append(card.heatmap.output)
    return names


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
