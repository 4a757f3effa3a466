"""Every command in a plain install (no optional extra): what needs an extra says which in one
line, exit code 2, without a traceback; the rest runs."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wsi_pipeline import extras
from wsi_pipeline.errors import MissingExtraError
from wsi_pipeline.extras import MODULE_EXTRAS, PACKAGE_NAMES, missing_extra, require
from wsi_pipeline.inference.shipped import shipped_card

ROOT = Path(__file__).resolve().parents[1]
# What a plain install lacks: every optional package, and what comes with them.
ABSENT = sorted({*MODULE_EXTRAS, "geopandas", "duckdb", "tensorrt", "monai", "onnxscript"})
# Runs the command line with the packages of ABSENT unimportable, as in a plain install.
PLAIN = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Absent())
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in {ABSENT!r} else _find(name, *a)
from wsi_pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _plain_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", PLAIN, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _setup_extras() -> dict[str, set[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {}
    for name, text in cfg["options.extras_require"].items():
        extras[name] = {re.split(r"[<>=\[ ]", ln.strip())[0].lower() for ln in text.splitlines() if ln.strip()}
    return extras


def test_each_optional_module_is_named_with_an_extra_that_installs_it():
    extras = _setup_extras()
    for module, extra in MODULE_EXTRAS.items():
        package = PACKAGE_NAMES.get(module, module).replace("_", "-")
        if module == "distributed":
            package = "dask"  # dask[distributed]
        assert package in extras[extra], (module, extra)


def test_a_missing_module_is_one_line_naming_the_extra(monkeypatch):
    gone = ModuleNotFoundError("No module named 'onnx.helper'", name="onnx.helper")
    err = missing_extra("wsi-pipeline quantize", gone)
    assert str(err) == "wsi-pipeline quantize needs onnx, which is not installed: pip install 'wsi-pipeline[quantize]'"
    assert missing_extra("x", ModuleNotFoundError("No module named 'nothing'", name="nothing")) is None
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name: None if name == "ome_zarr" else object())
    require("writing OME-Zarr", "zarr")
    with pytest.raises(MissingExtraError, match=r"writing OME-Zarr needs ome-zarr, .*wsi-pipeline\[zarr\]'$"):
        require("writing OME-Zarr", "zarr", "ome_zarr")


@pytest.mark.parametrize(
    "args, extra",
    [
        (["quantize", "{card}", "--precision", "fp16"], "quantize"),
        (["quantize", "{card}", "--precision", "int8", "--calibration", "{tmp}"], "quantize"),
        (["train", "--kind", "industrial", "--out", "{tmp}/models"], "train"),
        (["run", "{tmp}/nothing.tiff", "--out", "{tmp}/out", "--formats", "parquet"], "parquet"),
        (["run", "{tmp}/nothing.tiff", "--out", "{tmp}/out", "--formats", "ome-zarr"], "zarr"),
    ],
)
def test_a_command_needing_an_extra_says_which_in_one_line(args, extra, tmp_path):
    card = shipped_card("defects_industrial")
    proc = _plain_cli(*(a.format(card=card, tmp=tmp_path) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pip install 'wsi-pipeline[{extra}]'" in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "models").exists()


def test_the_other_commands_run_in_a_plain_install(tmp_path):
    slide = tmp_path / "s.tiff"
    proc = _plain_cli("synth", slide, "--width", "768", "--height", "768")
    assert proc.returncode == 0, proc.stderr
    sample = ["calibration-sample", slide, "--out", tmp_path / "calib", "--n", "4", "--tile-size", "64"]
    for args in (["info"], ["info", slide], ["card", "check", shipped_card()], ["--help"], sample):
        proc = _plain_cli(*args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
    proc = _plain_cli("run", slide, "--out", tmp_path / "out", "--backend", "ort", "--progress", "none")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "slides" / "s" / "detections.geojson").is_file()


def test_result_to_dataframe_without_pandas_names_the_extra(monkeypatch):
    import numpy as np

    from wsi_pipeline.io.detections import DETECTION_DTYPE
    from wsi_pipeline.result import Result

    monkeypatch.setitem(sys.modules, "pandas", None)  # import fails as where pandas is missing
    result = Result("s.tiff", np.zeros(0, DETECTION_DTYPE), None, 1.0, {}, ["nucleus"])
    with pytest.raises(MissingExtraError, match=r"^Result.to_dataframe needs pandas, .*'wsi-pipeline\[notebooks\]'$"):
        result.to_dataframe()
