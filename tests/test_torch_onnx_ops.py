"""The torch backend's ONNX interpreter, op by op, against ONNX Runtime on one- or few-op graphs.

Each case is a graph of one data input ``x`` (float32 unless said) and
initializers for the other inputs, run by :class:`OnnxModule` on the CPU and
by ONNX Runtime; the outputs must agree within ``ATOL`` / ``RTOL`` (float32
arithmetic in a different order: convolutions and matrix products sum in
another order, nothing else differs).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from wsi_pipeline.errors import ModelError  # noqa: E402
from wsi_pipeline.inference.onnx_torch.module import OnnxModule  # noqa: E402

ATOL = 1e-5
RTOL = 1e-5

_rng = np.random.default_rng(0)


def _f(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape).astype(np.float32)


def _i64(*values: int) -> np.ndarray:
    return np.asarray(values, np.int64)


def _graph(tmp_path, op: str, x: np.ndarray, inits: dict[str, np.ndarray | None], opset: int, n_out: int = 1, **attrs):
    """Save a one-node graph ``op(x, *inits)``; a None initializer is an omitted optional input."""
    names = ["x"] + [("" if v is None else k) for k, v in inits.items()]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    elem = {
        np.dtype(np.float32): TensorProto.FLOAT,
        np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.bool_): TensorProto.BOOL,
    }[x.dtype]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, list(x.shape))],
        [helper.make_tensor_value_info(o, elem, None) for o in outs],  # every op here keeps x's dtype
        [numpy_helper.from_array(v, k) for k, v in inits.items() if v is not None],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, path)
    return path


def _check(path, x: np.ndarray) -> None:
    import onnxruntime as ort

    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with torch.no_grad():
        got = OnnxModule(path).eval()(torch.from_numpy(x))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert tuple(g.shape) == w.shape
        np.testing.assert_allclose(g.numpy(), w, atol=ATOL, rtol=RTOL)


CASES = {
    # name: (op, x, initializers, opset, outputs, attributes)
    "convtranspose_stride2": (
        "ConvTranspose",
        _f(1, 4, 5, 6),
        {"w": _f(4, 3, 2, 2), "b": _f(3)},
        17,
        1,
        {"strides": [2, 2]},
    ),
    "convtranspose_pads_outpad_group": (
        "ConvTranspose",
        _f(2, 4, 5, 5),
        {"w": _f(4, 1, 3, 3)},
        17,
        1,
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1], "group": 2},
    ),
    "convtranspose_asymmetric_pads": (
        "ConvTranspose",
        _f(1, 2, 4, 4),
        {"w": _f(2, 2, 3, 3)},
        17,
        1,
        {"strides": [2, 2], "pads": [0, 1, 1, 0], "dilations": [1, 2]},
    ),
    "split_attribute_opset11": ("Split", _f(2, 6, 3), {}, 11, 2, {"axis": 1, "split": [2, 4]}),
    "split_input_opset13": ("Split", _f(2, 6, 3), {"split": _i64(1, 2, 3)}, 13, 3, {"axis": 1}),
    "split_equal_opset13": ("Split", _f(4, 3), {}, 13, 2, {}),
    "split_num_outputs_uneven_opset18": ("Split", _f(2, 7), {}, 18, 3, {"axis": -1, "num_outputs": 3}),
    "matmul_batched": ("MatMul", _f(2, 3, 4, 5), {"b": _f(5, 6)}, 17, 1, {}),
    "gemm": ("Gemm", _f(3, 4), {"b": _f(4, 5), "c": _f(5)}, 17, 1, {}),
    "gemm_trans_alpha_beta": (
        "Gemm",
        _f(4, 3),
        {"b": _f(5, 4), "c": _f(3, 1)},
        17,
        1,
        {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
    ),
    "gemm_without_c": ("Gemm", _f(3, 4), {"b": _f(4, 2), "c": None}, 17, 1, {"alpha": 3.0}),
    "pad_constant_opset11": (
        "Pad",
        _f(1, 2, 3, 4),
        {"pads": _i64(0, 0, 1, 2, 0, 0, 3, 0), "value": np.float32(1.5)},
        11,
        1,
        {},
    ),
    "pad_constant_attribute_opset2": (
        "Pad",
        _f(1, 2, 3, 4),
        {},
        2,
        1,
        {"pads": [0, 1, 1, 0, 0, 0, 1, 2], "value": -2.0},
    ),
    "pad_negative_crops": ("Pad", _f(1, 2, 5, 5), {"pads": _i64(0, 0, -1, 2, 0, 0, 1, -2)}, 13, 1, {}),
    "pad_reflect": ("Pad", _f(1, 2, 5, 6), {"pads": _i64(0, 0, 2, 1, 0, 0, 1, 3)}, 13, 1, {"mode": "reflect"}),
    "pad_edge": ("Pad", _f(2, 3, 4, 4), {"pads": _i64(0, 0, 1, 1, 0, 0, 2, 2)}, 13, 1, {"mode": "edge"}),
    "pad_wrap_opset19": ("Pad", _f(1, 1, 4, 5), {"pads": _i64(0, 0, 1, 2, 0, 0, 2, 1)}, 19, 1, {"mode": "wrap"}),
    "pad_axes_opset18": (
        "Pad",
        _f(1, 2, 3, 4),
        {"pads": _i64(1, 2, 3, 0), "value": np.float32(0.25), "axes": _i64(-1, 1)},
        18,
        1,
        {},
    ),
    "batchnorm": (
        "BatchNormalization",
        _f(2, 3, 4, 5),
        {"scale": _f(3), "bias": _f(3), "mean": _f(3), "var": np.abs(_f(3)) + 0.5},
        15,
        1,
        {"epsilon": 1e-3},
    ),
    "global_average_pool": ("GlobalAveragePool", _f(2, 3, 5, 7), {}, 17, 1, {}),
    "global_max_pool": ("GlobalMaxPool", _f(2, 3, 5, 7), {}, 17, 1, {}),
    "erf": ("Erf", _f(3, 4) * 2, {}, 17, 1, {}),
    "layernorm_last_axis": (
        "LayerNormalization",
        _f(2, 5, 8),
        {"scale": _f(8), "bias": _f(8)},
        17,
        1,
        {"epsilon": 1e-5},
    ),
    "layernorm_axis1_no_bias": ("LayerNormalization", _f(2, 3, 4, 4), {"scale": _f(3, 4, 4)}, 17, 1, {"axis": 1}),
    "softmax_axis1_opset11": ("Softmax", _f(2, 3, 4, 5), {}, 11, 1, {"axis": 1}),  # over C*H*W, flattened
    "softmax_default_axis_opset11": ("Softmax", _f(2, 3, 4), {}, 11, 1, {}),
    "softmax_axis1_opset13": ("Softmax", _f(2, 3, 4, 5), {}, 13, 1, {"axis": 1}),  # over C alone
    "mod_integer": ("Mod", _i64(-7, -3, 0, 4, 9).reshape(1, 5), {"b": _i64(3, -4, 5, 3, -2).reshape(1, 5)}, 17, 1, {}),
    "mod_fmod": ("Mod", _f(2, 4) * 5, {"b": np.full((2, 4), 1.5, np.float32)}, 17, 1, {"fmod": 1}),
    "xor": ("Xor", np.array([[True, False, True, False]]), {"b": np.array([True, True, False, False])}, 17, 1, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(tmp_path, case):
    op, x, inits, opset, n_out, attrs = CASES[case]
    _check(_graph(tmp_path, op, x, inits, opset, n_out, **attrs), x)


def test_range_from_shape_matches_onnxruntime(tmp_path):
    # Range's bounds come from the input's shape, as exported code like ``torch.arange(x.shape[1])`` makes them.
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "rf"], ["y0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 5])],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    path = tmp_path / "range.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    _check(path, _f(3, 5))


def test_ops_it_cannot_run_are_named_with_the_ways_out(tmp_path):
    path = _graph(tmp_path, "Einsum", _f(2, 2), {}, 17, 1, equation="ij->ji")
    with pytest.raises(ModelError, match=r"\['Einsum'\].*--backend ort.*\.pt2"):
        OnnxModule(path)


def test_training_mode_batchnorm_is_refused(tmp_path):
    inits = {"scale": _f(3), "bias": _f(3), "mean": _f(3), "var": np.abs(_f(3)) + 0.5}
    path = _graph(tmp_path, "BatchNormalization", _f(2, 3, 4, 4), inits, 15, 1, training_mode=1)
    with pytest.raises(ModelError, match="training mode"):
        OnnxModule(path)(torch.from_numpy(_f(2, 3, 4, 4)))


def test_host_values_recorded_before_a_capture_are_reused_in_it():
    """A CUDA graph capture cannot copy pageable host memory: the warm-up pass records the device
    copies of host values (shape arithmetic) and the capture reuses them, in order."""
    from wsi_pipeline.inference.onnx_torch.host_values import HostCopies, host_to_device

    meta = torch.device("meta")  # a device on every machine; the bookkeeping is the same
    with HostCopies("record", []) as copies:
        first = host_to_device(torch.arange(4.0), meta)
        second = host_to_device(torch.ones(2, 3), meta)
    assert [c[1] for c in copies] == [first, second]
    with HostCopies("replay", copies):
        assert host_to_device(torch.arange(4.0), meta) is first
        assert host_to_device(torch.ones(2, 3), meta) is second
    with HostCopies("replay", copies), pytest.raises(ModelError, match="CUDA graph"):
        host_to_device(torch.arange(5.0), meta)  # not what the warm-up pass saw
    assert host_to_device(torch.arange(3.0), meta).device == meta  # outside a capture: a plain copy


def test_the_interpreter_is_one_class_that_the_backend_runs():
    """Split by job, the backend runs the interpreter and the .pt2 loader of their own modules."""
    from wsi_pipeline.inference import onnx_torch, torch_backend, torch_export
    from wsi_pipeline.inference.onnx_torch import host_values, module

    assert torch_backend.OnnxModule is onnx_torch.OnnxModule is module.OnnxModule
    assert torch_backend.ExportedModule is torch_export.ExportedModule
    assert torch_backend.HostCopies is onnx_torch.HostCopies is host_values.HostCopies
    assert "Conv" in onnx_torch.OnnxModule.SUPPORTED_OPS
