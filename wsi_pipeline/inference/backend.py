"""The inference backend protocol and the factory that picks one by name.

A backend runs one model (described by its :class:`~.card.ModelCard`) on
batches of tiles. ``infer`` takes ``N x H x W x 3 uint8`` RGB tiles (H, W =
the card's input size, C-contiguous) and returns the raw outputs by name,
each with N in its first axis; decoding them is the decoders' job.
"""

from __future__ import annotations

import ctypes.util
import importlib
import os
import sys
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import BackendUnavailableError, ConfigError, ModelError
from .card import load_card, require_onnx
from .card_spec import ModelCard


@runtime_checkable
class Backend(Protocol):
    """What every backend (ort, torch, tensorrt) provides."""

    card: ModelCard
    max_batch: int

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Run ``batch`` (``N x H x W x 3 uint8`` RGB) and return ``{output name: array [N, ...]}``."""
        ...

    def close(self) -> None:
        """Free the session/engine; the backend cannot run afterwards."""
        ...


# name -> (module relative to this package, class name). Other backends
# register here as they are written; import is deferred so that e.g. torch
# is only needed when the torch backend is asked for.
BACKENDS: dict[str, tuple[str, str]] = {
    "ort": (".ort_backend", "OrtBackend"),
    "torch": (".torch_backend", "TorchBackend"),
    "tensorrt": (".tensorrt_backend", "TensorRTBackend"),
}
# What the ``backend`` setting accepts: a backend's name, or ``auto`` (see :func:`resolve_backend`).
BACKEND_CHOICES = ("auto", *BACKENDS)


def create_backend(card: ModelCard | str | os.PathLike[str], backend: str = "ort", **opts: Any) -> Backend:
    """Make a backend by name for ``card`` (a ModelCard, or a card/model path to load).

    ``opts`` go to the backend's constructor (e.g. ``max_batch``,
    ``intra_op_threads`` for ``ort``). Raises ConfigError for an unknown name
    and BackendUnavailableError when the backend cannot run on this machine.
    """
    if not isinstance(card, ModelCard):
        card = load_card(card)
    try:
        module_name, class_name = BACKENDS[backend]
    except KeyError:
        raise ConfigError(f"backend: expected one of {sorted(BACKENDS)}, found {backend!r}") from None
    try:
        module = importlib.import_module(module_name, __package__)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {backend!r} is not available here: {exc}") from exc
    cls = getattr(module, class_name)
    return cls(card, **opts)


def cuda_may_be_present() -> bool:
    """Whether this process could see an NVIDIA GPU, decided without importing torch.

    False when ``CUDA_VISIBLE_DEVICES`` hides every device (empty or ``-1``)
    or when neither the NVIDIA kernel driver (``/proc/driver/nvidia``) nor
    the CUDA driver library (``libcuda``; ``nvcuda`` on Windows) is there.
    True means only that torch is worth asking.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-1")):
        return False
    if sys.platform.startswith("linux") and os.path.isdir("/proc/driver/nvidia"):
        return True
    return bool(ctypes.util.find_library("cuda") or ctypes.util.find_library("nvcuda"))


def resolve_backend(name: str, card: ModelCard | None = None) -> str:
    """``auto`` -> ``tensorrt`` where TensorRT and CUDA are present, else ``torch`` on CUDA, else ``ort``.

    torch is imported only where :func:`cuda_may_be_present` (importing it
    takes seconds, which a CPU-only run should not pay). A ``card`` whose
    model is a ``torch.export`` program (``.pt2``) resolves to ``torch``, on
    CUDA or the CPU alike: ModelError where ``name`` is ``ort`` or
    ``tensorrt`` (which run ONNX only) or where PyTorch is not installed.
    """
    if card is not None and card.format == "torch_export":
        if name in ("ort", "tensorrt"):
            require_onnx(card, f"the {name} backend")
        if name in ("auto", "torch"):
            try:
                import torch  # noqa: F401
            except ImportError:
                raise ModelError(
                    f"{card.model_path}: a torch.export program runs with PyTorch, which is "
                    "not installed here: pip install 'wsi-pipeline[gpu]'"
                ) from None
            return "torch"
        return name
    if name != "auto":
        return name
    if not cuda_may_be_present():
        return "ort"
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return "ort"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "torch"
    return "tensorrt"
