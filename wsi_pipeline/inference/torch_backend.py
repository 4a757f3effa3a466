"""PyTorch backend: the card's model run as a torch module, on CUDA or on the CPU.

The model is the card's ONNX graph, or a ``torch.export`` program (``.pt2``,
:class:`ExportedModule`; only this backend runs one). Both become a module
giving the outputs by the card's names, and everything after that (device
input buffers, autocast, CUDA graphs, the executor) is one code path.

An ONNX model is taken from the ONNX file itself (the shipped artefact, whose
SHA-256 the card pins), not from a separate checkpoint: :class:`OnnxModule`
turns the graph's initializers into tensors and runs its nodes with torch
ops, so the torch path computes exactly the function ONNX Runtime and
TensorRT compute. It is hand-written rather than taken from onnx2torch
because it must work offline and keep shape arithmetic on the host (so the
forward pass can be captured in a CUDA graph); it covers the ops detectors
and UNets commonly export (``OnnxModule.SUPPORTED_OPS``: convolutions and
transposed ones, pooling, batch and layer norm, MatMul/Gemm, Pad, Split,
Resize, indexing and element-wise ops). An unsupported op is refused when
the model is loaded, naming the ops and the ways out (``--backend ort``, or
the model as a ``.pt2``).

On CUDA, :meth:`TorchBackend.create_runner` gives each executor stream its
own :class:`TorchRunner`: a device input buffer, and one captured CUDA graph
per batch size bucket (powers of two up to ``max_batch``), replayed on that
stream. ``precision`` picks autocast to fp16/bf16 (convolutions and other
matrix ops in half precision, index arithmetic and ``exp`` kept in fp32) or
plain fp32 (TF32 convolutions, cuDNN's default).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, ConfigError, ModelError
from .card import ModelCard, check_signature_matches_card, load_card
from .ort_backend import check_tile_batch

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # the torch extra is not installed
    raise BackendUnavailableError("PyTorch is not installed (the 'gpu' extra installs it)") from exc

PRECISIONS = ("fp32", "fp16", "bf16")
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16}

# ONNX TensorProto element type -> torch dtype.
_ONNX_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    16: torch.bfloat16,
}


def _ints(t: torch.Tensor) -> list[int]:
    """A host shape/axes tensor as Python ints (never a device sync: these stay on the CPU)."""
    return [int(v) for v in t.reshape(-1).tolist()]


# Host values a forward pass moves to the device (shape arithmetic: Range, Shape ... feeding
# device ops). A CUDA graph capture cannot copy from pageable host memory, so the warm-up pass
# before a capture records the device copies in order and the capture reuses them: the values
# depend only on the batch shape, which is fixed per captured graph.
_host_copies = threading.local()


def _host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    state = getattr(_host_copies, "state", None)
    if state is None:
        return t.to(device)
    mode, copies = state
    if mode == "record":
        copies.append((t.clone(), d := t.to(device)))
        return d
    i = _host_copies.index
    _host_copies.index += 1
    if i >= len(copies) or copies[i][0].shape != t.shape or not torch.equal(copies[i][0], t):
        raise ModelError(
            "a host value of the model's graph differs between two passes of one batch size; "
            "it cannot run in a CUDA graph (cuda_graphs=False runs it)"
        )
    return copies[i][1]


class _HostCopies:
    """Context: ``record`` the host-to-device copies of a pass, or ``replay`` them in order."""

    def __init__(self, mode: str, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.mode, self.copies = mode, copies

    def __enter__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _host_copies.state, _host_copies.index = (self.mode, self.copies), 0
        return self.copies

    def __exit__(self, *exc: Any) -> None:
        _host_copies.state = None


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (host values through :func:`_host_to_device`)."""
    if t.device == device:
        return t
    return _host_to_device(t, device) if t.device.type == "cpu" else t.to(device)


