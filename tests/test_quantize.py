"""FP16 / INT8 variants and calibration tile sampling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline.errors import ConfigError, ModelError
from wsi_pipeline.inference import create_backend, decode, load_card
from wsi_pipeline.models.quantize import load_calibration_tiles, make_variant

onnx = pytest.importorskip("onnx")
pytest.importorskip("pycocotools")

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ROOT / "engines"
CALIBRATION = ROOT / "calibration_data"


@pytest.fixture(scope="module")
def pathology_tiles():
    from wsi_pipeline.models.data import heldout_tiles

    return heldout_tiles("pathology", scenes=4, tiles_per_scene=6)


def test_int8_variant_has_qdq_nodes_and_its_own_card(tmp_path):
    out = tmp_path / "nuclei.int8.onnx"
    card = make_variant(ENGINES / "nuclei_pathology.card.json", "int8", CALIBRATION / "pathology", out, limit=8)
    assert card.precision == "int8" and card.model_path == out.resolve()
    assert card.card_path == (tmp_path / "nuclei.int8.card.json").resolve()
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    doc = json.loads(card.card_path.read_text())
    assert doc["source_model"]["sha256"] == load_card(ENGINES / "nuclei_pathology.card.json").sha256
    assert doc["calibration"]["tiles"] == 8
    # same interface as the source model
    assert [o.name for o in card.outputs] == ["boxes", "scores", "labels", "heatmap"]


@pytest.mark.parametrize("kind, name", [("pathology", "nuclei_pathology"), ("industrial", "defects_industrial")])
def test_committed_int8_keeps_precision_and_recall_within_one_point(kind, name):
    from wsi_pipeline.models.data import heldout_tiles
    from wsi_pipeline.models.evaluate import evaluate_card

    # Enough objects that one detection is well under a point (industrial: ~230 defects).
    tiles = heldout_tiles(
        kind, scenes=4 if kind == "pathology" else 24, tiles_per_scene=6 if kind == "pathology" else 8
    )
    fp32 = evaluate_card(load_card(ENGINES / f"{name}.card.json"), tiles)
    int8_card = load_card(ENGINES / f"{name}.int8.card.json")
    assert int8_card.precision == "int8"
    int8 = evaluate_card(int8_card, tiles)
    assert abs(int8.counts.precision - fp32.counts.precision) <= 0.01, (fp32.summary(), int8.summary())
    assert abs(int8.counts.recall - fp32.counts.recall) <= 0.01, (fp32.summary(), int8.summary())
    for channel, dice in fp32.dice.items():
        assert abs(int8.dice[channel] - dice) <= 0.01


def test_fp16_variant_matches_fp32(tmp_path, pathology_tiles):
    src = load_card(ENGINES / "nuclei_pathology.card.json")
    card = make_variant(src, "fp16", out=tmp_path / "n.fp16.onnx")
    assert card.precision == "fp16"
    assert card.input.dtype == "uint8" and card.output("labels").dtype == "int32"  # I/O types kept
    batch = np.stack([t.image for t in pathology_tiles[:4]])
    a = decode(create_backend(src).infer(batch), src)
    b = decode(create_backend(card).infer(batch), card)
    for x, y in zip(a, b, strict=True):
        assert abs(len(x) - len(y)) <= max(2, 0.02 * len(x))
        np.testing.assert_allclose(x.heatmap, y.heatmap, atol=0.02)
        # labels come from index arithmetic kept in fp32: exact
        assert set(y.labels.tolist()) <= {0}


def test_variant_errors(tmp_path):
    with pytest.raises(ConfigError, match="int8 needs calibration tiles"):
        make_variant(ENGINES / "nuclei_pathology.card.json", "int8", out=tmp_path / "x.onnx")
    with pytest.raises(ConfigError, match="precision: expected one of"):
        make_variant(ENGINES / "nuclei_pathology.card.json", "int4")
    with pytest.raises(ModelError, match="expected an fp32 source model"):
        make_variant(ENGINES / "nuclei_pathology.int8.card.json", "fp16", out=tmp_path / "y.onnx")
    with pytest.raises(ConfigError, match="expected a folder of tiles or a .npz"):
        load_calibration_tiles(tmp_path / "missing", (512, 512))


def test_calibration_tiles_load_from_folder_and_npz(tmp_path):
    tiles = load_calibration_tiles(CALIBRATION / "pathology", (256, 256), limit=3)
    assert tiles.shape == (3, 256, 256, 3) and tiles.dtype == np.uint8
    np.savez_compressed(tmp_path / "t.npz", tiles=tiles)
    np.testing.assert_array_equal(load_calibration_tiles(tmp_path / "t.npz", (256, 256)), tiles)


def test_committed_calibration_data_is_complete():
    for kind in ("pathology", "industrial"):
        manifest = json.loads((CALIBRATION / kind / "manifest.json").read_text())["tiles"]
        files = sorted(p.name for p in (CALIBRATION / kind).glob("*.jpg"))
        assert sorted(r["file"] for r in manifest) == files and len(files) >= 100
    total = sum(p.stat().st_size for p in CALIBRATION.rglob("*") if p.is_file())
    assert total <= 20 * 1024 * 1024


def test_calibration_sample_takes_tissue_tiles_from_a_slide(tmp_path):
    from wsi_pipeline.models.calibration import sample_calibration_tiles
    from wsi_pipeline.synthetic import SyntheticScene, write_synthetic_slide

    slide = tmp_path / "s.tiff"
    write_synthetic_slide(slide, 2048, 2048, 9700, kind="pathology")
    rows = sample_calibration_tiles([slide], tmp_path / "cal", n=4, tile_px=256, mpp=0.5, seed=1)
    assert len(rows) == 4
    scene = SyntheticScene(2048, 2048, 9700, kind="pathology")
    for r in rows:
        assert r["downsample"] == pytest.approx(2.0)
        assert (tmp_path / "cal" / r["file"]).is_file()
        # the tile's level-0 footprint (512 px at mpp 0.25) is mostly tissue
        labels = scene.region_mask(r["x0_level0"], r["y0_level0"], 512, 512, 16)
        assert (labels > 0).mean() >= 0.4
    tiles = load_calibration_tiles(tmp_path / "cal", (256, 256))
    assert tiles.shape == (4, 256, 256, 3)
    manifest = json.loads((tmp_path / "cal" / "manifest.json").read_text())
    assert len(manifest["tiles"]) == 4
