"""A decoder added with one registry entry: cards name it, decode uses it, the executor follows its entry."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from helpers.toy_extensions import TOP_ONE, decode_top_one, decode_top_one_batch
from helpers.toy_models import TOY_BOXES, TOY_LABELS, TOY_SCORES, build_toy_model

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ModelError
from wsi_pipeline.inference import DECODERS, decode
from wsi_pipeline.inference.backend import create_backend
from wsi_pipeline.inference.card import load_card, write_card
from wsi_pipeline.inference.card_spec import DecoderSpec
from wsi_pipeline.inference.decoder_registry import (
    DECODER_REGISTRY,
    DecoderEntry,
    decoder_types,
    register_decoder,
    unregister_decoder,
)
from wsi_pipeline.inference.decoders import BATCH_DECODERS, card_heatmaps, decode_batch
from wsi_pipeline.inference.device_decode import DeviceDecoder
from wsi_pipeline.inference.executor import Executor

pytest.importorskip("onnx")


@pytest.fixture(params=[False, True], ids=["copied-whole", "compacted"])
def top_one(request):
    entry = register_decoder(
        DecoderEntry(
            TOP_ONE,
            {"boxes": (str, "boxes"), "scores": (str, "scores"), "labels": (str, "labels")},
            decode_top_one,
            decode_top_one_batch,
            compacts_on_device=request.param,
            output_params=("boxes", "scores", "labels"),
        )
    )
    yield entry
    unregister_decoder(TOP_ONE)


@pytest.fixture
def top_one_card(tmp_path, top_one):
    toy = build_toy_model(tmp_path, "boxes_scores_labels")
    # The toy decoder gives no heatmap: the card names none (the model's heatmap output goes unread).
    return load_card(write_card(dataclasses.replace(toy, decoder=DecoderSpec(TOP_ONE, {}), heatmap=None)))


def _white_tiles(card, n: int) -> np.ndarray:
    h, w = card.input.size_hw
    return np.full((n, h, w, 3), 255, np.uint8)


def test_the_entry_is_every_list_of_decoders(top_one):
    assert TOP_ONE in decoder_types() and DECODER_REGISTRY[TOP_ONE] is top_one
    assert DECODERS[TOP_ONE] is decode_top_one and BATCH_DECODERS[TOP_ONE] is decode_top_one_batch


def test_a_card_naming_the_decoder_loads_and_decodes_with_it(top_one_card):
    assert top_one_card.decoder.type == TOP_ONE
    outputs = {
        "boxes": np.stack([TOY_BOXES, TOY_BOXES]),
        "scores": np.stack([TOY_SCORES, TOY_SCORES[::-1]]),
        "labels": np.stack([TOY_LABELS, TOY_LABELS]),
    }
    tiles = decode(outputs, top_one_card)
    assert [len(t) for t in tiles] == [1, 1]
    np.testing.assert_array_equal(tiles[0].boxes, TOY_BOXES[:1])
    np.testing.assert_array_equal(tiles[1].boxes, TOY_BOXES[2:])
    assert decode_batch(outputs, top_one_card).scores.tolist() == pytest.approx([TOY_SCORES[0], TOY_SCORES[0]])


def test_the_cards_params_are_checked_against_the_entrys_table(top_one_card):
    doc = json.loads(top_one_card.card_path.read_text())
    doc["decoder"]["params"] = {"score_threshold": 0.5}
    top_one_card.card_path.write_text(json.dumps(doc))
    with pytest.raises(ModelError, match=r"decoder\.params\.score_threshold.*for decoder 'top_one'"):
        load_card(top_one_card.card_path)


def test_the_executor_follows_the_entry(top_one_card, top_one):
    assert DeviceDecoder(top_one_card).compacts is top_one.compacts_on_device
    with Executor.from_card(top_one_card, "ort", streams=1) as ex:
        tiles = ex.infer_tiles(_white_tiles(top_one_card, 3))
    assert [len(t) for t in tiles] == [1, 1, 1]
    for t in tiles:
        np.testing.assert_allclose(t.boxes, TOY_BOXES[:1])
        assert t.labels.tolist() == [TOY_LABELS[0]]


def test_a_run_on_an_image_detects_with_the_registered_decoder(top_one_card):
    image = _white_tiles(top_one_card, 1)[0]
    with Pipeline.from_card(top_one_card.card_path, backend="ort", tissue="all", overlap=8) as p:
        result = p.run(image)
    assert list(result.detections["score"]) == pytest.approx([TOY_SCORES[0]])


def test_a_card_naming_a_decoder_no_longer_registered_is_refused(top_one_card):
    unregister_decoder(TOP_ONE)
    known = list(decoder_types())
    assert TOP_ONE not in known and "yolo" in known
    with pytest.raises(ModelError, match=re.escape(f"field 'decoder.type': expected one of {known}, found 'top_one'")):
        load_card(top_one_card.card_path)
    assert TOP_ONE not in DECODERS


def test_the_cards_heatmap_is_attached_to_a_decoder_that_gives_none(tmp_path, top_one):
    """The heatmap step of the decoder contract (``card_heatmaps``): the toy decoder leaves it out,
    ``decode_batch`` and ``decode`` attach the card's heatmap after its activation, and a run blends it."""
    toy = build_toy_model(tmp_path, "boxes_scores_labels")
    card = load_card(write_card(dataclasses.replace(toy, decoder=DecoderSpec(TOP_ONE, {}))))
    assert card.heatmap is not None
    backend = create_backend(card, "ort")
    try:
        outputs = backend.infer(_white_tiles(card, 2))
    finally:
        backend.close()
    expected = card_heatmaps(outputs, card, 2)
    assert expected.shape == (2, 1, 4, 4) and (expected == 1.0).all()  # a white tile's brightness
    assert decode_top_one_batch(outputs, card).heatmaps is None
    np.testing.assert_array_equal(decode_batch(outputs, card).heatmaps, expected)
    assert [t.heatmap.tolist() for t in decode(outputs, card)] == expected.tolist()
    image = _white_tiles(card, 1)[0]
    with Pipeline.from_card(card.card_path, backend="ort", tissue="all", overlap=8) as p:
        result = p.run(image)
    assert result.heatmap is not None and np.asarray(result.heatmap).max() > 0.99