def _to_device_of(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring a host operand to the other's device (0-dim host scalars torch mixes by itself)."""
    if a.device == b.device:
        return a, b
    if a.device.type == "cpu" and a.dim() > 0:
        return _host_to_device(a, b.device), b
    if b.device.type == "cpu" and b.dim() > 0:
        return a, _host_to_device(b, a.device)
    return a, b


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    def op(node, a, b):
        a, b = _to_device_of(a, b)
        return fn(a, b)

    return op


def _attr(node, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _pads_2d(node, x: torch.Tensor, fill: float) -> tuple[torch.Tensor, list[int]]:
    """ONNX pads [t, l, b, r] -> symmetric padding for torch, padding explicitly when asymmetric."""
    if _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ModelError(
            f"node {node.name!r} ({node.op_type}): auto_pad={_attr(node, 'auto_pad')!r} "
            "is not supported (export with explicit pads)"
        )
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    nd = len(pads) // 2
    begin, end = pads[:nd], pads[nd:]
    if begin == end:
        return x, begin
    torch_pad: list[int] = []
    for i in reversed(range(nd)):
        torch_pad += [begin[i], end[i]]
    return F.pad(x, torch_pad, value=fill), [0] * nd


def _op_conv(node, x, w, b=None):
    x, padding = _pads_2d(node, x, 0.0)
    strides = _attr(node, "strides", [1] * (w.dim() - 2))
    dilations = _attr(node, "dilations", [1] * (w.dim() - 2))
    group = _attr(node, "group", 1)
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[w.dim()]
    return conv(x, w, b, stride=strides, padding=padding, dilation=dilations, groups=group)


def _op_maxpool(node, x):
    if len(node.output) > 1 and node.output[1]:
        raise ModelError(f"node {node.name!r}: MaxPool with an Indices output is not supported")
    x, padding = _pads_2d(node, x, -math.inf)
    k = _attr(node, "kernel_shape")
    return F.max_pool2d(
        x,
        k,
        stride=_attr(node, "strides", [1] * len(k)),
        padding=padding,
        dilation=_attr(node, "dilations", [1] * len(k)),
        ceil_mode=bool(_attr(node, "ceil_mode", 0)),
    )


def _op_avgpool(node, x):
    x, padding = _pads_2d(node, x, 0.0)
    k = _attr(node, "kernel_shape")
    return F.avg_pool2d(
        x,
        k,
        stride=_attr(node, "strides", [1] * len(k)),
        padding=padding,
        ceil_mode=bool(_attr(node, "ceil_mode", 0)),
        count_include_pad=bool(_attr(node, "count_include_pad", 0)),
    )


def _op_resize(node, x, roi=None, scales=None, sizes=None):
    mode = _attr(node, "mode", "nearest")
    ctm = _attr(node, "coordinate_transformation_mode", "half_pixel")
    size = None
    scale = None
    if sizes is not None and sizes.numel():
        size = _ints(sizes)[2:]
    elif scales is not None and scales.numel():
        s = [float(v) for v in scales.reshape(-1).tolist()]
        if s[:2] != [1.0, 1.0]:
            raise ModelError(f"node {node.name!r}: Resize over batch/channel axes is not supported")
        scale = s[2:]
    if mode == "nearest":
        if ctm != "asymmetric" or _attr(node, "nearest_mode", "round_prefer_floor") != "floor":
            raise ModelError(
                f"node {node.name!r}: nearest Resize needs coordinate_transformation_mode="
                f"asymmetric and nearest_mode=floor (found {ctm})"
            )
        return F.interpolate(x, size=size, scale_factor=scale, mode="nearest")
    if mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        torch_mode = {3: "linear", 4: "bilinear", 5: "trilinear"}[x.dim()]
        return F.interpolate(x, size=size, scale_factor=scale, mode=torch_mode, align_corners=ctm == "align_corners")
    raise ModelError(f"node {node.name!r}: Resize mode={mode!r} with {ctm!r} is not supported")


def _op_reshape(node, x, shape):
    dims = _ints(shape)
    if not _attr(node, "allowzero", 0):
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _op_expand(node, x, shape):
    dims = _ints(shape)
    # ONNX Expand broadcasts both ways (a 1 in the target keeps the input's size).
    rank = max(len(dims), x.dim())
    dims = [1] * (rank - len(dims)) + dims
    xs = [1] * (rank - x.dim()) + list(x.shape)
    return x.expand([max(a, b) if a == 1 or b == 1 else b for a, b in zip(xs, dims, strict=True)])


def _op_unsqueeze(node, x, axes=None):
    axes = _ints(axes) if axes is not None else list(_attr(node, "axes"))
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


def _op_squeeze(node, x, axes=None):
    if axes is None and _attr(node, "axes") is None:
        return x.squeeze()
    axes = _ints(axes) if axes is not None else list(_attr(node, "axes"))
    for a in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.squeeze(a)
    return x


def _op_slice(node, x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * x.dim()
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        if st != 1:
            raise ModelError(f"node {node.name!r}: Slice with step {st} is not supported")
        n = x.shape[a]
        s = max(0, min(n, s + n if s < 0 else s))
        e = max(0, min(n, e + n if e < 0 else e))
        index[a % x.dim()] = slice(s, e)
    return x[tuple(index)]


def _op_gather(node, x, idx):
    axis = _attr(node, "axis", 0) % x.dim()
    if idx.dim() == 0:
        i = int(idx) if idx.device.type == "cpu" else idx
        if isinstance(i, int):
            return x.select(axis, i % x.shape[axis])
    idx = _on_device(idx, x.device)
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    out = torch.index_select(x, axis, idx.reshape(-1))
    return out.reshape(list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1 :]))


def _op_gather_elements(node, x, idx):
    axis = _attr(node, "axis", 0) % x.dim()
    idx = _on_device(idx, x.device).long()
    return torch.gather(x, axis, torch.where(idx < 0, idx + x.shape[axis], idx))


def _op_topk(node, x, k):
    values, indices = torch.topk(
        x,
        int(k.reshape(-1)[0]),
        dim=_attr(node, "axis", -1),
        largest=bool(_attr(node, "largest", 1)),
        sorted=bool(_attr(node, "sorted", 1)),
    )
    return values, indices


def _op_clip(node, x, lo=None, hi=None):
    lo = float(lo) if lo is not None and lo.numel() else _attr(node, "min")
    hi = float(hi) if hi is not None and hi.numel() else _attr(node, "max")
    return torch.clamp(x, lo, hi)


def _op_concat(node, *xs):
    dev = next((x.device for x in xs if x.device.type != "cpu"), xs[0].device)
    # torch.cat promotes mixed float widths (autocast leaves fp16 beside fp32).
    return torch.cat([x.to(dev) for x in xs], dim=_attr(node, "axis"))


def _op_where(node, c, a, b):
    dev = next((t.device for t in (c, a, b) if t.device.type != "cpu"), c.device)
    return torch.where(c.to(dev), a.to(dev), b.to(dev))


def _op_constant_of_shape(node, shape):
    value = _attr(node, "value")
    if value is None:
        return torch.zeros(_ints(shape), dtype=torch.float32)
    from onnx import numpy_helper

    v = numpy_helper.to_array(value).reshape(-1)
    return torch.full(_ints(shape), v[0].item(), dtype=_ONNX_DTYPES[value.data_type])


def _op_softmax(node, x):
    return torch.softmax(x, dim=_attr(node, "axis", -1))


def _op_softmax_before_13(node, x):
    """Softmax of opsets 1-12: over all axes from ``axis`` (default 1) on, as one flattened axis."""
    axis = _attr(node, "axis", 1) % max(x.dim(), 1)
    return torch.softmax(x.reshape(*x.shape[:axis], -1), dim=-1).reshape(x.shape)


def _op_cast(node, x):
    return x.to(_ONNX_DTYPES[_attr(node, "to")])


def _op_transpose(node, x):
    perm = _attr(node, "perm")
    return x.permute(perm if perm is not None else list(reversed(range(x.dim()))))


def _op_flatten(node, x):
    axis = _attr(node, "axis", 1) % max(x.dim(), 1)
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _op_reduce(fn):
    def op(node, x, axes=None):
        axes = _ints(axes) if axes is not None else _attr(node, "axes")
        keep = bool(_attr(node, "keepdims", 1))
        if axes is None:
            return fn(x, dim=tuple(range(x.dim())), keepdim=keep)
        return fn(x, dim=tuple(axes), keepdim=keep)

    return op


def _op_argmax(node, x):
    return torch.argmax(x, dim=_attr(node, "axis", 0), keepdim=bool(_attr(node, "keepdims", 1)))


def _op_conv_transpose(node, x, w, b=None):
    """ConvTranspose: explicit (possibly asymmetric) pads cropped from the full output."""
    nd = w.dim() - 2
    if _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID") or _attr(node, "output_shape") is not None:
        raise ModelError(
            f"node {node.name!r} (ConvTranspose): auto_pad / output_shape are not supported (export with explicit pads)"
        )
    pads = list(_attr(node, "pads", [0] * (2 * nd)))
    begin, end = pads[:nd], pads[nd:]
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    sym = begin == end
    y = conv(
        x,
        w,
        b,
        stride=_attr(node, "strides", [1] * nd),
        padding=begin if sym else 0,
        output_padding=_attr(node, "output_padding", [0] * nd),
        groups=_attr(node, "group", 1),
        dilation=_attr(node, "dilations", [1] * nd),
    )
    if sym:
        return y
    index = [slice(None), slice(None)] + [
        slice(bg, y.shape[2 + i] - e) for i, (bg, e) in enumerate(zip(begin, end, strict=True))
    ]
    return y[tuple(index)]


def _op_batch_norm(node, x, scale, bias, mean, var):
    if _attr(node, "training_mode", 0) or (len(node.output) > 1 and any(node.output[1:])):
        raise ModelError(
            f"node {node.name!r}: BatchNormalization in training mode is not supported (export the model in eval mode)"
        )
    x, scale = _to_device_of(x, scale)
    bias, mean, var = (_on_device(t, x.device) for t in (bias, mean, var))
    return F.batch_norm(x, mean, var, scale, bias, False, 0.0, _attr(node, "epsilon", 1e-5))


def _op_layer_norm(node, x, scale, bias=None):
    if len(node.output) > 1 and any(node.output[1:]):
        raise ModelError(f"node {node.name!r}: LayerNormalization's Mean / InvStdDev outputs are not supported")
    if _attr(node, "stash_type", 1) != 1:
        raise ModelError(
            f"node {node.name!r}: LayerNormalization stash_type {_attr(node, 'stash_type')} "
            "is not supported (expected 1: float32)"
        )
    axis = _attr(node, "axis", -1) % x.dim()
    y = F.layer_norm(x, x.shape[axis:], eps=_attr(node, "epsilon", 1e-5))
    y, scale = _to_device_of(y, scale)
    y = y * scale
    if bias is not None:
        y, bias = _to_device_of(y, bias)
        y = y + bias
    return y


def _op_gemm(node, a, b, c=None):
    a, b = _to_device_of(a, b)
    if _attr(node, "transA", 0):
        a = a.transpose(0, 1)
    if _attr(node, "transB", 0):
        b = b.transpose(0, 1)
    y = torch.matmul(a, b)
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y, c = _to_device_of(y, c)
        y = y + (c * beta if beta != 1.0 else c)
    return y


def _op_split(node, x, split=None):
    axis = _attr(node, "axis", 0) % x.dim()
    if split is not None and split.numel():
        sizes = _ints(split)
    elif _attr(node, "split") is not None:  # opset < 13: an attribute
        sizes = list(_attr(node, "split"))
    else:  # equal parts; opset 18's num_outputs makes the last one smaller when it does not divide
        parts = _attr(node, "num_outputs", len(node.output))
        sizes = [-(-x.shape[axis] // parts)] * parts
        sizes[-1] = x.shape[axis] - sizes[0] * (parts - 1)
    return tuple(torch.split(x, sizes, dim=axis))


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _op_pad(node, x, pads=None, value=None, axes=None):
    mode = _attr(node, "mode", "constant")
    if mode not in _PAD_MODES:
        raise ModelError(f"node {node.name!r}: Pad mode {mode!r} is not supported")
    pad_list = _ints(pads) if pads is not None else list(_attr(node, "pads"))  # opset < 11: attributes
    fill = float(value.reshape(-1)[0]) if value is not None and value.numel() else _attr(node, "value", 0.0)
    rank = x.dim()
    ax = [a % rank for a in _ints(axes)] if axes is not None else list(range(rank))
    n = len(ax)
    begin, end = dict(zip(ax, pad_list[:n], strict=True)), dict(zip(ax, pad_list[n:], strict=True))
    torch_pad: list[int] = []
    for d in reversed(range(rank)):  # torch lists the last axis first
        torch_pad += [begin.get(d, 0), end.get(d, 0)]
    while torch_pad and torch_pad[-2:] == [0, 0]:
        torch_pad = torch_pad[:-2]
    if not torch_pad:
        return x
    if mode == "constant":
        return F.pad(x, torch_pad, value=fill)
    if len(torch_pad) // 2 > min(3, rank - 2) or min(torch_pad) < 0:
        raise ModelError(
            f"node {node.name!r}: Pad mode {mode!r} pads {torch_pad} (torch order): only the "
            "spatial axes of a 3- to 5-D tensor, by non-negative amounts, are supported"
        )
    return F.pad(x, torch_pad, mode=_PAD_MODES[mode])


# Inputs read as Python numbers (shapes, axes, scales, k): always passed as host tensors.
_HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Resize": (1, 2, 3),
    "Reshape": (1,),
    "Expand": (1,),
    "Slice": (1, 2, 3, 4),
    "TopK": (1,),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
    "ConstantOfShape": (0,),
    "Clip": (1, 2),
    "ReduceMax": (1,),
    "ReduceMean": (1,),
    "ReduceSum": (1,),
    "Split": (1,),
    "Pad": (1, 2, 3),
    "Range": (0, 1, 2),
}

_OPS: dict[str, Callable[..., Any]] = {
    "Conv": _op_conv,
    "MaxPool": _op_maxpool,
    "AveragePool": _op_avgpool,
    "Resize": _op_resize,
    "Relu": lambda n, x: torch.relu(x),
    "Sigmoid": lambda n, x: torch.sigmoid(x),
    "Exp": lambda n, x: torch.exp(x),
    "Floor": lambda n, x: torch.floor(x),
    "Tanh": lambda n, x: torch.tanh(x),
    "Sqrt": lambda n, x: torch.sqrt(x),
    "Neg": lambda n, x: -x,
    "Abs": lambda n, x: torch.abs(x),
    "Log": lambda n, x: torch.log(x),
    "Not": lambda n, x: torch.logical_not(x),
    "LeakyRelu": lambda n, x: F.leaky_relu(x, _attr(n, "alpha", 0.01)),
    "HardSigmoid": lambda n, x: torch.clamp(x * _attr(n, "alpha", 0.2) + _attr(n, "beta", 0.5), 0, 1),
    "Add": _binary(torch.add),
    "Sub": _binary(torch.sub),
    "Mul": _binary(torch.mul),
    "Div": _binary(
        lambda a, b: (
            torch.div(a, b, rounding_mode="trunc")
            if not a.is_floating_point() and not b.is_floating_point()
            else torch.div(a, b)
        )
    ),
    "Pow": _binary(torch.pow),
    "Equal": _binary(torch.eq),
    "Greater": _binary(torch.gt),
    "Less": _binary(torch.lt),
    "And": _binary(torch.logical_and),
    "Or": _binary(torch.logical_or),
    "Xor": _binary(torch.logical_xor),
    # fmod=0: the remainder takes the divisor's sign (integers only); fmod=1: the dividend's (C fmod).
    "Mod": lambda n, a, b: _binary(torch.fmod if _attr(n, "fmod", 0) else torch.remainder)(n, a, b),
    "Max": _binary(torch.maximum),
    "Min": _binary(torch.minimum),
    "Cast": _op_cast,
    "Transpose": _op_transpose,
    "Reshape": _op_reshape,
    "Expand": _op_expand,
    "Unsqueeze": _op_unsqueeze,
    "Squeeze": _op_squeeze,
    "Slice": _op_slice,
    "Gather": _op_gather,
    "GatherElements": _op_gather_elements,
    "TopK": _op_topk,
    "Clip": _op_clip,
    "Concat": _op_concat,
    "Where": _op_where,
    "ConstantOfShape": _op_constant_of_shape,
    "Softmax": _op_softmax,
    "Flatten": _op_flatten,
    "ArgMax": _op_argmax,
    "ReduceMax": _op_reduce(torch.amax),
    "ReduceMean": _op_reduce(torch.mean),
    "ReduceSum": _op_reduce(torch.sum),
    "Identity": lambda n, x: x,
    "ConvTranspose": _op_conv_transpose,
    "BatchNormalization": _op_batch_norm,
    "LayerNormalization": _op_layer_norm,
    "Gemm": _op_gemm,
    "MatMul": _binary(torch.matmul),
    "Split": _op_split,
    "Pad": _op_pad,
    "Erf": lambda n, x: torch.erf(x),
    "Range": lambda n, start, limit, delta: torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype),
    "GlobalAveragePool": lambda n, x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True),
    "GlobalMaxPool": lambda n, x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True),
    "Shape": lambda n, x: torch.tensor(list(x.shape), dtype=torch.int64),
}


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a torch module.

    ``forward(x)`` takes the graph's single input (a tensor of its dtype and
    layout, e.g. ``[B, 512, 512, 3] uint8`` NHWC) and returns the outputs in
    graph order. Floating-point initializers are buffers (so ``.to(device)``
    and ``.to(memory_format=...)`` move them); integer ones (shapes, axes)
    stay on the host, as do values computed from ``Shape``, so the forward
    pass never synchronises with the device. Nodes whose inputs are all
    constants are evaluated once here (constant folding).
    """

    SUPPORTED_OPS = frozenset(_OPS) | {"Constant"}

    def __init__(self, model_path: str | os.PathLike[str]):
        super().__init__()
        import onnx
        from onnx import numpy_helper

        try:
            model = onnx.load(str(model_path))
        except Exception as exc:  # onnx raises DecodeError and others
            raise ModelError(f"{model_path}: cannot be read as ONNX: {exc}") from exc
        graph = model.graph
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        # Ops whose meaning changed with the opset: the version this graph was written for.
        self._ops = {**_OPS, "Softmax": _op_softmax if opset >= 13 else _op_softmax_before_13}
        unsupported = sorted(
            {n.op_type for n in graph.node if n.op_type not in self.SUPPORTED_OPS or n.domain not in ("", "ai.onnx")}
        )
        if unsupported:
            raise ModelError(
                f"{model_path}: the torch backend's ONNX interpreter cannot run op(s) "
                f"{unsupported}; run the model with --backend ort (or tensorrt), or give "
                "the torch backend the model as a torch.export program (.pt2, "
                "docs/model_card.md)"
            )
        consts: dict[str, torch.Tensor] = {}
        for init in graph.initializer:
            consts[init.name] = torch.from_numpy(numpy_helper.to_array(init).copy())
        init_names = set(consts)
        self.input_names = [i.name for i in graph.input if i.name not in init_names]
        if len(self.input_names) != 1:
            raise ModelError(f"{model_path}: expected one graph input, found {self.input_names}")
        self.output_names = [o.name for o in graph.output]
        nodes = []
        for node in graph.node:
            if node.op_type == "Constant":
                value = _attr(node, "value")
                if value is None:
                    raise ModelError(f"{model_path}: node {node.name!r}: Constant without 'value' is not supported")
                consts[node.output[0]] = torch.from_numpy(numpy_helper.to_array(value).copy())
                continue
            ins = [i for i in node.input]
            if all(not i or i in consts for i in ins):
                # Constant folding on the host.
                outs = self._ops[node.op_type](node, *[consts[i] if i else None for i in ins])
                outs = outs if isinstance(outs, tuple) else (outs,)
                for name, value in zip(node.output, outs, strict=False):
                    consts[name] = value
                continue
            nodes.append(node)
        self._nodes = nodes
        # Every constant stays on the host (shapes, axes, scales are read as
        # Python numbers there, never synchronising with the device); those that
        # feed data inputs also get a buffer, which moves with the module.
        self._host_consts: dict[str, torch.Tensor] = consts
        self._buffer_names: dict[str, str] = {}
        for node in nodes:
            host_pos = _HOST_INPUTS.get(node.op_type, ())
            for pos, name in enumerate(node.input):
                if name in consts and pos not in host_pos and name not in self._buffer_names:
                    key = f"c{len(self._buffer_names)}"
                    self.register_buffer(key, consts[name].clone(), persistent=False)
                    self._buffer_names[name] = key
        for name in self.output_names:
            if name in consts:
                raise ModelError(f"{model_path}: output {name!r} is a constant; not supported")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        host = self._host_consts
        dev = {name: getattr(self, key) for name, key in self._buffer_names.items()}
        env: dict[str, torch.Tensor] = {self.input_names[0]: x}
        for node in self._nodes:
            # A constant goes in as its device copy when the node's other data
            # inputs live on the device, else as the host tensor.
            on_device = any(i in env and env[i].device.type != "cpu" for i in node.input)
            host_pos = _HOST_INPUTS.get(node.op_type, ())
            args = []
            for pos, name in enumerate(node.input):
                if not name:
                    args.append(None)
                elif name in env:
                    args.append(env[name])
                elif (
                    on_device
                    and pos not in host_pos
                    and name in dev
                    and not (node.op_type == "Gather" and host[name].dim() == 0)
                ):  # a scalar index: select()
                    args.append(dev[name])
                else:
                    args.append(host[name])
            while args and args[-1] is None:
                args.pop()
            outs = self._ops[node.op_type](node, *args)
            if isinstance(outs, tuple):
                for name, value in zip(node.output, outs, strict=False):
                    if name:
                        env[name] = value
            else:
                env[node.output[0]] = outs
        return tuple(env[name] for name in self.output_names)


_CARD_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def _meta_signature(node: Any) -> tuple[str, tuple[Any, ...]]:
    """(card dtype name, shape: ints fixed, None symbolic) of an exported graph node's value."""
    val = node.meta.get("val") if node is not None else None
    if not isinstance(val, torch.Tensor):
        return "not-a-tensor", ()
    return (_CARD_DTYPES.get(val.dtype, str(val.dtype)), tuple(d if isinstance(d, int) else None for d in val.shape))


