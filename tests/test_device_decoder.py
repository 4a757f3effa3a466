"""The executor's device-side compaction feeds the card's one decoder: same detections as the CPU path.

Parametrised over both shipped cards (the industrial one asks for per-tile
NMS), three decoder kinds, and the devices torch has here (CPU always, CUDA
where present), against :func:`~wsi_pipeline.inference.decoders.decode` on
the same raw outputs in numpy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline.errors import ModelError
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.inference.card_spec import HeatmapSpec, OutputSpec
from wsi_pipeline.inference.decoders import decode

torch = pytest.importorskip("torch")
from wsi_pipeline.inference.device_decode import DeviceDecoder  # noqa: E402

ENGINES = Path(__file__).resolve().parents[1] / "engines"
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    ),
]


def _raw_outputs(card, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Outputs shaped as the card declares, with clustered boxes (so NMS has work) and tied scores."""
    h, w = card.input.size_hw
    out: dict[str, np.ndarray] = {}
    for spec in card.outputs:
        shape = [n if isinstance(d, str) else int(d) for d in spec.shape]
        out[spec.name] = np.zeros(shape, np.float32)
    p = card.decoder.params
    if card.decoder.type in ("centernet", "boxes_scores_labels"):
        k = out[p.get("scores", "scores")].shape[1]
        centres = rng.uniform(0, w, (n, k // 4 + 1, 2))[:, rng.integers(0, k // 4 + 1, k)]
        centres += rng.normal(0, 3, centres.shape)
        size = rng.uniform(4, 30, (n, k, 2))
        out[p.get("boxes", "boxes")] = np.concatenate([centres - size / 2, centres + size / 2], 2).astype(np.float32)
        scores = rng.choice([0.0, 0.29, 0.3, 0.31, 0.5, 0.5, 0.75, 0.9], (n, k)).astype(np.float32)
        scores[0, :3] = np.nan
        out[p.get("scores", "scores")] = scores
        out[p.get("labels", "labels")] = rng.integers(0, len(card.classes), (n, k)).astype(np.int32)
    else:
        head = out[p["output"]]
        head[:] = rng.uniform(0, 1, head.shape)
        head[:, :4] = rng.uniform(0, min(h, w), head[:, :4].shape)
    if card.heatmap is not None:
        hm = out[card.heatmap.output]
        hm[:] = rng.normal(0, 2, hm.shape)
    return out


def _device_path(card, raw: dict[str, np.ndarray], device: str, heatmaps_stay: bool = False):
    """The executor's steps; ``heatmaps_stay``: the heatmaps are left on the device (then copied here to compare)."""
    dec = DeviceDecoder(card)
    outs = {k: torch.from_numpy(v).to(device) for k, v in raw.items()}
    n = next(iter(raw.values())).shape[0]
    red = dec.reduce(outs, n)
    kept = red.pop(card.heatmap.output) if heatmaps_stay and card.heatmap is not None else None
    batch = dec.finish({k: v.cpu().numpy() for k, v in red.items()}, n, kept)
    if kept is not None:
        assert batch.heatmaps is kept
        batch = dataclasses.replace(batch, heatmaps=kept.cpu().numpy())
    return batch.tiles()


def _cards():
    nuclei = load_card(ENGINES / "nuclei_pathology.card.json")
    industrial = load_card(ENGINES / "defects_industrial.card.json")
    sigmoid = dataclasses.replace(nuclei, heatmap=dataclasses.replace(nuclei.heatmap, activation="sigmoid"))
    bsl = dataclasses.replace(
        industrial,
        outputs=(*industrial.outputs, OutputSpec("num", ("batch",), "int64")),
        decoder=dataclasses.replace(
            industrial.decoder,
            type="boxes_scores_labels",
            params={"score_threshold": 0.3, "box_format": "xywh", "label_offset": -1, "num_detections": "num"},
        ),
    )
    yolo = dataclasses.replace(
        industrial,
        outputs=(
            OutputSpec("output0", ("batch", 4 + len(industrial.classes), 200)),
            OutputSpec("heat", ("batch", 2, 8, 8)),
        ),
        decoder=dataclasses.replace(industrial.decoder, type="yolo", params={"output": "output0"}),
        heatmap=HeatmapSpec("heat", 64, ("a", "b"), "softmax"),
    )
    return {
        "nuclei": nuclei,
        "industrial_nms": industrial,
        "nuclei_sigmoid": sigmoid,
        "boxes_scores_labels": bsl,
        "yolo": yolo,
    }


CARDS = _cards()


@pytest.mark.parametrize("heatmaps_stay", [False, True], ids=["heatmaps-copied", "heatmaps-on-device"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CARDS))
def test_device_compaction_then_decoder_equals_cpu_decoder(name, device, heatmaps_stay):
    card = CARDS[name]
    rng = np.random.default_rng(3)
    raw = _raw_outputs(card, 12, rng)
    if card.decoder.type == "boxes_scores_labels":
        raw["num"] = rng.integers(0, raw["scores"].shape[1] + 1, 12).astype(np.int64)
    want = decode({k: v.copy() for k, v in raw.items()}, card)
    got = _device_path(card, raw, device, heatmaps_stay)
    assert len(got) == len(want) == 12
    assert sum(len(d) for d in want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.boxes, w.boxes)
        np.testing.assert_array_equal(g.scores, w.scores)
        np.testing.assert_array_equal(g.labels, w.labels)
        if w.heatmap is None:
            assert g.heatmap is None
        else:
            np.testing.assert_allclose(g.heatmap, w.heatmap, atol=1e-6)


def test_per_tile_nms_is_applied_on_the_device_path():
    """The industrial card's iou_threshold: overlapping boxes of one class are suppressed on both paths."""
    card = CARDS["industrial_nms"]
    k = card.outputs[0].shape[1]
    boxes = np.zeros((1, k, 4), np.float32)
    boxes[0, :3] = [[10, 10, 50, 50], [12, 12, 52, 52], [100, 100, 140, 140]]
    scores = np.zeros((1, k), np.float32)
    scores[0, :3] = [0.9, 0.8, 0.7]
    raw = {"boxes": boxes, "scores": scores, "labels": np.zeros((1, k), np.int32)}
    got = _device_path(card, raw, "cpu")[0]
    assert got.scores.tolist() == pytest.approx([0.9, 0.7])


def test_a_heatmap_left_on_the_device_is_checked_like_a_copied_one():
    card = CARDS["nuclei"]
    raw = _raw_outputs(card, 4, np.random.default_rng(0))
    dec = DeviceDecoder(card)
    red = dec.reduce({k: torch.from_numpy(v) for k, v in raw.items()}, 4)
    kept = red.pop(card.heatmap.output)
    with pytest.raises(ModelError, match=r"heatmap output .*expected \[4, 2, H, W\], found \[3, 2"):
        dec.finish({k: v.numpy() for k, v in red.items()}, 4, kept[:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "sigmoid", "softmax"])
def test_the_reduced_heatmap_does_not_share_the_model_outputs_memory(device, activation):
    """A heatmap left on the device outlives the batch: the runner's output buffers are reused."""
    card = CARDS["nuclei"]
    card = dataclasses.replace(card, heatmap=dataclasses.replace(card.heatmap, activation=activation))
    raw = _raw_outputs(card, 4, np.random.default_rng(1))
    outs = {k: torch.from_numpy(v).to(device) for k, v in raw.items()}
    hm = DeviceDecoder(card).reduce(outs, 4)[card.heatmap.output]
    before = hm.clone()
    outs[card.heatmap.output].fill_(7.0)
    assert torch.equal(hm, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["nuclei", "industrial_nms", "boxes_scores_labels"])
def test_negative_labels_non_finite_boxes_and_the_cap_are_the_decoders_on_the_device_path(name, device):
    """The device's compaction keeps the rows the decoder keeps, and past the card's cap a tile it
    counts the dropped rows as the decoder does."""
    card = dataclasses.replace(CARDS[name], max_detections_per_tile=3)
    rng = np.random.default_rng(5)
    raw = _raw_outputs(card, 8, rng)
    p = card.decoder.params
    labels, boxes = raw[p.get("labels", "labels")], raw[p.get("boxes", "boxes")]
    labels[:, 1::5] = -2  # negative whatever the card's label_offset
    boxes[1, :4, 2] = np.nan
    if card.decoder.type == "boxes_scores_labels":
        raw["num"] = rng.integers(0, raw["scores"].shape[1] + 1, 8).astype(np.int64)
    want = decode({k: v.copy() for k, v in raw.items()}, card)
    got = _device_path(card, raw, device)
    assert sum(w.over_cap for w in want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.boxes, w.boxes)
        np.testing.assert_array_equal(g.scores, w.scores)
        np.testing.assert_array_equal(g.labels, w.labels)
        assert g.over_cap == w.over_cap
