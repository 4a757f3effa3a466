"""Small untrained PyTorch models as users have them, exported both ways (ONNX and ``torch.export``).

``TinyDetector``: a few convolutions and a CenterNet-style head with top-k
peak extraction in the graph, taking ``[B, H, W, 3] uint8`` NHWC tiles and
returning a dict ``{boxes [B, K, 4] float32 xyxy tile px, scores [B, K]
float32, labels [B, K] int32, heatmap [B, R, H/8, W/8] float32}``: the
``centernet`` decoder's convention, as the shipped nuclei card uses it.

``TinyUNet``: a UNet (convolutions, BatchNorm, ConvTranspose upsampling,
skip concatenation) taking ``[B, 3, H, W] float32`` NCHW input already
normalised by the caller (the card's mean/std with
``normalize_in_graph: false``) and returning a tuple ``(head [B, 4 + C, N]
float32, heatmap logits [B, R, H/2, W/2] float32)``: a YOLO-style head over
the bottleneck cells (``cx, cy, w, h`` in tile px, then C class scores) and
a dense map the card names as its heatmap (sigmoid).

:func:`export_both` writes ``NAME.onnx`` (TorchScript exporter, opset 17:
works offline without onnxscript) and ``NAME.pt2`` (``torch.export`` with a
dynamic batch axis) with a card for each; the two cards differ only in the
model file and its SHA-256.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wsi_pipeline.inference.card import file_sha256, format_for, load_card, write_card
from wsi_pipeline.inference.card_spec import ClassSpec, DecoderSpec, HeatmapSpec, InputSpec, ModelCard, OutputSpec

TILE = 64
MEAN = (120.0, 110.0, 100.0)
STD = (60.0, 55.0, 50.0)


def _conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def _randomise_batch_norms(net: nn.Module) -> None:
    """Non-trivial running statistics, so that folding / running BatchNorm is exercised."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


class TinyDetector(nn.Module):
    """uint8 NHWC tiles -> dict of boxes / scores / labels / heatmap (see the module docstring)."""

    output_names = ("boxes", "scores", "labels", "heatmap")

    def __init__(self, classes: int = 2, regions: int = 2, top_k: int = 16):
        super().__init__()
        self.top_k = top_k
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))
        self.backbone = nn.Sequential(_conv_bn(3, 8, 2), _conv_bn(8, 16, 2))  # stride 4
        self.center = nn.Conv2d(16, classes, 1)
        self.size = nn.Conv2d(16, 2, 1)
        self.region = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(16, regions, 1))  # stride 8

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = (x.permute(0, 3, 1, 2).float() - self.mean) / self.std
        f = self.backbone(x)
        centers = torch.sigmoid(self.center(f))  # [B, C, h, w]
        wh = torch.relu(self.size(f)) * 4.0 + 3.0  # [B, 2, h, w] box size in tile px
        _, _, h, w = centers.shape
        scores, idx = torch.topk(centers.flatten(1), self.top_k)  # [B, K]
        labels = torch.div(idx, h * w, rounding_mode="floor")
        pos = idx - labels * (h * w)
        cy = torch.div(pos, w, rounding_mode="floor")
        cx = pos - cy * w
        cx = cx.float() * 4.0 + 2.0
        cy = cy.float() * 4.0 + 2.0
        size = torch.gather(wh.flatten(2), 2, pos.unsqueeze(1).expand(-1, 2, -1))  # [B, 2, K]
        boxes = torch.stack(
            [cx - size[:, 0] / 2, cy - size[:, 1] / 2, cx + size[:, 0] / 2, cy + size[:, 1] / 2], dim=-1
        )
        heatmap = torch.softmax(self.region(f), dim=1)
        return {"boxes": boxes, "scores": scores, "labels": labels.to(torch.int32), "heatmap": heatmap}


