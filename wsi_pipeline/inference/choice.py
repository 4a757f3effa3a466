"""How a card runs here: which backend (``auto`` falls back down :data:`AUTO_ORDER`), tiles per batch.

:func:`~.backend.resolve_backend` says what ``auto`` means on this machine
and for the card's model format (a ``.pt2`` runs with torch, on the GPU
where there is one, else on the CPU); :func:`make_executor` builds the
executor, falling back to the next backend where one cannot start (ONNX
models only); :func:`default_batch_size` sizes batches from free device
memory.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import BackendUnavailableError
from .backend import resolve_backend
from .card_spec import ModelCard
from .executor import Executor

log = logging.getLogger("wsi_pipeline")

# ``auto`` starts where resolve_backend says and falls back down this list.
AUTO_ORDER = ("tensorrt", "torch", "ort")
CPU_BATCH_SIZE = 8
MAX_GPU_BATCH = 64
# Device memory one tile pixel needs in flight, an upper estimate for small
# detectors like the shipped ones: uint8 input (3 B), its normalised fp16 copy
# (6 B) and a generous allowance for activations. Only a quarter of the free
# memory is budgeted with it, so an underestimate still fits.
GPU_BYTES_PER_TILE_PIXEL = 96


def default_batch_size(card: ModelCard, on_cuda: bool) -> int:
    """Tiles per batch: from free device memory on CUDA (at most 64), 8 on the CPU.

    On CUDA a quarter of the free memory is budgeted for the tiles in flight
    of one stream, at :data:`GPU_BYTES_PER_TILE_PIXEL` per tile pixel.
    """
    if not on_cuda:
        return CPU_BATCH_SIZE
    import torch

    free, _ = torch.cuda.mem_get_info()
    h, w = card.input.size_hw
    n = int(free * 0.25 // (h * w * GPU_BYTES_PER_TILE_PIXEL))
    return max(1, min(MAX_GPU_BATCH, n))


def fixed_batches(tiles: int, batch_size: int) -> list[int]:
    """The sizes of ``tiles`` cut into batches of ``batch_size``, the last one what is left."""
    full, rest = divmod(tiles, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def even_batches(tiles: int, batch_size: int, sessions: int) -> list[int]:
    """The sizes of ``tiles`` cut for ``sessions`` CPU sessions: whole rounds of one batch per
    session, as few as batches of at most ``batch_size`` allow, the tiles shared evenly.

    Cut by ``batch_size`` alone, a frame of 9 tiles is a batch of 8 on one session and 1 on the
    other, which waits: 0.169 s for a 1,024 px frame on 2 cores against 0.100 s as 5 and 4
    (benchmarks/bench_qc_latency.py)."""
    if tiles <= 0:
        return []
    batches = min(tiles, sessions * -(-tiles // (sessions * batch_size)))
    size, extra = divmod(tiles, batches)
    return [size + 1] * extra + [size] * (batches - extra)


def default_reader_workers(cores: int) -> int:
    """Tile reader threads for ``cores`` CPU cores: all but two (left to the executor and the
    consumer), between 2 and 4. The readers share the GIL with the executor's and the stitcher's
    threads: on 16 cores, 4 threads fed the GPU fastest (benchmarks/HISTORY.md: 2 / 4 / 8 / 12 threads
    gave 818 / 1,007 / 985 / 880 tiles/s)."""
    return max(2, min(4, cores - 2))


def make_executor(
    card: ModelCard, requested: str = "auto", streams: int | None = None, batch_size: int | None = None
) -> tuple[Executor, str]:
    """An executor for ``card`` on the backend ``requested`` (``auto``: the best that starts) and its name.

    ``batch_size`` caps a GPU backend's batch (None: its default).
    """
    name = resolve_backend(requested, card)
    # auto falls back only for ONNX models: a .pt2 runs with torch alone.
    candidates = AUTO_ORDER[AUTO_ORDER.index(name) :] if requested == "auto" and card.format == "onnx" else (name,)
    last: Exception | None = None
    for cand in candidates:
        opts: dict[str, Any] = {}
        if cand in ("torch", "tensorrt") and batch_size:
            opts["max_batch"] = max(batch_size, 1)
        if cand == "torch" and card.format == "torch_export":
            import torch

            if not torch.cuda.is_available():  # only torch runs a .pt2: on the CPU where no GPU is
                opts.update(device="cpu", precision="fp32")
        try:
            return Executor.from_card(card, cand, streams=streams, **opts), cand
        except BackendUnavailableError as exc:
            last = exc
            if requested != "auto":
                raise
            log.warning("backend %s unavailable (%s); trying the next", cand, exc)
    raise BackendUnavailableError(f"no backend could run {card.name}: {last}")


__all__ = [
    "AUTO_ORDER",
    "CPU_BATCH_SIZE",
    "default_batch_size",
    "default_reader_workers",
    "even_batches",
    "fixed_batches",
    "make_executor",
]
