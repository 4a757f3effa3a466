"""A wheel of the package, installed into a fresh venv outside the repository, runs the default model.

The fresh venv borrows the development venv's third-party packages (a
``.pth`` line to its site-packages, so nothing is downloaded); wsi_pipeline
itself comes only from the wheel.
"""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md")


def _run(cmd: list, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy, so that no build/ or stale build output of the checkout takes part.
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_FILES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "cache", "*.plan", "*.engine")
    shutil.copytree(ROOT / "wsi_pipeline", src / "wsi_pipeline", ignore=ignore)
    shutil.copytree(ROOT / "engines", src / "engines", ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "WSI_PIPELINE_ENGINES")}
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src],
        cwd=tmp,
        env=env,
    )
    wheel = next(dist.glob("wsi_pipeline-*.whl"))

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    venv_site = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp, env=env
        ).stdout.strip()
    )
    # Third-party packages from the development venv; its own .pth files (the editable
    # install of wsi_pipeline among them) are not processed from a path line.
    (venv_site / "dev_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=tmp,
        env=env,
    )
    return venv, env


def test_wheel_carries_the_shipped_models_and_runs_the_default_model(installed_venv, tmp_path):
    venv, env = installed_venv
    work = tmp_path / "elsewhere"  # a folder outside the repository
    work.mkdir()
    where = _run(
        [
            venv / "bin" / "python",
            "-c",
            "import wsi_pipeline, wsi_pipeline.pipeline as p; print(wsi_pipeline.__file__); print(p.DEFAULT_MODEL)",
        ],
        cwd=work,
        env=env,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(venv), where
    assert Path(where[1]).is_relative_to(venv) and Path(where[1]).is_file(), where

    cli = venv / "bin" / "wsi-pipeline"
    _run([cli, "synth", "slide.tiff", "--width", "1024", "--height", "1024", "--seed", "5"], cwd=work, env=env)
    _run([cli, "run", "slide.tiff", "--out", "results", "--backend", "ort"], cwd=work, env=env)
    summary = json.loads((work / "results" / "slides" / "slide" / "summary.json").read_text())
    assert Path(summary["model"]["card"]).is_relative_to(venv)
    assert summary["model"]["name"] == "nuclei_pathology"
    assert summary["detections_total"] > 0


def test_engines_env_var_wins(tmp_path, monkeypatch):
    from wsi_pipeline.inference.shipped import ENGINES_ENV, engines_candidates, shipped_card

    monkeypatch.setenv(ENGINES_ENV, str(tmp_path))
    assert shipped_card("x") == tmp_path / "x.card.json"
    monkeypatch.delenv(ENGINES_ENV)
    assert engines_candidates()[0] == ROOT / "engines"  # the checkout before the installed copy
    assert shipped_card().is_file()
