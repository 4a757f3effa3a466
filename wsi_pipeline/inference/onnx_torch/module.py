"""OnnxModule: an ONNX graph as a torch module, its constants folded on the host."""

from __future__ import annotations

import os

import torch

from ...errors import ModelError
from .ops import HOST_INPUTS, OPS, node_attr, op_softmax, op_softmax_before_13


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

    SUPPORTED_OPS = frozenset(OPS) | {"Constant"}

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
        self._ops = {**OPS, "Softmax": op_softmax if opset >= 13 else op_softmax_before_13}
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
                value = node_attr(node, "value")
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
            host_pos = HOST_INPUTS.get(node.op_type, ())
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
            host_pos = HOST_INPUTS.get(node.op_type, ())
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