class TinyUNet(nn.Module):
    """Normalised float NCHW input -> (YOLO head, heatmap logits) (see the module docstring)."""

    output_names = ("head", "heatmap")

    def __init__(self, classes: int = 2, regions: int = 1):
        super().__init__()
        self.enc1 = _conv_bn(3, 8)
        self.enc2 = _conv_bn(8, 16, 2)  # H/2
        self.bottom = _conv_bn(16, 32, 2)  # H/4
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)  # back to H/2
        self.dec = _conv_bn(32, 16)
        self.heat = nn.Conv2d(16, regions, 1)
        self.head = nn.Conv2d(32, 4 + classes, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e2 = self.enc2(self.enc1(x))
        b = self.bottom(e2)
        d = self.dec(torch.cat([self.up(b), e2], dim=1))
        raw = self.head(b)  # [B, 4 + C, h, w]
        _, _, h, w = raw.shape
        gy = torch.arange(h, dtype=torch.float32, device=x.device).view(1, h, 1).expand(1, h, w)
        gx = torch.arange(w, dtype=torch.float32, device=x.device).view(1, 1, w).expand(1, h, w)
        cx = (gx + torch.sigmoid(raw[:, 0])) * 4.0
        cy = (gy + torch.sigmoid(raw[:, 1])) * 4.0
        wh = torch.sigmoid(raw[:, 2:4]) * 12.0 + 2.0
        cls = torch.sigmoid(raw[:, 4:])
        head = torch.cat([cx.unsqueeze(1), cy.unsqueeze(1), wh, cls], dim=1).flatten(2)  # [B, 4 + C, N]
        return head, self.heat(d)


class _AsTuple(nn.Module):
    """A model's outputs as a tuple in ``names`` order (what the ONNX exporter names by position)."""

    def __init__(self, net: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.net, self.names = net, names

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.net(x)
        return tuple(out[n] for n in self.names) if isinstance(out, dict) else tuple(out)


def make_detector(seed: int = 0) -> TinyDetector:
    torch.manual_seed(seed)
    net = TinyDetector().eval()
    _randomise_batch_norms(net)
    with torch.no_grad():
        net.center.weight.mul_(8.0)  # spread the peak scores
    return net


def make_unet(seed: int = 0) -> TinyUNet:
    torch.manual_seed(seed)
    net = TinyUNet().eval()
    _randomise_batch_norms(net)
    with torch.no_grad():
        net.head.weight.mul_(4.0)
    return net


def example_input(net: nn.Module, batch: int = 2) -> torch.Tensor:
    if isinstance(net, TinyDetector):
        return torch.zeros(batch, TILE, TILE, 3, dtype=torch.uint8)
    return torch.zeros(batch, 3, TILE, TILE, dtype=torch.float32)


def export_onnx(net: nn.Module, path: Path) -> Path:
    names = net.output_names
    axes = {n: {0: "batch"} for n in ("image", *names)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings on shape arithmetic, the legacy-exporter notice
        torch.onnx.export(
            _AsTuple(net, names).eval(),
            (example_input(net),),
            str(path),
            input_names=["image"],
            output_names=list(names),
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    return path


def export_pt2(net: nn.Module, path: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        program = torch.export.export(net, (example_input(net),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def card_for(net: nn.Module, model_path: Path, score_threshold: float) -> ModelCard:
    """The card of ``net`` exported to ``model_path`` (ONNX or ``.pt2``)."""
    model_path = model_path.resolve()
    if isinstance(net, TinyDetector):
        k = net.top_k
        inp = InputSpec("image", (TILE, TILE), "NHWC", "uint8", "RGB", MEAN, STD, True)
        # Another order than the program's dict: its outputs map by name, not position.
        outputs = (
            OutputSpec("heatmap", ("batch", 2, TILE // 8, TILE // 8)),
            OutputSpec("scores", ("batch", k)),
            OutputSpec("labels", ("batch", k), "int32"),
            OutputSpec("boxes", ("batch", k, 4)),
        )
        decoder = DecoderSpec("centernet", {"score_threshold": score_threshold})
        heatmap = HeatmapSpec("heatmap", 8, ("tissue", "tumour"), "none")
    else:
        n = (TILE // 4) ** 2
        inp = InputSpec("image", (TILE, TILE), "NCHW", "float32", "RGB", MEAN, STD, False)
        outputs = (OutputSpec("head", ("batch", 6, n)), OutputSpec("heatmap", ("batch", 1, TILE // 2, TILE // 2)))
        decoder = DecoderSpec("yolo", {"output": "head", "score_threshold": score_threshold, "iou_threshold": 0.45})
        heatmap = HeatmapSpec("heatmap", 2, ("foreground",), "sigmoid")
    card = ModelCard(
        name=model_path.stem,
        version="0",
        model_path=model_path,
        sha256=file_sha256(model_path),
        input=inp,
        outputs=outputs,
        decoder=decoder,
        classes=(ClassSpec("a", "#ff0000"), ClassSpec("b", "#00ff00")),
        mpp=None,
        heatmap=heatmap,
        precision="fp32",
        format=format_for(model_path),
    )
    # NAME.onnx.card.json and NAME.pt2.card.json: the default NAME.card.json would be the same file for both.
    return load_card(write_card(card, model_path.with_name(model_path.name + ".card.json")))


def export_both(net: nn.Module, out_dir: Path, name: str, probe: np.ndarray) -> tuple[ModelCard, ModelCard]:
    """``(onnx card, pt2 card)`` of ``net`` under ``out_dir``.

    The score threshold is set from ONNX Runtime's scores on ``probe`` tiles:
    in the widest gap between candidates' scores in the middle half of them
    (for the detector: of those above any tile's top-k median, so that the
    top-k cut never lies near it), so that results do not hinge on how the
    untrained model's output happens to be distributed, nor on a candidate
    sitting at the threshold.
    """
    from wsi_pipeline.inference.backend import create_backend

    onnx_card = card_for(net, export_onnx(net, out_dir / f"{name}.onnx"), 0.5)
    raw = create_backend(onnx_card, "ort").infer(probe)
    if isinstance(net, TinyDetector):
        scores = raw["scores"]  # [N, K], sorted: at most half of any tile's top-k may pass
        flat = np.sort(scores[scores > scores[:, net.top_k // 2].max()])
    else:
        flat = np.sort(raw["head"][:, 4:].max(axis=1).reshape(-1))
    # The middle of the widest gap between neighbouring scores in the middle half.
    lo, hi = len(flat) // 4, 3 * len(flat) // 4
    i = lo + int(np.argmax(np.diff(flat[lo : hi + 1])))
    threshold = float(flat[i] + flat[i + 1]) / 2
    threshold = round(threshold, 6)
    params = {**onnx_card.decoder.params, "score_threshold": threshold}
    onnx_card = dataclasses.replace(onnx_card, decoder=dataclasses.replace(onnx_card.decoder, params=params))
    onnx_card = load_card(write_card(onnx_card, onnx_card.card_path))
    pt2_card = card_for(net, export_pt2(net, out_dir / f"{name}.pt2"), threshold)
    return onnx_card, pt2_card
