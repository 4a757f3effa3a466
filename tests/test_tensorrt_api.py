"""The TensorRT code uses only names the real bindings have, and none of the removed APIs.

TensorRT's libraries cannot be installed here, but the bindings wheel
(``pip install tensorrt-cu13-bindings``) carries the binding module's shared
object, whose strings hold every class, method, property and enum member
name it exports. Every attribute our TensorRT code reads from a TensorRT
object is collected from the source with ``ast`` and looked up there.
"""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import wsi_pipeline

PKG = Path(wsi_pipeline.__file__).parent
SOURCES = [
    PKG / "inference" / "tensorrt_backend.py",
    PKG / "inference" / "engine_build.py",
    PKG / "commands" / "build_engine.py",
]
# Names our code binds to TensorRT objects (module, builder, network, ...).
TRT_ROOTS = {
    "trt",
    "builder",
    "network",
    "parser",
    "config",
    "profile",
    "engine",
    "context",
    "runtime",
    "timing_cache",
    "logger",
    "inp",
}
REMOVED = [
    "execute_async_v2",
    "get_binding_shape",
    "set_binding_shape",
    "BuilderFlag.FP16",
    "BuilderFlag.INT8",
    "IInt8EntropyCalibrator2",
    "int8_calibrator",
    "max_workspace_size",
    "BuilderFlag",
]
MUST_USE = {
    "execute_async_v3",
    "set_input_shape",
    "set_tensor_address",
    "build_serialized_network",
    "set_memory_pool_limit",
    "create_optimization_profile",
    "set_shape",
    "STRONGLY_TYPED",
    "WORKSPACE",
    "create_timing_cache",
    "deserialize_cuda_engine",
    "get_tensor_profile_shape",
}


def _chain(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute | ast.Call):
        if isinstance(node, ast.Call):  # config.get_timing_cache().serialize()
            node = node.func
            continue
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _api_names(tree: ast.AST) -> set[str]:
    """Attribute names read from TensorRT objects (``trt.X.Y``, ``self.engine.m``, ``hasattr(trt.E, "M")``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        chain = None
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            chain = [*_chain(node.args[0]), node.args[1].value]
        if not chain:
            continue
        for i, part in enumerate(chain[:-1]):
            if part in TRT_ROOTS and (i == 0 or chain[i - 1] in ("self", "backend")):
                names.update(chain[i + 1 :])
                break
    return names


def used_names() -> set[str]:
    names: set[str] = set()
    for src in SOURCES:
        names |= _api_names(ast.parse(src.read_text()))
    # Torch/numpy attributes reached through our own variables are not TensorRT's.
    return names - {"data_ptr", "shape", "read_bytes"}


def _bindings():
    spec = importlib.util.find_spec("tensorrt_bindings") or importlib.util.find_spec("tensorrt")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the TensorRT bindings are not installed (pip install tensorrt-cu13-bindings)")
    root = Path(next(iter(spec.submodule_search_locations)))
    sos = sorted(root.glob("tensorrt*.so"))
    if not sos:
        pytest.skip(f"no TensorRT binding shared object under {root}")
    return root, sos[0]


def test_every_tensorrt_name_we_use_is_in_the_bindings():
    root, so = _bindings()
    blob = so.read_bytes()
    py_text = "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))
    names = used_names()
    assert MUST_USE <= names, f"collector missed {sorted(MUST_USE - names)}"
    # The linker merges string tails ("INPUT" may live inside "CONDITIONAL_INPUT\0"),
    # so a name counts as present when it ends a NUL-terminated string.
    missing = [
        n for n in sorted(names) if n.encode() + b"\0" not in blob and not re.search(rf"\b{re.escape(n)}\b", py_text)
    ]
    assert not missing, f"{so.name} does not export {missing}"


def test_unknown_names_would_be_caught():
    """The check above can fail: a removed API name is absent from the 11.x bindings."""
    _, so = _bindings()
    blob = so.read_bytes()
    for name in ("execute_async_v2", "get_binding_shape", "IInt8EntropyCalibrator2"):
        assert name.encode() + b"\0" not in blob


def test_no_removed_tensorrt_api_in_source():
    for src in SOURCES:
        text = src.read_text()
        for name in REMOVED:
            assert not re.search(rf"\b{re.escape(name)}\b", text), f"{src.name} uses removed {name}"
        tree = ast.parse(text)
        # builder.build_engine(network, config) is the pre-10 build call.
        assert "build_engine" not in _api_names(tree), f"{src.name} calls TensorRT's old build_engine"


def test_missing_tensorrt_is_one_clear_error(tmp_path, capsys):
    from wsi_pipeline.cli import main
    from wsi_pipeline.errors import BackendUnavailableError
    from wsi_pipeline.inference import engine_build

    try:
        engine_build.import_tensorrt()
    except BackendUnavailableError as exc:
        assert str(exc) == "TensorRT is not installed (no tensorrt Python package)"
    else:
        pytest.skip("TensorRT is installed here")
    import argparse

    from wsi_pipeline.commands import build_engine

    parser = argparse.ArgumentParser()
    build_engine.register(parser.add_subparsers())
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not used")
    args = parser.parse_args(["build-engine", str(model), "--max-batch", "8"])
    with pytest.raises(BackendUnavailableError, match="^TensorRT is not installed"):
        args.func(args)
    # Through the CLI entry point: one line, no traceback (once build-engine is a listed command).
    import wsi_pipeline.cli as cli

    if "build_engine" in cli.COMMANDS:
        assert main(["build-engine", str(model)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: TensorRT is not installed") and err.count("\n") == 1
        assert "build-engine needs TensorRT" in err and "use --backend" not in err  # no option it lacks
