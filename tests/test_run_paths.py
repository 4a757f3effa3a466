"""A run folder can be reviewed from anywhere: absolute slide paths, and a demo that says where its run is."""

from __future__ import annotations

import configparser
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from wsi_pipeline import demo

load_run = pytest.importorskip(
    "wsi_pipeline.review", reason="the review module needs the notebooks extra", exc_type=ImportError
).load_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``make demo`` with a small slide, its --out given relative to the working directory."""
    cwd = tmp_path_factory.mktemp("demo_cwd")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            assert demo.main(["--out", "demo_out", "--size", "1024"]) == 0
    finally:
        os.chdir(before)
    return cwd, text.getvalue()


def test_demo_names_an_absolute_run_dir_that_loads_from_elsewhere(demo_run, tmp_path, monkeypatch):
    cwd, text = demo_run
    match = re.search(r'RUN_DIR = "([^"]+)"', text)
    assert match, text
    run_dir = Path(match.group(1))
    assert run_dir.is_absolute() and (run_dir / "summary.json").is_file()
    monkeypatch.chdir(tmp_path)  # as the notebook does from notebooks/
    run = load_run(run_dir)
    assert run.slide_path == cwd / "demo_out" / "demo_slide.tiff" and run.slide_path.is_file()
    run.close()


def test_summary_and_manifest_store_absolute_and_given_paths(demo_run):
    cwd, _ = demo_run
    slide = cwd / "demo_out" / "demo_slide.tiff"
    results = cwd / "demo_out" / "results"
    summary = json.loads((results / "slides" / "demo_slide" / "summary.json").read_text())
    assert summary["slide"] == str(slide)
    assert summary["slide_as_given"] == os.path.join("demo_out", "demo_slide.tiff")
    record = json.loads((results / "manifest.json").read_text())["slides"]["demo_slide"]
    assert record["path"] == str(slide)
    assert record["path_as_given"] == os.path.join("demo_out", "demo_slide.tiff")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_notebook_work_folder_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "notebooks/work/quickstart.tif"], cwd=ROOT)
    assert proc.returncode == 0


def test_notebooks_extra_can_open_a_notebook_and_dev_can_run_them():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")

    def names(extra: str) -> set[str]:
        lines = cfg["options.extras_require"][extra].split("\n")
        return {re.split(r"[<>=!\[ ]", ln.strip())[0].lower() for ln in lines if ln.strip()}

    assert {"jupyterlab", "nbconvert"} <= names("notebooks")
    # The notebook tests (nbclient) run with the dev extra alone.
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib", "pandas"} <= names("dev")
