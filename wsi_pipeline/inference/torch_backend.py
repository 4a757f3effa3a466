"""PyTorch backend: the card's ONNX graph run as a torch module, on CUDA or on the CPU.

The model is taken from the ONNX file itself (the shipped artefact, whose
SHA-256 the card pins), not from a separate checkpoint: :class:`OnnxModule`
turns the graph's initializers into tensors and runs its nodes with torch
ops, so the torch path computes exactly the function ONNX Runtime and
TensorRT compute. It is hand-written rather than taken from onnx2torch
because it must work offline, keep shape arithmetic on the host (so the
forward pass can be captured in a CUDA graph) and needs only the ops our
detectors export (see ``OnnxModule.SUPPORTED_OPS``); an unsupported op is
refused when the model is loaded, naming the op.

On CUDA, :meth:`TorchBackend.create_runner` gives each executor stream its
own :class:`TorchRunner`: a device input buffer, and one captured CUDA graph
per batch size bucket (powers of two up to ``max_batch``), replayed on that
stream. ``precision`` picks autocast to fp16/bf16 (convolutions and other
matrix ops in half precision, index arithmetic and ``exp`` kept in fp32) or
plain fp32 (TF32 convolutions, cuDNN's default).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, ConfigError, ModelError
from .card import ModelCard, load_card
from .ort_backend import check_tile_batch

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # the torch extra is not installed
    raise BackendUnavailableError("PyTorch is not installed (the 'gpu' extra installs it)") from exc

PRECISIONS = ("fp32", "fp16", "bf16")
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# ONNX TensorProto element type -> torch dtype.
_ONNX_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}


def _ints(t: torch.Tensor) -> list[int]:
    """A host shape/axes tensor as Python ints (never a device sync: these stay on the CPU)."""
    return [int(v) for v in t.reshape(-1).tolist()]


def _to_device_of(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring a host operand to the other's device (0-dim host scalars torch mixes by itself)."""
    if a.device == b.device:
        return a, b
    if a.device.type == "cpu" and a.dim() > 0:
        return a.to(b.device), b
    if b.device.type == "cpu" and b.dim() > 0:
        return a, b.to(a.device)
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
        raise ModelError(f"node {node.name!r} ({node.op_type}): auto_pad={_attr(node, 'auto_pad')!r} "
                         "is not supported (export with explicit pads)")
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
    return F.max_pool2d(x, k, stride=_attr(node, "strides", [1] * len(k)), padding=padding,
                        dilation=_attr(node, "dilations", [1] * len(k)),
                        ceil_mode=bool(_attr(node, "ceil_mode", 0)))


def _op_avgpool(node, x):
    x, padding = _pads_2d(node, x, 0.0)
    k = _attr(node, "kernel_shape")
    return F.avg_pool2d(x, k, stride=_attr(node, "strides", [1] * len(k)), padding=padding,
                        ceil_mode=bool(_attr(node, "ceil_mode", 0)),
                        count_include_pad=bool(_attr(node, "count_include_pad", 0)))


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
            raise ModelError(f"node {node.name!r}: nearest Resize needs coordinate_transformation_mode="
                             f"asymmetric and nearest_mode=floor (found {ctm})")
        return F.interpolate(x, size=size, scale_factor=scale, mode="nearest")
    if mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        torch_mode = {3: "linear", 4: "bilinear", 5: "trilinear"}[x.dim()]
        return F.interpolate(x, size=size, scale_factor=scale, mode=torch_mode,
                             align_corners=ctm == "align_corners")
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
    idx = idx.to(x.device)
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    out = torch.index_select(x, axis, idx.reshape(-1))
    return out.reshape(list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:]))


def _op_gather_elements(node, x, idx):
    axis = _attr(node, "axis", 0) % x.dim()
    idx = idx.to(x.device).long()
    return torch.gather(x, axis, torch.where(idx < 0, idx + x.shape[axis], idx))


def _op_topk(node, x, k):
    values, indices = torch.topk(x, int(k.reshape(-1)[0]), dim=_attr(node, "axis", -1),
                                 largest=bool(_attr(node, "largest", 1)), sorted=bool(_attr(node, "sorted", 1)))
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


