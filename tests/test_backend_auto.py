"""``--backend auto`` decides without importing torch where no GPU can be there."""

from __future__ import annotations

import os
import subprocess
import sys

from wsi_pipeline.inference import backend

_SCRIPT = (
    "import sys; import wsi_pipeline.pipeline; from wsi_pipeline.inference.backend import resolve_backend; "
    "print(resolve_backend('auto'), 'torch' in sys.modules)"
)


def test_auto_without_visible_gpu_picks_ort_without_importing_torch():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ort", "False"]


def test_gpu_probe(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not backend.cuda_may_be_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not backend.cuda_may_be_present()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(backend.os.path, "isdir", lambda p: False)
    monkeypatch.setattr(backend.ctypes.util, "find_library", lambda name: None)
    assert not backend.cuda_may_be_present()  # no driver, no libcuda
    assert backend.resolve_backend("auto") == "ort"
    monkeypatch.setattr(backend.ctypes.util, "find_library", lambda name: "libcuda.so.1" if name == "cuda" else None)
    assert backend.cuda_may_be_present()
    assert backend.resolve_backend("torch") == "torch"  # an explicit choice is kept
