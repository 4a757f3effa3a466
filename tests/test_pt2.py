"""Models as users have them: a ``torch.export`` program (``.pt2``) beside its ONNX export.

A small detector (CenterNet-style head, the shipped nuclei card's ``centernet``
convention, dict outputs) and a small UNet (ConvTranspose, skip concat,
BatchNorm; a YOLO-style head and a heatmap, tuple outputs, normalised float
NCHW input) are exported both ways in the test itself (a ``.pt2`` may not load
under another torch version). ONNX Runtime on the ONNX file is the reference;
the torch backend on the ONNX file and on the ``.pt2`` must agree with it on
the same tiles, within ``TOLERANCES``. The CUDA cases are the same tests,
parametrised over the device, marked ``gpu``.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

import helpers.torch_models as tm  # noqa: E402
from helpers import assert_same_detections, smooth_image, write_pyramid_tiff  # noqa: E402
from torch import nn  # noqa: E402

from wsi_pipeline import Pipeline  # noqa: E402
from wsi_pipeline.errors import ModelError  # noqa: E402
from wsi_pipeline.inference.backend import create_backend, resolve_backend  # noqa: E402
from wsi_pipeline.inference.card import file_sha256, load_card, write_card  # noqa: E402
from wsi_pipeline.inference.card_spec import ClassSpec, DecoderSpec, InputSpec, ModelCard, OutputSpec  # noqa: E402
from wsi_pipeline.inference.decoders import decode  # noqa: E402
from wsi_pipeline.inference.executor import Executor  # noqa: E402
from wsi_pipeline.inference.tile_detections import TileDetections  # noqa: E402
from wsi_pipeline.synthetic import write_synthetic_slide  # noqa: E402

_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# (device, precision): the CPU in fp32 and in bf16 autocast (the CPU's stand-in for CUDA's fp16);
# CUDA in fp32 (TF32 off, so near-exact) and in fp16 autocast, the torch backend's default there.
TARGETS = [
    pytest.param(("cpu", "fp32"), id="cpu-fp32"),
    pytest.param(("cpu", "bf16"), id="cpu-bf16"),
    pytest.param(("cuda", "fp32"), id="cuda-fp32", marks=_GPU),
    pytest.param(("cuda", "fp16"), id="cuda-fp16", marks=_GPU),
]
# precision -> (box px, score, heatmap) absolute tolerances against ONNX Runtime fp32 on the CPU.
# Measured on the CPU: at most 4e-6 px, 3e-7 and 1.2e-7.
TOLERANCES = {"fp32": (1e-3, 1e-4, 1e-4), "fp16": (2.0, 1.5e-2, 1.5e-2), "bf16": (6.0, 5e-2, 5e-2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (ONNX card, .pt2 card, tiles ``[7, 64, 64, 3] uint8``: six smooth ones and a black one)."""
    out = tmp_path_factory.mktemp("pt2_models")
    tiles = np.stack(
        [smooth_image(tm.TILE, tm.TILE, seed=20 + i) for i in range(6)] + [np.zeros((tm.TILE, tm.TILE, 3), np.uint8)]
    )
    return {
        name: (*tm.export_both(make(), out, name, tiles[:6]), tiles)
        for name, make in (("detector", tm.make_detector), ("unet", tm.make_unet))
    }


@pytest.fixture
def target(request, monkeypatch):
    device, precision = request.param
    if device == "cuda" and precision == "fp32":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    if device == "cpu":  # the CPU case stays on the CPU on a GPU machine too
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return device, precision


def _check(got, want, card, precision):
    box, score, heat = TOLERANCES[precision]
    assert_same_detections(
        got, want, threshold=float(card.decoder.params["score_threshold"]), box_tol=box, score_tol=score, heat_tol=heat
    )


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("name", ["detector", "unet"])
def test_torch_on_onnx_and_on_pt2_equal_ort(models, name, target):
    device, precision = target
    onnx_card, pt2_card, tiles = models[name]
    want_raw = create_backend(onnx_card, "ort").infer(tiles)
    want = decode(want_raw, onnx_card)
    assert sum(len(d) for d in want) > 0
    box, score, heat = TOLERANCES[precision]
    for card in (onnx_card, pt2_card):
        tb = create_backend(card, "torch", device=device, precision=precision, max_batch=4)
        try:
            raw = tb.infer(tiles)  # 7 tiles in batches of 4 and 3
            assert {k: v.dtype.name for k, v in raw.items()} == {o.name: o.dtype for o in card.outputs}
            if name == "unet":  # fixed positions: the raw outputs compare element by element
                np.testing.assert_allclose(raw["head"][:, :4], want_raw["head"][:, :4], atol=box)
                np.testing.assert_allclose(raw["head"][:, 4:], want_raw["head"][:, 4:], atol=score)
                np.testing.assert_allclose(raw["heatmap"], want_raw["heatmap"], atol=heat)
            if name == "unet" and precision != "fp32":
                continue  # NMS among boxes whose scores differ by less than half precision's error may keep another
            _check(decode(raw, card), want, card, precision)
            with Executor(tb, streams=1) as ex:  # on CUDA: runners, CUDA graphs, the device decoder
                _check(ex.infer_tiles(tiles), want, card, precision)
                _check(ex.infer_tiles(tiles[:3]), want[:3], card, precision)  # a smaller batch (graph bucket)
        finally:
            tb.close()


