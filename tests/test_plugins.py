"""Extensions declared once by an importable module reach every process a run starts.

A toy decoder, output format and slide reader (tests/helpers/toy_extensions.py) live in a folder on
``PYTHONPATH`` beside a plugin module that registers them when imported. Runs start in a fresh
interpreter, as a user's would: the CLI with ``--plugin`` or with an installed package's entry
points, ``run_batch`` with the ``plugins`` setting, and ``run_batch`` after the script registered
them by calls of its own. Each slide runs in the batch's slide process and the counts file is
written by a writer process; the plugin module records each process that imports it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import smooth_rgb

REPO = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"
PLUGIN = "toy_plugin_ext"
PLUGIN_SOURCE = """\
import os
import re
import sys

import toy_extensions

toy_extensions.register_all()
with open(os.environ["TOY_PLUGIN_LOG"], "a") as f:
    f.write(os.path.basename(sys.argv[0]) + "\\n")
"""

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder on PYTHONPATH holding the plugin, card naming the toy decoder, folder of slides)."""
    from helpers.toy_extensions import write_rawrgb
    from helpers.toy_models import build_toy_model

    from wsi_pipeline.inference.card import write_card
    from wsi_pipeline.inference.card_spec import DecoderSpec

    root = tmp_path_factory.mktemp("plugins")
    plugin_dir = root / "site"
    plugin_dir.mkdir()
    shutil.copy(HELPERS / "toy_extensions.py", plugin_dir / "toy_extensions.py")
    (plugin_dir / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    toy = build_toy_model(root, "boxes_scores_labels")
    # The card names the plugin's decoder: this process has none such, and only writes the card.
    card = write_card(
        dataclasses.replace(toy, decoder=DecoderSpec("top_one", {}), heatmap=None), root / "top_one.card.json"
    )
    slides = root / "slides"
    slides.mkdir()
    write_rawrgb(slides / "white.rawrgb", np.full((64, 96, 3), 255, np.uint8))
    write_rawrgb(slides / "smooth.rawrgb", np.maximum(smooth_rgb(80, 72, seed=1), 40))
    (slides / "notes.txt").write_text("not a slide")
    return plugin_dir, card, slides


def _run(args: list[str], plugin_dir: Path, log: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), str(REPO)])
    env["TOY_PLUGIN_LOG"] = str(log)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=plugin_dir
    )


def _check_outputs(out: Path) -> None:
    """Both slides were listed by the plugin's reader, read with it, decoded with its decoder (one box
    per tile) and written in its format."""
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["slides"]) == ["smooth", "white"]
    for name in ("smooth", "white"):
        folder = out / "slides" / name
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["dimensions_level0"] == {"white": [96, 64], "smooth": [72, 80]}[name]
        assert summary["detections_total"] == summary["tiles"]["read"]  # the toy decoder keeps one per tile
        assert summary["files"] == ["detections.geojson", "detections.counts.json", "summary.json"]
        counts = json.loads((folder / "detections.counts.json").read_text())
        assert sum(counts.values()) == sum(summary["counts"].values()) > 0


def _processes(log: Path) -> set[str]:
    return set(log.read_text().split()) if log.exists() else set()


CLI_OPTIONS = ["--formats", "counts,geojson", "--tissue", "all", "--overlap", "8", "--backend", "ort"]


def test_the_cli_runs_a_plugins_decoder_format_and_reader_in_its_child_processes(setup, tmp_path):
    plugin_dir, card, slides = setup
    log = tmp_path / "imported.txt"
    out = tmp_path / "out"
    args = ["-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--model", str(card), *CLI_OPTIONS]
    done = _run([*args, "--plugin", PLUGIN, "--progress", "none"], plugin_dir, log)
    assert done.returncode == 0, done.stderr
    _check_outputs(out)
    # The command's process, the slide process and the writer processes each imported the plugin.
    assert {"__main__.py", "slide_worker.py", "writer_process.py"} <= _processes(log)


def test_without_the_plugin_the_cli_says_what_is_missing(setup, tmp_path):
    plugin_dir, card, slides = setup
    log = tmp_path / "imported.txt"
    args = ["-m", "wsi_pipeline", "run", str(slides), "--out", str(tmp_path / "out"), "--model", str(card)]
    done = _run([*args, *CLI_OPTIONS], plugin_dir, log)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("error: options: formats: unknown format 'counts' (known: geojson, ")
    done = _run([*args, "--plugin", "no_such_plugin"], plugin_dir, log)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "plugin 'no_such_plugin': cannot import it: No module named 'no_such_plugin'" in done.stderr
    assert _processes(log) == set()


def test_an_installed_packages_entry_points_declare_it(setup, tmp_path):
    plugin_dir, card, slides = setup
    site = tmp_path / "site"
    shutil.copytree(plugin_dir, site)
    dist = site / f"{PLUGIN}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "".join(f"[wsi_pipeline.{group}]\ntoy = {PLUGIN}\n\n" for group in ("decoders", "formats", "readers"))
    )
    log = tmp_path / "imported.txt"
    out = tmp_path / "out"
    args = ["-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--model", str(card), *CLI_OPTIONS]
    done = _run([*args, "--progress", "none"], site, log)
    assert done.returncode == 0, done.stderr
    _check_outputs(out)
    assert {"__main__.py", "slide_worker.py", "writer_process.py"} <= _processes(log)


