"""ExportedModule: a ``torch.export`` program (``.pt2``) loaded, checked against the card, on the device."""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError, ModelError
from .card_spec import ModelCard
from .model_signature import check_signature_matches_card

try:
    import torch
except ImportError as exc:  # the torch extra is not installed
    raise BackendUnavailableError("PyTorch is not installed (the 'gpu' extra installs it)") from exc


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
