"""Build TensorRT engines (plans) from ONNX models, cached by model, GPU and TensorRT version.

Written against TensorRT 10 and 11. Precision comes from the ONNX file (an
FP16 graph, or explicit Q/DQ INT8): networks are built strongly typed, so
there are no precision builder flags and no calibrators (TensorRT 11 has
neither). The plan has one optimization profile over the batch axis
(min 1, opt, max). Plans land in ``engines/cache/`` beside the model
(``cache_dir``), named by the model's SHA-256, the GPU's name, the
TensorRT version and the batch profile, so a plan is reused exactly when it
was built for this model on this kind of GPU with this TensorRT; the
builder's timing cache is kept beside the plans and reused across builds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import BackendUnavailableError, ConfigError, ModelError
from ..io.atomic import atomic_write
from .card import file_sha256, format_for

TRT_MISSING = "TensorRT is not installed (no tensorrt Python package)"
DEFAULT_MAX_BATCH = 64


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or BackendUnavailableError with one clear line."""
    try:
        import tensorrt as trt
    except (ImportError, OSError):
        try:
            # The standalone bindings wheel names its module tensorrt_bindings;
            # it loads only where the TensorRT libraries are installed.
            import tensorrt_bindings as trt
        except (ImportError, OSError):
            raise BackendUnavailableError(TRT_MISSING) from None
    return trt


def gpu_name(device: int = 0) -> str:
    """The CUDA device's name (e.g. ``NVIDIA H200``), read through torch."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("building a TensorRT engine needs torch for the CUDA device") from None
    if not torch.cuda.is_available():
        raise BackendUnavailableError("no CUDA GPU is available to build a TensorRT engine for")
    return torch.cuda.get_device_name(device)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def default_cache_dir(model_path: str | os.PathLike[str]) -> Path:
    """``engines/cache`` for a model in ``engines/``."""
    return Path(model_path).resolve().parent / "cache"


def plan_path_for(
    model_path: str | os.PathLike[str],
    *,
    max_batch: int,
    opt_batch: int,
    gpu: str,
    trt_version: str,
    cache_dir: str | os.PathLike[str] | None = None,
    sha256: str | None = None,
) -> Path:
    """Where the plan of this model/GPU/TensorRT/profile lives in the cache."""
    model_path = Path(model_path)
    sha = sha256 or file_sha256(model_path)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(model_path)
    name = f"{model_path.stem}-{sha[:16]}-{_slug(gpu)}-trt{_slug(trt_version)}-b{opt_batch}-{max_batch}.plan"
    return cache / name


def timing_cache_path(cache_dir: Path, gpu: str, trt_version: str) -> Path:
    return cache_dir / f"timing-{_slug(gpu)}-trt{_slug(trt_version)}.cache"


def _check_batches(max_batch: int, opt_batch: int | None) -> int:
    if max_batch < 1:
        raise ConfigError(f"--max-batch: expected >= 1, found {max_batch}")
    opt = max_batch if opt_batch is None else opt_batch
    if not 1 <= opt <= max_batch:
        raise ConfigError(f"--opt-batch: expected 1..{max_batch}, found {opt}")
    return opt


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as f:
        f.write(data)


def build_engine(
    model_path: str | os.PathLike[str],
    max_batch: int = DEFAULT_MAX_BATCH,
    opt_batch: int | None = None,
    workspace_gb: float | None = None,
    out: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build (or find in the cache) the TensorRT plan of an ONNX model; return its path.

    The input's batch axis gets the profile ``1 / opt_batch (default
    max_batch) / max_batch``. ``workspace_gb`` caps the builder's scratch
    memory. ``out`` writes the plan there instead of the cache (the cache is
    still used as the source when it holds the plan). Raises
    BackendUnavailableError without TensorRT or a GPU, ModelError when the
    parser or the builder rejects the model.
    """
    model_path = Path(model_path)
    if format_for(model_path) != "onnx":
        raise ModelError(
            f"{model_path}: expected an ONNX model, found a torch.export program; TensorRT "
            "builds engines from ONNX only (the torch backend runs a .pt2: --backend torch)"
        )
    trt = import_tensorrt()
    if not model_path.is_file():
        raise ModelError(f"{model_path}: ONNX model not found")
    opt = _check_batches(int(max_batch), opt_batch)
    gpu = gpu_name()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(model_path)
    cached = plan_path_for(
        model_path, max_batch=int(max_batch), opt_batch=opt, gpu=gpu, trt_version=trt.__version__, cache_dir=cache
    )
    target = Path(out) if out is not None else cached
    if cached.is_file() and not force:
        if target != cached:
            _write_atomic(target, cached.read_bytes())
        return target
    say = log or (lambda msg: None)
    say(
        f"building TensorRT {trt.__version__} engine for {model_path.name} on {gpu} "
        f"(batch 1/{opt}/{max_batch}); this takes a while the first time"
    )

    parsed = _parse_network(trt, model_path, int(max_batch))
    tc_path = timing_cache_path(cache, gpu, trt.__version__)
    config = _builder_config(trt, parsed, opt, int(max_batch), workspace_gb, tc_path)
    builder, network = parsed.builder, parsed.network
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ModelError(f"{model_path}: TensorRT could not build an engine (see the messages above)")
    data = bytes(memoryview(plan))
    _write_atomic(cached, data)
    if target != cached:
        _write_atomic(target, data)
    _write_atomic(tc_path, bytes(memoryview(config.get_timing_cache().serialize())))
    say(f"wrote {target}")
    return target


