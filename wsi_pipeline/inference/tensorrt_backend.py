"""TensorRT backend: one engine, one execution context and one CUDA stream per executor worker.

Kept thin on purpose: the loader, executor, pinned buffers, streams and
output decoding are shared with the PyTorch CUDA backend, which proves that
path on machines without TensorRT. TensorRT's I/O buffers are torch tensors
and its streams are torch streams (``set_tensor_address`` on
``tensor.data_ptr()``, ``execute_async_v3(stream.cuda_stream)``), so the
whole GPU path has one CUDA layer. Written for TensorRT 10 and 11
(name-based I/O: ``set_input_shape`` / ``get_tensor_shape``; the
binding-index API is gone). The plan is built on first use by
:func:`~.engine_build.build_engine` and cached under ``engines/cache/``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, ConfigError, ModelError
from .card import load_card, require_onnx
from .card_spec import ModelCard
from .engine_build import DEFAULT_MAX_BATCH, build_engine, import_tensorrt
from .ort_backend import check_tile_batch


def _torch_dtypes(trt: Any) -> dict[Any, Any]:
    import torch

    return {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT8: torch.int8,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.UINT8: torch.uint8,
        trt.DataType.BOOL: torch.bool,
    }


class TensorRTRunner:
    """One worker's execution context with its torch-allocated I/O buffers.

    ``input``: ``[max_batch, H, W, 3] uint8`` device buffer. :meth:`run`
    ``(n)`` enqueues the engine on ``input[:n]`` on the CURRENT torch stream
    and returns ``{output name: device tensor [n, ...]}``, valid until the
    next run.
    """

    def __init__(self, backend: TensorRTBackend, stream: Any):
        import torch

        self.torch = torch
        self.backend = backend
        self.stream = stream
        self.max_batch = backend.max_batch
        engine = backend.engine
        context = engine.create_execution_context()
        if context is None:
            raise ModelError(
                f"{backend.plan_path}: TensorRT could not create an execution context (out of device memory?)"
            )
        self.context = context
        h, w = backend.card.input.size_hw
        self.input = torch.empty((self.max_batch, h, w, 3), dtype=torch.uint8, device=backend.device)
        name = backend.input_name
        context.set_input_shape(name, tuple(self.input.shape))
        context.set_tensor_address(name, self.input.data_ptr())
        self.outputs: dict[str, Any] = {}
        for out_name in backend.output_names:
            shape = tuple(context.get_tensor_shape(out_name))
            if any(d < 0 for d in shape):
                raise ModelError(
                    f"{backend.plan_path}: output {out_name!r} has a data-dependent shape "
                    f"{list(shape)}; fixed-size outputs are expected"
                )
            buf = torch.empty(shape, dtype=backend.dtypes[out_name], device=backend.device)
            context.set_tensor_address(out_name, buf.data_ptr())
            self.outputs[out_name] = buf

    def run(self, n: int) -> dict[str, Any]:
        if not 0 < n <= self.max_batch:
            raise ConfigError(f"batch of {n} tiles: expected 1..{self.max_batch}")
        context = self.context
        h, w = self.backend.card.input.size_hw
        context.set_input_shape(self.backend.input_name, (n, h, w, 3))
        stream = self.torch.cuda.current_stream(self.backend.device)
        if not context.execute_async_v3(stream.cuda_stream):
            raise ModelError(f"{self.backend.plan_path}: TensorRT execution failed for a batch of {n}")
        return {k: v[:n] for k, v in self.outputs.items()}


class TensorRTBackend:
    """Runs a TensorRT plan of the card's ONNX model.

    ``engine_path``: a prebuilt plan; otherwise the plan is built (or taken
    from ``engines/cache/``) for ``max_batch`` / ``opt_batch``. Where
    TensorRT or a GPU is missing, constructing it raises
    BackendUnavailableError. ``infer`` takes ``N x H x W x 3 uint8`` tiles
    and returns numpy outputs; the executor uses :meth:`create_runner`.
    """

    def __init__(
        self,
        card: ModelCard | str | os.PathLike[str],
        max_batch: int = DEFAULT_MAX_BATCH,
        opt_batch: int | None = None,
        engine_path: str | os.PathLike[str] | None = None,
        device: str = "cuda",
        workspace_gb: float | None = None,
    ):
        if not isinstance(card, ModelCard):
            card = load_card(card)
        require_onnx(card, "the tensorrt backend")
        trt = import_tensorrt()
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailableError("TensorRT needs a CUDA GPU; none is available here")
        self.card = card if isinstance(card, ModelCard) else load_card(card)
        if self.card.input.layout != "NHWC" or self.card.input.dtype != "uint8":
            raise ModelError(
                f"{self.card.model_path}: the TensorRT backend feeds uint8 NHWC tiles; the "
                f"card wants {self.card.input.dtype} {self.card.input.layout}"
            )
        self.device = torch.device(device)
        if engine_path is None:
            engine_path = build_engine(
                self.card.model_path, max_batch=max_batch, opt_batch=opt_batch, workspace_gb=workspace_gb
            )
        self.plan_path = Path(engine_path)
        if not self.plan_path.is_file():
            raise ModelError(f"{self.plan_path}: TensorRT plan not found")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        with torch.cuda.device(self.device):
            engine = self.runtime.deserialize_cuda_engine(self.plan_path.read_bytes())
        if engine is None:
            raise ModelError(
                f"{self.plan_path}: TensorRT cannot load this plan (built for another "
                f"GPU or TensorRT version?); rebuild it with wsi-pipeline build-engine"
            )
        self.engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        if inputs != [self.card.input.name]:
            raise ModelError(f"{self.plan_path}: engine inputs {inputs}, card input {self.card.input.name!r}")
        self.input_name = inputs[0]
        self.output_names = [n for n in names if n not in inputs]
        if sorted(self.output_names) != sorted(o.name for o in self.card.outputs):
            raise ModelError(
                f"{self.plan_path}: engine outputs {sorted(self.output_names)} differ from "
                f"the card's {sorted(o.name for o in self.card.outputs)}"
            )
        dtypes = _torch_dtypes(trt)
        self.dtypes = {n: dtypes[engine.get_tensor_dtype(n)] for n in self.output_names}
        _, _, max_shape = engine.get_tensor_profile_shape(self.input_name, 0)
        self.max_batch = int(max_shape[0])
        self._runner: TensorRTRunner | None = None
        self._lock = threading.Lock()

    def create_runner(self, stream: Any) -> TensorRTRunner:
        """A per-stream runner: its own execution context and I/O buffers."""
        return TensorRTRunner(self, stream)

    def infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Run ``batch`` (``N x H x W x 3 uint8`` RGB, any N) and return ``{output name: [N, ...]}``."""
        import torch

        batch = check_tile_batch(batch, self.card)
        parts: dict[str, list[np.ndarray]] = {k: [] for k in self.output_names}
        with self._lock:
            if self._runner is None:
                self._runner = TensorRTRunner(self, torch.cuda.Stream(self.device))
            r = self._runner
            for start in range(0, max(batch.shape[0], 1), self.max_batch):
                chunk = torch.from_numpy(batch[start : start + self.max_batch])
                n = max(int(chunk.shape[0]), 1)
                with torch.cuda.stream(r.stream):
                    r.input[: chunk.shape[0]].copy_(chunk)
                    outs = r.run(n)
                    host = {k: v[: chunk.shape[0]].cpu() for k, v in outs.items()}
                for k, v in host.items():
                    parts[k].append(v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy())
        return {k: (p[0] if len(p) == 1 else np.concatenate(p)) for k, p in parts.items()}

    def close(self) -> None:
        self._runner = None
        self.engine = None
        self.runtime = None

    def __enter__(self) -> TensorRTBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