# Inputs read as Python numbers (shapes, axes, scales, k): always passed as host tensors.
_HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Resize": (1, 2, 3), "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "TopK": (1,),
    "Unsqueeze": (1,), "Squeeze": (1,), "ConstantOfShape": (0,), "Clip": (1, 2),
    "ReduceMax": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
}

_OPS: dict[str, Callable[..., Any]] = {
    "Conv": _op_conv, "MaxPool": _op_maxpool, "AveragePool": _op_avgpool, "Resize": _op_resize,
    "Relu": lambda n, x: torch.relu(x), "Sigmoid": lambda n, x: torch.sigmoid(x),
    "Exp": lambda n, x: torch.exp(x), "Floor": lambda n, x: torch.floor(x),
    "Tanh": lambda n, x: torch.tanh(x), "Sqrt": lambda n, x: torch.sqrt(x),
    "Neg": lambda n, x: -x, "Abs": lambda n, x: torch.abs(x), "Log": lambda n, x: torch.log(x),
    "Not": lambda n, x: torch.logical_not(x),
    "LeakyRelu": lambda n, x: F.leaky_relu(x, _attr(n, "alpha", 0.01)),
    "HardSigmoid": lambda n, x: torch.clamp(x * _attr(n, "alpha", 0.2) + _attr(n, "beta", 0.5), 0, 1),
    "Add": _binary(torch.add), "Sub": _binary(torch.sub), "Mul": _binary(torch.mul),
    "Div": _binary(lambda a, b: torch.div(a, b, rounding_mode="trunc")
                   if not a.is_floating_point() and not b.is_floating_point() else torch.div(a, b)),
    "Pow": _binary(torch.pow), "Equal": _binary(torch.eq), "Greater": _binary(torch.gt),
    "Less": _binary(torch.lt), "And": _binary(torch.logical_and), "Or": _binary(torch.logical_or),
    "Max": _binary(torch.maximum), "Min": _binary(torch.minimum),
    "Cast": _op_cast, "Transpose": _op_transpose, "Reshape": _op_reshape, "Expand": _op_expand,
    "Unsqueeze": _op_unsqueeze, "Squeeze": _op_squeeze, "Slice": _op_slice, "Gather": _op_gather,
    "GatherElements": _op_gather_elements, "TopK": _op_topk, "Clip": _op_clip, "Concat": _op_concat,
    "Where": _op_where, "ConstantOfShape": _op_constant_of_shape, "Softmax": _op_softmax,
    "Flatten": _op_flatten, "ArgMax": _op_argmax,
    "ReduceMax": _op_reduce(torch.amax), "ReduceMean": _op_reduce(torch.mean),
    "ReduceSum": _op_reduce(torch.sum),
    "Identity": lambda n, x: x,
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
        unsupported = sorted({n.op_type for n in graph.node if n.op_type not in self.SUPPORTED_OPS
                              or n.domain not in ("", "ai.onnx")})
        if unsupported:
            raise ModelError(f"{model_path}: the torch backend cannot run op(s) {unsupported}; "
                             "use --backend ort or tensorrt")
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
                    raise ModelError(f"{model_path}: node {node.name!r}: Constant without 'value' "
                                     "is not supported")
                consts[node.output[0]] = torch.from_numpy(numpy_helper.to_array(value).copy())
                continue
            ins = [i for i in node.input]
            if all(not i or i in consts for i in ins):
                # Constant folding on the host.
                outs = _OPS[node.op_type](node, *[consts[i] if i else None for i in ins])
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
                elif on_device and pos not in host_pos and name in dev and not (
                        node.op_type == "Gather" and host[name].dim() == 0):  # a scalar index: select()
                    args.append(dev[name])
                else:
                    args.append(host[name])
            while args and args[-1] is None:
                args.pop()
            outs = _OPS[node.op_type](node, *args)
            if isinstance(outs, tuple):
                for name, value in zip(node.output, outs, strict=False):
                    if name:
                        env[name] = value
            else:
                env[node.output[0]] = outs
        return tuple(env[name] for name in self.output_names)


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
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}
        self._pool = None
        self._capture_lock = backend._capture_lock

    def _bucket(self, n: int) -> int:
        return min(self.max_batch, 1 << max(0, (n - 1).bit_length()))

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        x = self.input[:b]
        self.stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm-up: cuDNN algorithm choice and lazy init stay out of the graph
                self.backend._forward(x)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Serialised: captures of different streams must not interleave.
        with self._capture_lock:
            with torch.cuda.graph(graph, pool=self._pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                outs = self.backend._forward(x)
        self.stream.synchronize()
        return graph, outs

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
        graph, outs = entry
        graph.replay()
        return {k: v[:n] for k, v in outs.items()}


class TorchBackend:
    """Runs the card's ONNX model with PyTorch (CUDA or CPU).

    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``precision``:
    ``fp32`` | ``fp16`` | ``bf16`` (autocast; on the CPU fp32 or bf16).
    ``channels_last`` stores convolution weights NHWC (the uint8 NHWC input
    permuted to NCHW is already channels-last in memory). ``cuda_graphs``
    captures the forward pass per batch size bucket (CUDA only). ``infer``
    takes ``N x H x W x 3 uint8`` tiles and returns numpy outputs
    ``{name: [N, ...]}`` like :class:`~.ort_backend.OrtBackend`; the executor
    uses :meth:`create_runner` instead to keep everything on the device.
    """

    def __init__(self, card: ModelCard | str | os.PathLike[str], device: str = "cuda",
                 precision: str = "fp16", channels_last: bool = True, cuda_graphs: bool = True,
                 max_batch: int = 64):
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
        if self.card.input.layout != "NHWC" or self.card.input.dtype != "uint8" or \
                self.card.input.channel_order != "RGB":
            raise ModelError(f"{self.card.model_path}: the torch backend feeds uint8 NHWC RGB tiles; "
                             f"the card wants {self.card.input.dtype} {self.card.input.layout} "
                             f"{self.card.input.channel_order}")
        self.precision = precision
        self.max_batch = int(max_batch)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.channels_last = channels_last
        module = OnnxModule(self.card.model_path).eval()
        if sorted(module.output_names) != sorted(o.name for o in self.card.outputs):
            raise ModelError(f"{self.card.model_path}: outputs {sorted(module.output_names)} "
                             "differ from the card's")
        module = module.to(self.device)
        if channels_last:
            for key in list(module._buffers):
                buf = module._buffers[key]
                if buf is not None and buf.dim() == 4:
                    module._buffers[key] = buf.contiguous(memory_format=torch.channels_last)
        self.module = module
        self.output_names = list(module.output_names)
        self._capture_lock = threading.Lock()
        self._runner: TorchRunner | None = None
        self._infer_lock = threading.Lock()
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model on a device batch ``[n, H, W, 3] uint8``; outputs as the graph gives them."""
        with torch.no_grad():
            if self.precision == "fp32":
                outs = self.module(x)
            else:
                with torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPES[self.precision],
                                    cache_enabled=False):
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
                chunk = torch.from_numpy(batch[start:start + self.max_batch])
                if self.is_cuda:
                    if self._runner is None:
                        self._runner = TorchRunner(self, torch.cuda.Stream(self.device))
                    r = self._runner
                    with torch.cuda.stream(r.stream):
                        r.input[:len(chunk)].copy_(chunk)
                        outs = {k: v.float() if v.is_floating_point() else v
                                for k, v in r.run(len(chunk)).items()}
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


_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64,
              "uint8": np.uint8, "bool": np.bool_}


def _cast_to_card(outputs: dict[str, np.ndarray], card: ModelCard) -> dict[str, np.ndarray]:
    """Outputs in the dtypes the card declares (autocast may have left float16 behind)."""
    out = {}
    for spec in card.outputs:
        v = outputs[spec.name]
        want = _NP_DTYPES.get(spec.dtype)
        out[spec.name] = v.astype(want, copy=False) if want is not None else v
    return out