def _training_nodes(program: Any) -> list[str]:
    """Nodes of an exported program that run in training mode (batch norm on batch statistics, dropout)."""
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if "batch_norm" in target:
            flag = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        elif target.startswith("aten.dropout") or target.startswith("aten.feature_dropout"):
            flag = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        else:
            continue
        if flag is True:
            found.append(node.name)
    return found


class ExportedModule(torch.nn.Module):
    """A ``torch.export`` program (``.pt2``) as a module giving the card's outputs in card order.

    ``forward(x)`` takes the program's single input (the card's input: e.g.
    ``[B, H, W, 3] uint8`` NHWC, or ``[B, 3, H, W] float32`` NCHW) and
    returns one tensor per card output, in the card's ``outputs`` order.
    How the program's outputs map to the card's names: a dict by its keys
    (they must be the card's output names); a tuple or list by position (its
    i-th element is the card's i-th output); a single tensor is the card's
    only output. The program must take the batch axis as dynamic
    (``dynamic_shapes``), and is checked against the card's input and output
    dtypes and fixed dims when loaded. The program is moved to the device
    with ``torch.export.passes.move_to_device_pass``, so tensors the graph
    makes itself (``arange``, ``zeros``) are made there too; its dtype
    assertions (``_assert_tensor_metadata``, which autocast's half-precision
    tensors would fail) are taken out.

    ``torch.export.load`` reads the program's graph and weights; like any
    model file, a ``.pt2`` should come from a trusted source.
    """

    def __init__(self, card: ModelCard, device: torch.device):
        super().__init__()
        path = card.model_path
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # torch raises many kinds for a foreign or corrupt archive
            raise ModelError(f"{path}: cannot be read as a torch.export program: {exc}") from exc
        sig = program.graph_signature
        nodes = {n.name: n for n in program.graph.nodes}
        if len(sig.user_inputs) != 1:
            raise ModelError(
                f"{path}: expected a program of one input (the tile batch), found "
                f"{len(sig.user_inputs)}: {list(sig.user_inputs)}"
            )
        training = sorted(sig.buffers_to_mutate.values()) + _training_nodes(program)
        if training:
            raise ModelError(
                f"{path}: the program runs in training mode ({', '.join(training)}: batch "
                "statistics, dropout or buffer updates); expected a program exported after "
                "model.eval()"
            )
        in_dtype, in_shape = _meta_signature(nodes.get(sig.user_inputs[0]))
        if in_shape and in_shape[0] is not None:
            raise ModelError(
                f"{path}: the input's batch axis is fixed at {in_shape[0]}; expected a dynamic "
                "one: export with dynamic_shapes=({0: torch.export.Dim('batch', min=1)},)"
            )
        names = [o.name for o in card.outputs]
        spec = program.call_spec.out_spec
        flat = spec.num_children == spec.num_leaves  # no nesting
        if spec.is_leaf():
            self._kind, self._pick, leaf_names = "leaf", [0], names
            if len(names) != 1:
                raise ModelError(f"{path}: the program returns one tensor; the card names {len(names)} outputs {names}")
        elif spec.type is dict and flat:
            keys = list(spec.context)
            leaf_names = [str(k) for k in keys]
            if sorted(leaf_names) != sorted(names):
                raise ModelError(
                    f"{path}: outputs: expected a dict with the card's names {sorted(names)}, "
                    f"found keys {sorted(leaf_names)}"
                )
            self._kind, self._pick = "dict", [keys[leaf_names.index(n)] for n in names]
        elif spec.type in (tuple, list) and flat:
            leaf_names = names
            if spec.num_leaves != len(names):
                raise ModelError(
                    f"{path}: outputs: expected a tuple of {len(names)} tensors (the card's "
                    f"{names}, in that order), found {spec.num_leaves}"
                )
            self._kind, self._pick = "sequence", list(range(len(names)))
        else:
            raise ModelError(
                f"{path}: outputs: expected a tensor, a tuple/list of tensors or a dict of them, found {spec}"
            )
        outputs = {
            name: _meta_signature(nodes.get(node_name))
            for name, node_name in zip(leaf_names, sig.user_outputs, strict=True)
        }
        check_signature_matches_card(card, {card.input.name: (in_dtype, in_shape)}, outputs)
        from torch.export.passes import move_to_device_pass

        module = move_to_device_pass(program, device).module()
        # The graph asserts that tensors keep the dtypes they had when exported (before each
        # ``.to(dtype)``); under autocast they are half precision, which is what autocast means.
        # The input's dtype and shape were checked against the card above.
        asserts = [
            n
            for n in module.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default
        ]
        for node in asserts:
            module.graph.erase_node(node)
        if asserts:
            module.recompile()
        self.program = module
        self.output_names = names

    def train(self, mode: bool = True) -> ExportedModule:
        """Only the flag: an exported program's mode was fixed when it was exported."""
        self.training = mode
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.program(x)
        return (out,) if self._kind == "leaf" else tuple(out[k] for k in self._pick)