class _ParsedNetwork(NamedTuple):
    """A strongly typed network parsed from the ONNX file, with what must outlive its build.

    The parser holds the weights the network refers to until the engine is built.
    """

    logger: Any
    builder: Any
    parser: Any
    network: Any
    input_name: str
    rest: tuple[int, ...]  # the input's fixed H, W, C (or C, H, W)


def _parse_network(trt: Any, model_path: Path, max_batch: int) -> _ParsedNetwork:
    """The model's network, its one input checked: fixed sizes past the batch axis, a dynamic batch."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    # TensorRT 10 needs STRONGLY_TYPED to take precision from the ONNX file;
    # TensorRT 11 networks are always strongly typed.
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelError(f"{model_path}: TensorRT's ONNX parser rejected the model: {errors}")
    if network.num_inputs != 1:
        raise ModelError(f"{model_path}: expected one input, found {network.num_inputs}")
    inp = network.get_input(0)
    dims = tuple(inp.shape)
    if len(dims) != 4 or any(d < 1 for d in dims[1:]):
        raise ModelError(
            f"{model_path}: input {inp.name!r}: expected [batch, H, W, C] with fixed H, W, C, found {list(dims)}"
        )
    if dims[0] > 0 and dims[0] != max_batch:
        raise ModelError(
            f"{model_path}: input {inp.name!r} has a fixed batch of {dims[0]}; export it with a dynamic batch axis"
        )
    return _ParsedNetwork(logger, builder, parser, network, inp.name, dims[1:])


def _builder_config(
    trt: Any,
    parsed: _ParsedNetwork,
    opt: int,
    max_batch: int,
    workspace_gb: float | None,
    tc_path: Path,
) -> Any:
    """The builder config: workspace cap, the batch profile ``1 / opt / max_batch`` and the timing cache."""
    builder, rest = parsed.builder, parsed.rest
    config = builder.create_builder_config()
    if workspace_gb is not None:
        if workspace_gb <= 0:
            raise ConfigError(f"--workspace-gb: expected > 0, found {workspace_gb}")
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    profile = builder.create_optimization_profile()
    profile.set_shape(parsed.input_name, (1, *rest), (opt, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    timing_cache = config.create_timing_cache(tc_path.read_bytes() if tc_path.is_file() else b"")
    config.set_timing_cache(timing_cache, False)
    return config
