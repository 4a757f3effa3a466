"""An ONNX graph run with torch ops: the torch backend's interpreter of ONNX models.

The model is taken from the ONNX file itself (the shipped artefact, whose
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

Modules: :mod:`.ops` (one function per ONNX op, and which inputs are read
on the host), :mod:`.host_values` (host values moved to the device, recorded
and replayed around a CUDA graph capture), :mod:`.module` (:class:`OnnxModule`).
"""

from __future__ import annotations

from ...errors import BackendUnavailableError

try:
    import torch  # noqa: F401
except ImportError as exc:  # the torch extra is not installed
    raise BackendUnavailableError("PyTorch is not installed (the 'gpu' extra installs it)") from exc

from .host_values import HostCopies, host_to_device
from .module import OnnxModule

__all__ = ["HostCopies", "OnnxModule", "host_to_device"]