class TorchRunner:
    """One stream's model state on CUDA: device input buffer and captured graphs.

    ``input``: ``[max_batch, H, W, 3] uint8`` device buffer the executor fills.
    :meth:`run` ``(n)`` runs the model on ``input[:n]`` on the CURRENT stream
    and returns ``{output name: device tensor [n, ...]}``, valid until the next
    :meth:`run` of this runner. Not thread-safe: one runner per stream/thread.
    """

    def __init__(self, backend: TorchBackend, stream: torch.cuda.Stream):
        self.backend = backend
        self.stream = stream
        self.max_batch = backend.max_batch
        h, w = backend.card.input.size_hw
        self.input = torch.zeros((self.max_batch, h, w, 3), dtype=torch.uint8, device=backend.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], list]] = {}
        self._pool = None
        self._capture_lock = backend._capture_lock

    def _bucket(self, n: int) -> int:
        return min(self.max_batch, 1 << max(0, (n - 1).bit_length()))

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], list]:
        """The graph of a batch of ``b``, its output tensors, and the device copies of host values it reads."""
        x = self.input[:b]
        self.stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm-up: cuDNN algorithm choice and lazy init stay out of the graph
                with _HostCopies("record", []) as copies:
                    self.backend._forward(x)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Serialised: captures of different streams must not interleave.
        with self._capture_lock:
            with (
                torch.cuda.graph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"),
                _HostCopies("replay", copies),
            ):
                outs = self.backend._forward(x)
        self.stream.synchronize()
        return graph, outs, copies

    def prepare(self) -> None:
        """Capture the graph for ``max_batch`` now (the executor calls this before starting)."""
        if self.backend.cuda_graphs and self.max_batch not in self._graphs:
            self._graphs[self.max_batch] = self._capture(self.max_batch)

    def run(self, n: int) -> dict[str, torch.Tensor]:
        if not 0 < n <= self.max_batch:
            raise ConfigError(f"batch of {n} tiles: expected 1..{self.max_batch}")
        if not self.backend.cuda_graphs:
            return self.backend._forward(self.input[:n])
        b = self._bucket(n)
        entry = self._graphs.get(b)
        if entry is None:
            cur = torch.cuda.current_stream()
            self.stream.wait_stream(cur)
            entry = self._graphs[b] = self._capture(b)
            cur.wait_stream(self.stream)
        graph, outs, _ = entry
        graph.replay()
        return {k: v[:n] for k, v in outs.items()}


