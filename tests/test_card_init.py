"""``wsi-pipeline card init`` drafts a card from an ONNX file; ``card check`` validates it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wsi_pipeline import cli
from wsi_pipeline.errors import ModelError
from wsi_pipeline.inference.card import file_sha256, load_card
from wsi_pipeline.inference.card_init import draft_card, guess_layout, todo_fields

ENGINES = Path(__file__).parent.parent / "engines"


def test_init_reads_the_graph_and_marks_what_it_cannot_know(tmp_path, capsys):
    model = tmp_path / "my.onnx"
    shutil.copy(ENGINES / "nuclei_pathology.onnx", model)
    assert cli.main(["card", "init", str(model)]) == 0
    card_path = tmp_path / "my.card.json"
    assert "fill in: mpp, decoder.type, classes" in capsys.readouterr().out
    doc = json.loads(card_path.read_text())
    shipped = json.loads((ENGINES / "nuclei_pathology.card.json").read_text())
    assert doc["sha256"] == file_sha256(model) == shipped["sha256"]
    assert doc["model_file"] == "my.onnx"
    for key in ("name", "size", "layout", "dtype"):
        assert doc["input"][key] == shipped["input"][key]
    assert [(o["name"], o["dtype"], len(o["shape"])) for o in doc["outputs"]] == [
        (o["name"], o["dtype"], len(o["shape"])) for o in shipped["outputs"]
    ]
    assert sorted(todo_fields(doc)) == ["classes", "decoder.type", "mpp"]
    assert "input.layout" in doc["card_init"]["guessed"]
    # such a card cannot be run by mistake
    with pytest.raises(ModelError):
        load_card(card_path)
    assert cli.main(["card", "check", str(card_path)]) == 1
    assert "fields still to fill in: mpp, decoder.type, classes" in capsys.readouterr().err
    # never replaced without --force
    before = card_path.read_text()
    assert cli.main(["card", "init", str(model)]) == 2
    assert "--force" in capsys.readouterr().err and card_path.read_text() == before

    # filled in as the docs say, the card passes the check and the pipeline's own loader
    doc.update(mpp=0.25, decoder=shipped["decoder"], classes=shipped["classes"], heatmap=shipped["heatmap"])
    card_path.write_text(json.dumps(doc))
    assert cli.main(["card", "check", str(card_path)]) == 0
    out = capsys.readouterr().out
    assert "ok: my" in out and "uint8 NHWC 512 x 512" in out and "classes nucleus" in out
    assert load_card(card_path).extra["card_init"]["guessed"]  # the new key is kept as an extra field


def test_check_runs_a_tile_through_the_decoder(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    shutil.copy(ENGINES / "defects_industrial.onnx", model)
    doc = draft_card(model)
    shipped = json.loads((ENGINES / "defects_industrial.card.json").read_text())
    doc.update(
        mpp=None, classes=shipped["classes"], decoder={"type": "yolo", "params": {"output": "scores"}}
    )  # a decoder that does not fit
    (tmp_path / "m.card.json").write_text(json.dumps(doc))
    rc = cli.main(["card", "check", str(tmp_path / "m.card.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "m.card.json" in err and "Traceback" not in err


def test_layout_guess():
    assert guess_layout(("n", 3, 640, 640), "m") == ("NCHW", (640, 640))
    assert guess_layout((None, 256, 256, 3), "m") == ("NHWC", (256, 256))
    assert guess_layout((1, 3, "h", "w"), "m") == ("NCHW", ("h", "w"))
    with pytest.raises(ModelError, match="3 colour channels"):
        guess_layout((1, 1, 64, 64), "m")
    with pytest.raises(ModelError, match="4-d image input"):
        guess_layout((1, 64, 64), "m")


def test_float_nchw_input_with_dynamic_size(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["images"], ["mean"], keepdims=0, axes=[2, 3])],
        "g",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["n", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "f.onnx"
    onnx.save(model, str(path))
    doc = draft_card(path)
    assert doc["input"]["layout"] == "NCHW" and doc["input"]["dtype"] == "float32"
    assert doc["input"]["normalize_in_graph"] is False
    assert sorted(todo_fields(doc)) == ["classes", "decoder.type", "input.mean", "input.size", "input.std", "mpp"]


def test_shipped_cards_say_what_they_were_trained_on_and_where_they_stop():
    cards = sorted(ENGINES.glob("*.card.json"))
    assert len(cards) == 6
    for path in cards:
        card = load_card(path)  # the new key keeps the card valid (SHA-256 of the model unchanged)
        scope = card.extra["scope"]
        assert {"trained_on", "works_for", "stops_working", "measured_with"} <= set(scope), path
        assert "synthetic" in scope["trained_on"]
    assert "26-32 px" in load_card(ENGINES / "nuclei_pathology.card.json").extra["scope"]["stops_working"]
    try:
        from wsi_pipeline.models.train import PRESETS
    except ImportError:  # training needs torch
        return
    for preset in PRESETS.values():  # retraining writes the same scope
        assert load_card(ENGINES / f"{preset.name}.card.json").extra["scope"] == preset.scope