RUN_BATCH = """\
import json, sys
from wsi_pipeline.batch import PipelineFactory, expand_inputs, run_batch, run_key
from wsi_pipeline.config import RunConfig
from wsi_pipeline.errors import PluginError
from wsi_pipeline.inference.card import load_card

slides, out, card_path, how = sys.argv[1:]
plugins = []
if how == "setting":
    plugins = ["toy_plugin_ext"]
elif how == "call":
    import toy_extensions

    toy_extensions.register_all()
elif how == "main":
    import toy_extensions
    from wsi_pipeline.slide.readers import register_reader

    class MainReader(toy_extensions.RawRgbReader):
        name = "main-reader"

    toy_extensions.register_all()
    register_reader(MainReader, before=toy_extensions.RawRgbReader)
config = RunConfig(
    model=card_path, plugins=plugins, formats="counts,geojson", tissue="all", overlap=8, backend="ort"
)
card = load_card(card_path, verify_model=False)
try:
    report = run_batch(expand_inputs([slides]), out, PipelineFactory(config, card), config, run_key(config, card),
                       progress=False)
except PluginError as exc:
    print(exc)
    sys.exit(3)
print(json.dumps({o.name: [o.status, o.error] for o in report.outcomes}))
sys.exit(report.exit_code)
"""


@pytest.mark.parametrize("how", ["setting", "call"])
def test_run_batch_runs_extensions_of_a_plugin_or_registered_by_a_call(setup, tmp_path, how):
    plugin_dir, card, slides = setup
    script = tmp_path / "run_batch_script.py"
    script.write_text(RUN_BATCH)
    log = tmp_path / "imported.txt"
    out = tmp_path / "out"
    done = _run([str(script), str(slides), str(out), str(card), how], plugin_dir, log)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"smooth": ["done", None], "white": ["done", None]}
    _check_outputs(out)
    expected = {"run_batch_script.py", "slide_worker.py", "writer_process.py"} if how == "setting" else set()
    assert _processes(log) == expected  # registered by a call: the entries were handed over, no plugin imported


def test_an_extension_of_the_main_script_is_refused_before_any_slide_runs(setup, tmp_path):
    plugin_dir, card, slides = setup
    script = tmp_path / "run_batch_script.py"
    script.write_text(RUN_BATCH)
    out = tmp_path / "out"
    done = _run([str(script), str(slides), str(out), str(card), "main"], plugin_dir, tmp_path / "imported.txt")
    assert done.returncode == 3, done.stdout + done.stderr
    message = done.stdout.strip()
    assert message.startswith("wsi_pipeline.readers: MainReader (main-reader) was registered by a call")
    assert "declare it in an importable module" in message and "--plugin MODULE" in message
    assert not list((out / "slides").iterdir())


def test_the_architecture_docs_examples_run_as_plugins(setup, tmp_path):
    """docs/ARCHITECTURE.md's three examples ("Extending it"), each written as the module its first
    line names, declared with --plugin: the run lists, reads, decodes and writes with them."""
    plugin_dir, card, slides = setup
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Extending it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", section, re.S)
    assert [path for path, _ in blocks] == ["my_package/top_one.py", "my_package/counts.py", "my_package/rawrgb.py"]
    site = tmp_path / "site"
    (site / "my_package").mkdir(parents=True)
    (site / "my_package" / "__init__.py").write_text("")
    for path, code in blocks:
        (site / path).write_text(code)
    out = tmp_path / "out"
    modules = [p.removesuffix(".py").replace("/", ".") for p, _ in blocks]
    args = ["-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--model", str(card), *CLI_OPTIONS]
    done = _run([*args, *(a for m in modules for a in ("--plugin", m)), "--progress", "none"], site, tmp_path / "log")
    assert done.returncode == 0, done.stderr
    _check_outputs(out)


def test_info_reads_a_slide_with_a_plugins_reader(setup, tmp_path):
    plugin_dir, _, slides = setup
    log = tmp_path / "imported.txt"
    slide = str(slides / "white.rawrgb")
    done = _run(["-m", "wsi_pipeline", "info", slide, "--json"], plugin_dir, log)
    assert done.returncode == 1 and "no reader recognises this file" in done.stderr
    for reader in ("auto", "rawrgb"):
        args = ["-m", "wsi_pipeline", "info", slide, "--plugin", PLUGIN, "--reader", reader, "--json"]
        done = _run(args, plugin_dir, log)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["dimensions"] == [96, 64]
    done = _run(["-m", "wsi_pipeline", "info", slide, "--reader", "rawrgb"], plugin_dir, log)
    assert done.returncode == 2 and "--reader: expected one of auto, " in done.stderr


def test_a_plugin_that_fails_in_the_slide_process_stops_the_run_in_one_line_each(setup, tmp_path):
    plugin_dir, card, slides = setup
    site = tmp_path / "site"
    shutil.copytree(plugin_dir, site)
    (site / "fails_in_children.py").write_text(
        "import sys\nif sys.argv[0].endswith('slide_worker.py'):\n    raise RuntimeError('no GPU licence here')\n"
    )
    out = tmp_path / "out"
    args = ["-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--model", str(card), *CLI_OPTIONS]
    done = _run([*args, "--plugin", PLUGIN, "--plugin", "fails_in_children"], site, tmp_path / "log")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "the run's plugins: plugins: plugin 'fails_in_children': importing it failed: RuntimeError" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: the process that runs slides ended")