class TorchBackend:
    """Runs the card's model (ONNX graph or ``.pt2`` program) with PyTorch (CUDA or CPU).

    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``precision``:
    ``fp32`` | ``fp16`` | ``bf16`` (autocast; on the CPU fp32 or bf16).
    ``channels_last`` stores convolution weights NHWC (the uint8 NHWC input
    permuted to NCHW is already channels-last in memory). ``cuda_graphs``
    captures the forward pass per batch size bucket (CUDA only). ``infer``
    takes ``N x H x W x 3 uint8`` tiles and returns numpy outputs
    ``{name: [N, ...]}`` like :class:`~.ort_backend.OrtBackend`; the executor
    uses :meth:`create_runner` instead to keep everything on the device. The
    tiles are turned into the card's input on the device (:meth:`_prepare`:
    channel order, dtype, mean/std, layout), as ONNX Runtime's are on the host.
    """

    def __init__(
        self,
        card: ModelCard | str | os.PathLike[str],
        device: str = "cuda",
        precision: str = "fp16",
        channels_last: bool = True,
        cuda_graphs: bool = True,
        max_batch: int = 64,
    ):
        self.card = card if isinstance(card, ModelCard) else load_card(card)
        if precision not in PRECISIONS:
            raise ConfigError(f"precision: expected one of {list(PRECISIONS)}, found {precision!r}")
        if max_batch < 1:
            raise ConfigError(f"max_batch: expected >= 1, found {max_batch}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("CUDA is not available here (torch sees no GPU)")
        if self.device.type == "cpu" and precision == "fp16":
            raise ConfigError("precision fp16 needs CUDA; use fp32 or bf16 on the CPU")
        self.precision = precision
        self.max_batch = int(max_batch)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.channels_last = channels_last
        if self.card.format == "torch_export":
            module: torch.nn.Module = ExportedModule(self.card, self.device)
        else:
            module = OnnxModule(self.card.model_path)
            if sorted(module.output_names) != sorted(o.name for o in self.card.outputs):
                raise ModelError(
                    f"{self.card.model_path}: outputs {sorted(module.output_names)} differ from the card's"
                )
        module = module.eval().to(self.device)
        if channels_last:
            for t in itertools.chain(module.parameters(), module.buffers()):
                if t.dim() == 4:
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
        spec = self.card.input
        self._mean = torch.tensor(spec.mean, dtype=torch.float32, device=self.device)
        self._std = torch.tensor(spec.std, dtype=torch.float32, device=self.device)
        self.module = module
        self.output_names = list(module.output_names)
        self._capture_lock = threading.Lock()
        self._runner: TorchRunner | None = None
        self._infer_lock = threading.Lock()
        # cuDNN picks its kernels by heuristics (torch's default): timing them for every batch bucket
        # (torch.backends.cudnn.benchmark) loaded ~140 MB more host memory and was not faster here
        # (benchmarks/probe_setup_memory.py, BENCHMARKS.md).

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Device tiles ``[n, H, W, 3] uint8 RGB`` -> the model's input (the card's order, dtype, layout).

        The device twin of :func:`~.ort_backend.prepare_input`: mean/std are
        applied only where the card says the model does not apply them itself.
        """
        spec = self.card.input
        if spec.channel_order == "BGR":
            x = x.flip(-1)
        if spec.dtype != "uint8":
            x = x.float()
            if not spec.normalize_in_graph:
                x = (x - self._mean) / self._std
            x = x.to(_INPUT_DTYPES[spec.dtype])
        if spec.layout == "NCHW":
            x = x.permute(0, 3, 1, 2)  # a view: channels-last in memory
        return x

    def _forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model on a device batch ``[n, H, W, 3] uint8``; outputs as the graph gives them."""
        with torch.no_grad():
            x = self._prepare(x)
            if self.precision == "fp32":
                outs = self.module(x)
            else:
                with torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPES[self.precision], cache_enabled=False):
                    outs = self.module(x)
        return dict(zip(self.output_names, outs, strict=True))

    def create_runner(self, stream: torch.cuda.Stream) -> TorchRunner:
        """A per-stream runner (CUDA only): its own input buffer and graphs."""
        if not self.is_cuda:
            raise ConfigError("create_runner is for a CUDA TorchBackend")
        return TorchRunner(self, stream)

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Run ``batch`` (``N x H x W x 3 uint8`` RGB, any N) and return ``{output name: [N, ...]}``."""
        batch = check_tile_batch(batch, self.card)
        n = batch.shape[0]
        if n == 0:
            return {k: v[:0] for k, v in self.infer(np.zeros((1, *batch.shape[1:]), np.uint8)).items()}
        parts: dict[str, list[np.ndarray]] = {k: [] for k in self.output_names}
        with self._infer_lock:
            for start in range(0, n, self.max_batch):
                chunk = torch.from_numpy(batch[start : start + self.max_batch])
                if self.is_cuda:
                    if self._runner is None:
                        self._runner = TorchRunner(self, torch.cuda.Stream(self.device))
                    r = self._runner
                    with torch.cuda.stream(r.stream):
                        r.input[: len(chunk)].copy_(chunk)
                        outs = {k: v.float() if v.is_floating_point() else v for k, v in r.run(len(chunk)).items()}
                        host = {k: v.cpu() for k, v in outs.items()}
                else:
                    host = self._forward(chunk)
                for k, v in host.items():
                    if v.is_floating_point():
                        v = v.float()
                    parts[k].append(v.numpy().copy())
        out = {k: (p[0] if len(p) == 1 else np.concatenate(p)) for k, p in parts.items()}
        return _cast_to_card(out, self.card)

    def close(self) -> None:
        self._runner = None
        self.module = None  # type: ignore[assignment]

    def __enter__(self) -> TorchBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def _cast_to_card(outputs: dict[str, np.ndarray], card: ModelCard) -> dict[str, np.ndarray]:
    """Outputs in the dtypes the card declares (autocast may have left float16 behind)."""
    out = {}
    for spec in card.outputs:
        v = outputs[spec.name]
        want = _NP_DTYPES.get(spec.dtype)
        out[spec.name] = v.astype(want, copy=False) if want is not None else v
    return out
