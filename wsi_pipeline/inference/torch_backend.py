"""PyTorch backend: the card's model run as a torch module, on CUDA or on the CPU.

The model is the card's ONNX graph, or a ``torch.export`` program (``.pt2``,
:class:`ExportedModule`; only this backend runs one). Both become a module
giving the outputs by the card's names, and everything after that (device
input buffers, autocast, CUDA graphs, the executor) is one code path.

Where each job lives: the ONNX interpreter (:class:`OnnxModule`, one torch
function per ONNX op) in :mod:`.onnx_torch`; the ``.pt2`` loader
(:class:`ExportedModule`) in :mod:`.torch_export`; here the backend and its
per-stream CUDA-graph runner.

On CUDA, :meth:`TorchBackend.create_runner` gives each executor stream its
own :class:`TorchRunner`: a device input buffer, and one captured CUDA graph
per batch size bucket (powers of two up to ``max_batch``), replayed on that
stream. ``precision`` picks autocast to fp16/bf16 (convolutions and other
matrix ops in half precision, index arithmetic and ``exp`` kept in fp32) or
plain fp32 (TF32 convolutions, cuDNN's default).
"""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np

from ..errors import BackendUnavailableError, ConfigError, ModelError
from .card import load_card
from .card_spec import ModelCard
from .ort_backend import check_tile_batch

try:
    import torch
except ImportError as exc:  # the torch extra is not installed
    raise BackendUnavailableError("PyTorch is not installed (the 'gpu' extra installs it)") from exc

from .onnx_torch import HostCopies, OnnxModule
from .torch_export import ExportedModule

__all__ = ["PRECISIONS", "TorchBackend", "TorchRunner"]

PRECISIONS = ("fp32", "fp16", "bf16")
_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


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
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], list]] = {}
        self._pool = None
        self._capture_lock = backend._capture_lock

    def _bucket(self, n: int) -> int:
        return min(self.max_batch, 1 << max(0, (n - 1).bit_length()))

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], list]:
        """The graph of a batch of ``b``, its output tensors, and the device copies of host values it reads."""
        x = self.input[:b]
        self.stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm-up: cuDNN algorithm choice and lazy init stay out of the graph
                with HostCopies("record", []) as copies:
                    self.backend._forward(x)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Serialised: captures of different streams must not interleave.
        with self._capture_lock:
            with (
                torch.cuda.graph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"),
                HostCopies("replay", copies),
            ):
                outs = self.backend._forward(x)
        self.stream.synchronize()
        return graph, outs, copies

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
        graph, outs, _ = entry
        graph.replay()
        return {k: v[:n] for k, v in outs.items()}


class TorchBackend:
    """Runs the card's model (ONNX graph or ``.pt2`` program) with PyTorch (CUDA or CPU).

    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``precision``:
    ``fp32`` | ``fp16`` | ``bf16`` (autocast; on the CPU fp32 or bf16).
    ``channels_last`` stores convolution weights NHWC (the uint8 NHWC input
    permuted to NCHW is already channels-last in memory). ``cuda_graphs``
    captures the forward pass per batch size bucket (CUDA only). ``infer``
    takes ``N x H x W x 3 uint8`` tiles and returns numpy outputs
    ``{name: [N, ...]}`` like :class:`~.ort_backend.OrtBackend`; the executor
    uses :meth:`create_runner` instead to keep everything on the device. The
    tiles are turned into the card's input on the device (:meth:`_prepare`:
    channel order, dtype, mean/std, layout), as ONNX Runtime's are on the host.
    """

    def __init__(
        self,
        card: ModelCard | str | os.PathLike[str],
        device: str = "cuda",
        precision: str = "fp16",
        channels_last: bool = True,
        cuda_graphs: bool = True,
        max_batch: int = 64,
    ):
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
        self.precision = precision
        self.max_batch = int(max_batch)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.channels_last = channels_last
        if self.card.format == "torch_export":
            module: torch.nn.Module = ExportedModule(self.card, self.device)
        else:
            module = OnnxModule(self.card.model_path)
            if sorted(module.output_names) != sorted(o.name for o in self.card.outputs):
                raise ModelError(
                    f"{self.card.model_path}: outputs {sorted(module.output_names)} differ from the card's"
                )
        module = module.eval().to(self.device)
        if channels_last:
            for t in itertools.chain(module.parameters(), module.buffers()):
                if t.dim() == 4:
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
        spec = self.card.input
        self._mean = torch.tensor(spec.mean, dtype=torch.float32, device=self.device)
        self._std = torch.tensor(spec.std, dtype=torch.float32, device=self.device)
        self.module = module
        self.output_names = list(module.output_names)
        self._capture_lock = threading.Lock()
        self._runner: TorchRunner | None = None
        self._infer_lock = threading.Lock()
        # cuDNN picks its kernels by heuristics (torch's default): timing them for every batch bucket
        # (torch.backends.cudnn.benchmark) loaded ~140 MB more host memory and was not faster here
        # (benchmarks/probes/probe_setup_memory.py, benchmarks/HISTORY.md).

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Device tiles ``[n, H, W, 3] uint8 RGB`` -> the model's input (the card's order, dtype, layout).

        The device twin of :func:`~.ort_backend.prepare_input`: mean/std are
        applied only where the card says the model does not apply them itself.
        """
        spec = self.card.input
        if spec.channel_order == "BGR":
            x = x.flip(-1)
        if spec.dtype != "uint8":
            x = x.float()
            if not spec.normalize_in_graph:
                x = (x - self._mean) / self._std
            x = x.to(_INPUT_DTYPES[spec.dtype])
        if spec.layout == "NCHW":
            x = x.permute(0, 3, 1, 2)  # a view: channels-last in memory
        return x

    def _forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model on a device batch ``[n, H, W, 3] uint8``; outputs as the graph gives them."""
        with torch.no_grad():
            x = self._prepare(x)
            if self.precision == "fp32":
                outs = self.module(x)
            else:
                with torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPES[self.precision], cache_enabled=False):
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
                chunk = torch.from_numpy(batch[start : start + self.max_batch])
                if self.is_cuda:
                    if self._runner is None:
                        self._runner = TorchRunner(self, torch.cuda.Stream(self.device))
                    r = self._runner
                    with torch.cuda.stream(r.stream):
                        r.input[: len(chunk)].copy_(chunk)
                        outs = {k: v.float() if v.is_floating_point() else v for k, v in r.run(len(chunk)).items()}
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


_NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def _cast_to_card(outputs: dict[str, np.ndarray], card: ModelCard) -> dict[str, np.ndarray]:
    """Outputs in the dtypes the card declares (autocast may have left float16 behind)."""
    out = {}
    for spec in card.outputs:
        v = outputs[spec.name]
        want = _NP_DTYPES.get(spec.dtype)
        out[spec.name] = v.astype(want, copy=False) if want is not None else v
    return out
