"""ONNX Runtime backend: the CPU backend and the reference the GPU backends are checked against."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError, ModelError
from .card import load_card, require_onnx
from .card_spec import ModelCard


def check_tile_batch(batch: np.ndarray, card: ModelCard) -> np.ndarray:
    """Return ``batch`` as a C-contiguous ``N x H x W x 3 uint8`` array or raise ConfigError."""
    h, w = card.input.size_hw
    if not isinstance(batch, np.ndarray) or batch.dtype != np.uint8 or batch.ndim != 4 or batch.shape[1:] != (h, w, 3):
        found = f"{getattr(batch, 'dtype', type(batch).__name__)} {list(getattr(batch, 'shape', []))}"
        raise ConfigError(f"tiles for {card.model_path}: expected a N x {h} x {w} x 3 uint8 array, found {found}")
    return np.ascontiguousarray(batch)


def prepare_input(batch: np.ndarray, card: ModelCard) -> np.ndarray:
    """``N x H x W x 3 uint8 RGB`` tiles -> the array the model's input wants (card layout/dtype/order).

    Mean/std are applied here only when the card says the graph does not
    apply them itself (``input.normalize_in_graph: false``).
    """
    spec = card.input
    x = batch
    if spec.channel_order == "BGR":
        x = x[..., ::-1]
    if spec.dtype != "uint8":
        x = x.astype(np.float32)
        if not spec.normalize_in_graph:
            x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
        x = x.astype(spec.dtype, copy=False)
    if spec.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x)


class OrtBackend:
    """Runs a model with ONNX Runtime.

    ``max_batch`` tiles go to one session run; ``infer`` splits larger
    batches. A model with a fixed batch dim gets padded batches of that
    size. ``intra_op_threads=None`` leaves ONNX Runtime's default (one thread
    per physical core); ``inter_op_threads`` only matters with parallel
    execution, which is off (sequential is faster for a single-branch CNN).
    ``providers`` defaults to CPU only.
    """

    def __init__(
        self,
        card: ModelCard | str | os.PathLike[str],
        max_batch: int = 8,
        intra_op_threads: int | None = None,
        inter_op_threads: int = 1,
        providers: Sequence[str | tuple[str, dict]] | None = None,
    ):
        import onnxruntime as ort

        self.card = card if isinstance(card, ModelCard) else load_card(card)
        require_onnx(self.card, "the ort backend")
        if max_batch < 1:
            raise ConfigError(f"max_batch: expected >= 1, found {max_batch}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if intra_op_threads is not None:
            opts.intra_op_num_threads = int(intra_op_threads)
        opts.inter_op_num_threads = int(inter_op_threads)
        if self.card.precision == "int8":
            # Integer kernels on x86 CPUs without VNNI (AVX2, AVX-512F) saturate 16-bit sums of
            # u8 x s8 products, which loses objects; this option keeps int8 results the same on
            # every CPU, at some cost in speed where it applies.
            opts.add_session_config_entry("session.x64quantprecision", "1")
        try:
            self.session = ort.InferenceSession(
                str(self.card.model_path), opts, providers=list(providers or ["CPUExecutionProvider"])
            )
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ModelError(f"{self.card.model_path}: onnxruntime cannot load it: {exc}") from exc
        batch_dim = self.session.get_inputs()[0].shape[0]
        self.fixed_batch = batch_dim if isinstance(batch_dim, int) and batch_dim > 0 else None
        self.max_batch = self.fixed_batch or int(max_batch)
        self.output_names = [o.name for o in self.card.outputs]
        self.input_name = self.card.input.name

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Run ``batch`` (``N x H x W x 3 uint8`` RGB, any N) and return ``{output name: [N, ...]}``."""
        batch = check_tile_batch(batch, self.card)
        n = batch.shape[0]
        if n == 0:
            # Run one blank tile to learn the output shapes, return none of it.
            return {k: v[:0] for k, v in self.infer(np.zeros((1, *batch.shape[1:]), np.uint8)).items()}
        parts: list[list[np.ndarray]] = [[] for _ in self.output_names]
        for start in range(0, n, self.max_batch):
            chunk = batch[start : start + self.max_batch]
            real = chunk.shape[0]
            if self.fixed_batch is not None and real < self.fixed_batch:
                pad = np.zeros((self.fixed_batch - real, *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            results = self.session.run(self.output_names, {self.input_name: prepare_input(chunk, self.card)})
            for i, r in enumerate(results):
                parts[i].append(r[:real])
        return {
            name: (p[0] if len(p) == 1 else np.concatenate(p)) for name, p in zip(self.output_names, parts, strict=True)
        }

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]

    def __enter__(self) -> OrtBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
