"""ONNX ops as torch functions: ``OPS[op_type](node, *inputs)``, and which inputs are read on the host.

Each function takes the ONNX node (for its attributes) and its inputs as
tensors, and returns a tensor or a tuple of them. Inputs listed in
``HOST_INPUTS`` (shapes, axes, scales, k) are always host tensors, read as
Python numbers, so the forward pass never synchronises with the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import ModelError
from .host_values import on_device, to_device_of

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


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    def op(node, a, b):
        a, b = to_device_of(a, b)
        return fn(a, b)

    return op


def node_attr(node, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _pads_2d(node, x: torch.Tensor, fill: float) -> tuple[torch.Tensor, list[int]]:
    """ONNX pads [t, l, b, r] -> symmetric padding for torch, padding explicitly when asymmetric."""
    if node_attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ModelError(
            f"node {node.name!r} ({node.op_type}): auto_pad={node_attr(node, 'auto_pad')!r} "
            "is not supported (export with explicit pads)"
        )
    pads = list(node_attr(node, "pads", [0, 0, 0, 0]))
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
    strides = node_attr(node, "strides", [1] * (w.dim() - 2))
    dilations = node_attr(node, "dilations", [1] * (w.dim() - 2))
    group = node_attr(node, "group", 1)
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[w.dim()]
    return conv(x, w, b, stride=strides, padding=padding, dilation=dilations, groups=group)


def _op_maxpool(node, x):
    if len(node.output) > 1 and node.output[1]:
        raise ModelError(f"node {node.name!r}: MaxPool with an Indices output is not supported")
    x, padding = _pads_2d(node, x, -math.inf)
    k = node_attr(node, "kernel_shape")
    return F.max_pool2d(
        x,
        k,
        stride=node_attr(node, "strides", [1] * len(k)),
        padding=padding,
        dilation=node_attr(node, "dilations", [1] * len(k)),
        ceil_mode=bool(node_attr(node, "ceil_mode", 0)),
    )


def _op_avgpool(node, x):
    x, padding = _pads_2d(node, x, 0.0)
    k = node_attr(node, "kernel_shape")
    return F.avg_pool2d(
        x,
        k,
        stride=node_attr(node, "strides", [1] * len(k)),
        padding=padding,
        ceil_mode=bool(node_attr(node, "ceil_mode", 0)),
        count_include_pad=bool(node_attr(node, "count_include_pad", 0)),
    )


def _op_resize(node, x, roi=None, scales=None, sizes=None):
    mode = node_attr(node, "mode", "nearest")
    ctm = node_attr(node, "coordinate_transformation_mode", "half_pixel")
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
        if ctm != "asymmetric" or node_attr(node, "nearest_mode", "round_prefer_floor") != "floor":
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
    if not node_attr(node, "allowzero", 0):
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
    axes = _ints(axes) if axes is not None else list(node_attr(node, "axes"))
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


def _op_squeeze(node, x, axes=None):
    if axes is None and node_attr(node, "axes") is None:
        return x.squeeze()
    axes = _ints(axes) if axes is not None else list(node_attr(node, "axes"))
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
    axis = node_attr(node, "axis", 0) % x.dim()
    if idx.dim() == 0:
        i = int(idx) if idx.device.type == "cpu" else idx
        if isinstance(i, int):
            return x.select(axis, i % x.shape[axis])
    idx = on_device(idx, x.device)
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    out = torch.index_select(x, axis, idx.reshape(-1))
    return out.reshape(list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1 :]))


def _op_gather_elements(node, x, idx):
    axis = node_attr(node, "axis", 0) % x.dim()
    idx = on_device(idx, x.device).long()
    return torch.gather(x, axis, torch.where(idx < 0, idx + x.shape[axis], idx))


def _op_topk(node, x, k):
    values, indices = torch.topk(
        x,
        int(k.reshape(-1)[0]),
        dim=node_attr(node, "axis", -1),
        largest=bool(node_attr(node, "largest", 1)),
        sorted=bool(node_attr(node, "sorted", 1)),
    )
    return values, indices


def _op_clip(node, x, lo=None, hi=None):
    lo = float(lo) if lo is not None and lo.numel() else node_attr(node, "min")
    hi = float(hi) if hi is not None and hi.numel() else node_attr(node, "max")
    return torch.clamp(x, lo, hi)


def _op_concat(node, *xs):
    dev = next((x.device for x in xs if x.device.type != "cpu"), xs[0].device)
    # torch.cat promotes mixed float widths (autocast leaves fp16 beside fp32).
    return torch.cat([x.to(dev) for x in xs], dim=node_attr(node, "axis"))


def _op_where(node, c, a, b):
    dev = next((t.device for t in (c, a, b) if t.device.type != "cpu"), c.device)
    return torch.where(c.to(dev), a.to(dev), b.to(dev))


def _op_constant_of_shape(node, shape):
    value = node_attr(node, "value")
    if value is None:
        return torch.zeros(_ints(shape), dtype=torch.float32)
    from onnx import numpy_helper

    v = numpy_helper.to_array(value).reshape(-1)
    return torch.full(_ints(shape), v[0].item(), dtype=_ONNX_DTYPES[value.data_type])


def op_softmax(node, x):
    return torch.softmax(x, dim=node_attr(node, "axis", -1))


def op_softmax_before_13(node, x):
    """Softmax of opsets 1-12: over all axes from ``axis`` (default 1) on, as one flattened axis."""
    axis = node_attr(node, "axis", 1) % max(x.dim(), 1)
    return torch.softmax(x.reshape(*x.shape[:axis], -1), dim=-1).reshape(x.shape)


def _op_cast(node, x):
    return x.to(_ONNX_DTYPES[node_attr(node, "to")])


def _op_transpose(node, x):
    perm = node_attr(node, "perm")
    return x.permute(perm if perm is not None else list(reversed(range(x.dim()))))


def _op_flatten(node, x):
    axis = node_attr(node, "axis", 1) % max(x.dim(), 1)
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _op_reduce(fn):
    def op(node, x, axes=None):
        axes = _ints(axes) if axes is not None else node_attr(node, "axes")
        keep = bool(node_attr(node, "keepdims", 1))
        if axes is None:
            return fn(x, dim=tuple(range(x.dim())), keepdim=keep)
        return fn(x, dim=tuple(axes), keepdim=keep)

    return op


def _op_argmax(node, x):
    return torch.argmax(x, dim=node_attr(node, "axis", 0), keepdim=bool(node_attr(node, "keepdims", 1)))


def _op_conv_transpose(node, x, w, b=None):
    """ConvTranspose: explicit (possibly asymmetric) pads cropped from the full output."""
    nd = w.dim() - 2
    if node_attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "VALID") or node_attr(node, "output_shape") is not None:
        raise ModelError(
            f"node {node.name!r} (ConvTranspose): auto_pad / output_shape are not supported (export with explicit pads)"
        )
    pads = list(node_attr(node, "pads", [0] * (2 * nd)))
    begin, end = pads[:nd], pads[nd:]
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    sym = begin == end
    y = conv(
        x,
        w,
        b,
        stride=node_attr(node, "strides", [1] * nd),
        padding=begin if sym else 0,
        output_padding=node_attr(node, "output_padding", [0] * nd),
        groups=node_attr(node, "group", 1),
        dilation=node_attr(node, "dilations", [1] * nd),
    )
    if sym:
        return y
    index = [slice(None), slice(None)] + [
        slice(bg, y.shape[2 + i] - e) for i, (bg, e) in enumerate(zip(begin, end, strict=True))
    ]
    return y[tuple(index)]


def _op_batch_norm(node, x, scale, bias, mean, var):
    if node_attr(node, "training_mode", 0) or (len(node.output) > 1 and any(node.output[1:])):
        raise ModelError(
            f"node {node.name!r}: BatchNormalization in training mode is not supported (export the model in eval mode)"
        )
    x, scale = to_device_of(x, scale)
    bias, mean, var = (on_device(t, x.device) for t in (bias, mean, var))
    return F.batch_norm(x, mean, var, scale, bias, False, 0.0, node_attr(node, "epsilon", 1e-5))


def _op_layer_norm(node, x, scale, bias=None):
    if len(node.output) > 1 and any(node.output[1:]):
        raise ModelError(f"node {node.name!r}: LayerNormalization's Mean / InvStdDev outputs are not supported")
    if node_attr(node, "stash_type", 1) != 1:
        raise ModelError(
            f"node {node.name!r}: LayerNormalization stash_type {node_attr(node, 'stash_type')} "
            "is not supported (expected 1: float32)"
        )
    axis = node_attr(node, "axis", -1) % x.dim()
    y = F.layer_norm(x, x.shape[axis:], eps=node_attr(node, "epsilon", 1e-5))
    y, scale = to_device_of(y, scale)
    y = y * scale
    if bias is not None:
        y, bias = to_device_of(y, bias)
        y = y + bias
    return y


def _op_gemm(node, a, b, c=None):
    a, b = to_device_of(a, b)
    if node_attr(node, "transA", 0):
        a = a.transpose(0, 1)
    if node_attr(node, "transB", 0):
        b = b.transpose(0, 1)
    y = torch.matmul(a, b)
    alpha, beta = node_attr(node, "alpha", 1.0), node_attr(node, "beta", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y, c = to_device_of(y, c)
        y = y + (c * beta if beta != 1.0 else c)
    return y


def _op_split(node, x, split=None):
    axis = node_attr(node, "axis", 0) % x.dim()
    if split is not None and split.numel():
        sizes = _ints(split)
    elif node_attr(node, "split") is not None:  # opset < 13: an attribute
        sizes = list(node_attr(node, "split"))
    else:  # equal parts; opset 18's num_outputs makes the last one smaller when it does not divide
        parts = node_attr(node, "num_outputs", len(node.output))
        sizes = [-(-x.shape[axis] // parts)] * parts
        sizes[-1] = x.shape[axis] - sizes[0] * (parts - 1)
    return tuple(torch.split(x, sizes, dim=axis))


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _op_pad(node, x, pads=None, value=None, axes=None):
    mode = node_attr(node, "mode", "constant")
    if mode not in _PAD_MODES:
        raise ModelError(f"node {node.name!r}: Pad mode {mode!r} is not supported")
    pad_list = _ints(pads) if pads is not None else list(node_attr(node, "pads"))  # opset < 11: attributes
    fill = float(value.reshape(-1)[0]) if value is not None and value.numel() else node_attr(node, "value", 0.0)
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
HOST_INPUTS: dict[str, tuple[int, ...]] = {
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

OPS: dict[str, Callable[..., Any]] = {
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
    "LeakyRelu": lambda n, x: F.leaky_relu(x, node_attr(n, "alpha", 0.01)),
    "HardSigmoid": lambda n, x: torch.clamp(x * node_attr(n, "alpha", 0.2) + node_attr(n, "beta", 0.5), 0, 1),
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
    "Mod": lambda n, a, b: _binary(torch.fmod if node_attr(n, "fmod", 0) else torch.remainder)(n, a, b),
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
    "Softmax": op_softmax,
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
