"""Model cards: parsing, validation and refusal of models that do not match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.toy_models import build_toy_model

from wsi_pipeline.errors import ModelError
from wsi_pipeline.inference.card import card_path_for, file_sha256, load_card

pytest.importorskip("onnx")

ENGINES = Path(__file__).resolve().parents[1] / "engines"


@pytest.fixture()
def toy(tmp_path):
    card = build_toy_model(tmp_path, "boxes_scores_labels", score_threshold=0.5)
    return card, json.loads(card.card_path.read_text())


def rewrite(card, doc) -> Path:
    card.card_path.write_text(json.dumps(doc))
    return card.card_path


@pytest.mark.parametrize("name", ["nuclei_pathology", "defects_industrial"])
def test_shipped_cards_load_and_match_their_models(name):
    card = load_card(ENGINES / f"{name}.card.json")
    assert card.model_path == (ENGINES / f"{name}.onnx").resolve()
    assert card.input.size_hw == (512, 512) and card.input.layout == "NHWC" and card.input.dtype == "uint8"
    assert card.input.normalize_in_graph
    assert card.decoder.type == "centernet"
    assert card.sha256 == file_sha256(card.model_path)
    assert (ENGINES / f"{name}.onnx").stat().st_size <= 10 * 1024 * 1024


def test_pathology_card_declares_mpp_and_region_heatmap():
    card = load_card(ENGINES / "nuclei_pathology.card.json")
    assert card.mpp == pytest.approx(0.25)
    assert card.class_names == ["nucleus"]
    assert card.heatmap is not None and card.heatmap.classes == ("tissue", "tumour")
    assert card.heatmap.stride == 8
    assert load_card(ENGINES / "defects_industrial.card.json").mpp is None


def test_model_path_finds_the_card_beside_it(toy):
    card, _ = toy
    assert card_path_for(card.model_path) == card.card_path
    assert load_card(card.model_path).name == card.name


def test_round_trip_keeps_every_field(toy):
    card, doc = toy
    again = load_card(card.card_path)
    assert again == card
    assert again.decoder.params == {"score_threshold": 0.5}
    assert doc["model_file"] == card.model_path.name  # relative to the card


def test_sha256_mismatch_is_refused_with_both_hashes(toy):
    card, doc = toy
    doc["sha256"] = "a" * 64
    with pytest.raises(ModelError, match=f"expected {'a' * 64}, found {card.sha256}"):
        load_card(rewrite(card, doc))


def test_modified_model_file_is_refused(toy):
    card, _ = toy
    with open(card.model_path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelError, match="SHA-256 does not match"):
        load_card(card.card_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["input"].update(name="pixels"), "expected one input named 'pixels'"),
        (lambda d: d["input"].update(dtype="float32", normalize_in_graph=True), "dtype: expected float32, found uint8"),
        (lambda d: d["input"].update(size=[64, 64]), r"shape: expected NHWC \[None, 64, 64, 3\], found"),
        (lambda d: d["outputs"][0].update(name="bbox"), "outputs: expected"),
        (lambda d: d["outputs"][1].update(shape=["N", 5]), r"output 'scores' shape: expected \['N', 5\]"),
        (lambda d: d["outputs"][2].update(dtype="int32"), "output 'labels' dtype: expected int32, found int64"),
    ],
)
def test_card_that_disagrees_with_the_model_is_refused(toy, edit, message):
    card, doc = toy
    edit(doc)
    if doc["outputs"][0]["name"] == "bbox":
        doc["decoder"]["params"]["boxes"] = "bbox"
    with pytest.raises(ModelError, match=message):
        load_card(rewrite(card, doc))


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("name"), "name"),
        (lambda d: d.update(sha256="xyz"), "sha256"),
        (lambda d: d["input"].update(layout="CHW"), "input.layout"),
        (lambda d: d["input"].update(size=[512]), "input.size"),
        (lambda d: d["input"].update(mean=[1, 2]), "input.mean"),
        (lambda d: d["input"].update(std=[1, 0, 1]), "input.std"),
        (lambda d: d.update(mpp=-1), "mpp"),
        (lambda d: d["outputs"][0].update(shape=["N", -3, 4]), "outputs[0].shape[1]"),
        (lambda d: d["decoder"].update(type="ssd"), "decoder.type"),
        (lambda d: d["decoder"]["params"].update(box_format="yxyx"), "decoder.params.box_format"),
        (lambda d: d["classes"][0].update(color="red"), "classes[0].color"),
        (lambda d: d["heatmap"].update(output="missing"), "heatmap.output"),
        (lambda d: d["heatmap"].update(stride=0), "heatmap.stride"),
        (lambda d: d.update(precision="int4"), "precision"),
    ],
)
def test_malformed_card_names_file_and_field(toy, edit, field):
    card, doc = toy
    edit(doc)
    with pytest.raises(ModelError) as info:
        load_card(rewrite(card, doc))
    assert str(card.card_path) in str(info.value)
    assert repr(field) in str(info.value) or f"'{field}'" in str(info.value)


def test_uint8_input_cannot_ask_the_backend_to_normalise(toy):
    card, doc = toy
    doc["input"].update(normalize_in_graph=False, mean=[1, 2, 3])
    with pytest.raises(ModelError, match="normalize_in_graph"):
        load_card(rewrite(card, doc))


def test_missing_card_model_and_bad_json(tmp_path, toy):
    with pytest.raises(ModelError, match="model card not found"):
        load_card(tmp_path / "nothing.onnx")
    card, doc = toy
    doc["model_file"] = "gone.onnx"
    with pytest.raises(ModelError, match="gone.onnx does not exist"):
        load_card(rewrite(card, doc))
    card.card_path.write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_card(card.card_path)


def test_corrupt_onnx_file_is_a_model_error(toy):
    card, doc = toy
    card.model_path.write_bytes(b"not an onnx file")
    doc["sha256"] = file_sha256(card.model_path)
    with pytest.raises(ModelError, match="cannot be read as ONNX"):
        load_card(rewrite(card, doc))


def test_a_model_file_that_leaves_the_cards_folder_through_a_link_is_refused(tmp_path, toy):
    card, doc = toy
    outside = tmp_path.parent / f"{tmp_path.name}_outside.onnx"
    outside.write_bytes(card.model_path.read_bytes())
    (card.card_path.parent / "linked.onnx").symlink_to(outside)
    doc["model_file"] = "linked.onnx"
    with pytest.raises(
        ModelError, match=r"inside the card's folder \(symbolic links resolved\), found 'linked.onnx ->"
    ):
        load_card(rewrite(card, doc))
    (card.card_path.parent / "sub").mkdir()
    (card.card_path.parent / "sub" / "inside.onnx").symlink_to(card.model_path)  # a link that stays inside
    doc["model_file"] = "sub/inside.onnx"
    assert load_card(rewrite(card, doc)).model_path == card.model_path
