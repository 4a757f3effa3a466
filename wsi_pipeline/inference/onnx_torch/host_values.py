"""Host values a forward pass moves to the device, recorded and replayed around a CUDA graph capture.

Shape arithmetic (Range, Shape ... feeding device ops) computes small host
tensors that device ops then read. A CUDA graph capture cannot copy from
pageable host memory, so the warm-up pass before a capture records the
device copies in order (:class:`HostCopies` ``"record"``) and the capture
reuses them (``"replay"``): the values depend only on the batch shape,
which is fixed per captured graph.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ...errors import ModelError

_host_copies = threading.local()


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
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


class HostCopies:
    """Context: ``record`` the host-to-device copies of a pass, or ``replay`` them in order."""

    def __init__(self, mode: str, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.mode, self.copies = mode, copies

    def __enter__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        _host_copies.state, _host_copies.index = (self.mode, self.copies), 0
        return self.copies

    def __exit__(self, *exc: Any) -> None:
        _host_copies.state = None


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (host values through :func:`host_to_device`)."""
    if t.device == device:
        return t
    return host_to_device(t, device) if t.device.type == "cpu" else t.to(device)


def to_device_of(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring a host operand to the other's device (0-dim host scalars torch mixes by itself)."""
    if a.device == b.device:
        return a, b
    if a.device.type == "cpu" and a.dim() > 0:
        return host_to_device(a, b.device), b
    if b.device.type == "cpu" and b.dim() > 0:
        return a, host_to_device(b, a.device)
    return a, b