def _as_tile_detections(result) -> TileDetections:
    d = np.sort(result.detections, order="score")[::-1]  # the comparison wants them by score
    boxes = np.stack([d["x0"], d["y0"], d["x1"], d["y1"]], axis=1).astype(np.float32)
    return TileDetections(
        boxes, d["score"].astype(np.float32), d["label"].astype(np.int64), np.asarray(result.heatmap, np.float32)
    )


@pytest.mark.parametrize("target", [TARGETS[0], TARGETS[3]], indirect=True)  # auto: fp32 on the CPU, fp16 on CUDA
def test_pipeline_on_pt2_equals_onnx_on_ort(models, tmp_path, target):
    device, precision = target
    onnx_card, pt2_card, _ = models["detector"]
    slide = tmp_path / "slide.tiff"  # a JPEG-tiled pyramid of the probe tiles' kind of image
    write_pyramid_tiff(slide, smooth_image(320, 384, seed=7), levels=2, tile=128, mpp=None)
    settings = dict(overlap=16, decode="cpu", writer_processes=0)  # the same pixels for both runs
    with Pipeline.from_card(onnx_card.card_path, backend="ort", **settings) as p:
        want = p.run(slide)
    with Pipeline.from_card(pt2_card.card_path, backend="auto", **settings) as p:
        assert p.backend_name == "torch" and p.executor.is_cuda == (device == "cuda")
        assert p.executor.backend.precision == precision
        got = p.run(slide)
    assert got.summary["backend"] == "torch"
    assert len(want.detections) > 0
    _check([_as_tile_detections(got)], [_as_tile_detections(want)], pt2_card, precision)


# -- what the card says and who refuses a .pt2 ---------------------------------------------------


def test_pt2_card_format_sha256_and_round_trip(models, tmp_path):
    onnx_card, pt2_card, _ = models["detector"]
    assert onnx_card.format == "onnx" and pt2_card.format == "torch_export"
    doc = json.loads(pt2_card.card_path.read_text())
    assert doc["format"] == "torch_export" and "format" not in json.loads(onnx_card.card_path.read_text())
    assert doc["sha256"] == file_sha256(pt2_card.model_path)

    # The extension implies the format; a card that says otherwise is refused.
    copy = tmp_path / "copy.pt2"
    copy.write_bytes(pt2_card.model_path.read_bytes())
    (tmp_path / "copy.card.json").write_text(json.dumps({**doc, "model_file": "copy.pt2", "format": "onnx"}))
    with pytest.raises(ModelError, match=r"field 'format': expected 'torch_export'"):
        load_card(tmp_path / "copy.card.json")
    (tmp_path / "copy.card.json").write_text(json.dumps({**doc, "model_file": "copy.pt2"}))
    assert load_card(tmp_path / "copy.card.json").format == "torch_export"

    # The SHA-256 covers the program like an ONNX file.
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="SHA-256 does not match"):
        load_card(tmp_path / "copy.card.json")
    copy.write_bytes(b"not a zip archive")
    (tmp_path / "copy.card.json").write_text(json.dumps({**doc, "model_file": "copy.pt2", "sha256": file_sha256(copy)}))
    with pytest.raises(ModelError, match="not a torch.export program"):
        load_card(tmp_path / "copy.card.json")


def test_onnx_only_backends_refuse_a_pt2_naming_the_torch_backend(models, tmp_path):
    from wsi_pipeline.inference.engine_build import build_engine
    from wsi_pipeline.models.quantize import make_variant

    _, pt2_card, _ = models["detector"]
    for backend in ("ort", "tensorrt"):
        with pytest.raises(ModelError, match=rf"{backend} backend.*torch backend runs it"):
            create_backend(pt2_card, backend)
        with pytest.raises(ModelError, match="torch backend runs it"):
            Pipeline.from_card(pt2_card.card_path, backend=backend, overlap=16, writer_processes=0)
    with pytest.raises(ModelError, match="TensorRT builds engines from ONNX only"):
        build_engine(pt2_card.model_path)
    with pytest.raises(ModelError, match="expected an ONNX model for quantization"):
        make_variant(pt2_card, "fp16", out=tmp_path / "x.onnx")


def test_auto_picks_torch_for_a_pt2_and_names_the_install_without_torch(models, monkeypatch):
    onnx_card, pt2_card, _ = models["detector"]
    assert resolve_backend("auto", pt2_card) == "torch"
    assert resolve_backend("torch", pt2_card) == "torch"
    monkeypatch.setitem(sys.modules, "torch", None)  # import fails as where torch is not installed
    with pytest.raises(ModelError, match=r"pip install 'wsi-pipeline\[gpu\]'"):
        resolve_backend("auto", pt2_card)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_backend("auto", onnx_card) == "ort"  # an ONNX card is not concerned


def test_cli_run_with_a_pt2_on_ort_is_an_error_without_traceback(models, tmp_path, capsys):
    from wsi_pipeline import cli

    _, pt2_card, _ = models["detector"]
    slide = tmp_path / "slide.tiff"
    write_synthetic_slide(slide, 256, 256, seed=1)
    rc = cli.main(
        [
            "run",
            str(slide),
            "--model",
            str(pt2_card.card_path),
            "--backend",
            "ort",
            "--overlap",
            "16",
            "--out",
            str(tmp_path / "out"),
            "--progress",
            "none",
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "torch backend runs it" in err and "Traceback" not in err


# -- a program's signature against its card ------------------------------------------------------


class _Small(nn.Module):
    """uint8 NHWC 8 px tiles -> a ``[B, 6, 16]`` YOLO-style head, returned as ``kind`` says."""

    def __init__(self, kind: str = "tensor"):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor):
        head = self.bn(self.conv(x.permute(0, 3, 1, 2).float() / 255)).flatten(2)
        return {"tensor": head, "dict": {"other": head}, "tuple": (head, head)}[self.kind]


def _small_card(tmp_path, net: nn.Module, dynamic: bool = True, head_dtype: str = "float32") -> ModelCard:
    path = tmp_path / f"small_{net.kind}_{dynamic}_{head_dtype}_{net.training}.pt2"
    example = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)
    shapes = ({0: torch.export.Dim("batch", min=1, max=64)},) if dynamic else None
    torch.export.save(torch.export.export(net, (example,), dynamic_shapes=shapes), str(path))
    card = ModelCard(
        name="small",
        version="0",
        model_path=path,
        sha256=file_sha256(path),
        input=InputSpec("image", (8, 8)),
        outputs=(OutputSpec("head", ("batch", 6, 16), head_dtype),),
        decoder=DecoderSpec("yolo", {"output": "head"}),
        classes=(ClassSpec("a"), ClassSpec("b")),
        format="torch_export",
    )
    return load_card(write_card(card, path.with_suffix(".card.json")))


class _Casting(_Small):
    """A head computed in fp32 whatever autocast does (``.float()`` on a convolution's output)."""

    def forward(self, x: torch.Tensor):
        return torch.sigmoid(self.conv(x.permute(0, 3, 1, 2).float() / 255).float()).flatten(2)


def test_autocast_runs_a_program_that_casts_to_float(tmp_path):
    # bf16 autocast on the CPU stands for fp16 on CUDA: the program's own .float() must not trip it.
    net = _Casting("tensor").eval()
    card = _small_card(tmp_path, net)
    tiles = np.stack([smooth_image(8, 8, seed=i) for i in range(3)])
    with torch.no_grad():
        want = net(torch.from_numpy(tiles)).numpy()
    got = create_backend(card, "torch", device="cpu", precision="bf16").infer(tiles)["head"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=2e-2)  # bf16 convolution: 8 bits of mantissa


def test_a_single_tensor_program_is_the_cards_only_output(tmp_path):
    net = _Small("tensor").eval()
    tb = create_backend(_small_card(tmp_path, net), "torch", device="cpu", precision="fp32")
    tiles = np.stack([smooth_image(8, 8, seed=i) for i in range(3)])
    with torch.no_grad():
        want = net(torch.from_numpy(tiles)).numpy()
    np.testing.assert_allclose(tb.infer(tiles)["head"], want, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "dynamic", "dtype", "train", "message"),
    [
        ("dict", True, "float32", False, r"expected a dict with the card's names \['head'\], found keys \['other'\]"),
        ("tuple", True, "float32", False, r"expected a tuple of 1 tensors .* found 2"),
        ("tensor", False, "float32", False, r"batch axis is fixed at 2"),
        ("tensor", True, "float16", False, r"output 'head' dtype: expected float16, found float32"),
        ("tensor", True, "float32", True, r"training mode \(batch_norm.*exported after model.eval\(\)"),
    ],
)
def test_program_that_does_not_fit_its_card_is_refused(tmp_path, kind, dynamic, dtype, train, message):
    net = _Small(kind).train(train)
    card = _small_card(tmp_path, net, dynamic, dtype)
    with pytest.raises(ModelError, match=message):
        create_backend(card, "torch", device="cpu", precision="fp32")


def test_a_card_with_other_outputs_than_the_detector_is_refused(models, tmp_path):
    _, pt2_card, _ = models["detector"]
    outputs = tuple(dataclasses.replace(o, dtype="int64") if o.name == "labels" else o for o in pt2_card.outputs)
    card = dataclasses.replace(pt2_card, outputs=outputs)
    with pytest.raises(ModelError, match=r"output 'labels' dtype: expected int64, found int32"):
        create_backend(card, "torch", device="cpu", precision="fp32")


def test_card_check_runs_a_pt2_on_the_cpu_and_card_init_names_the_way(models):
    from wsi_pipeline.inference.card_init import check_card, draft_card

    _, pt2_card, _ = models["detector"]
    assert check_card(pt2_card.card_path).format == "torch_export"  # one blank tile through the program
    with pytest.raises(ModelError, match="card init reads ONNX graphs only"):
        draft_card(pt2_card.model_path)
