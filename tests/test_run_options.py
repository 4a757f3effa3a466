"""Every setting a run accepts reaches it: each RunConfig field is a config-file key, each flag of
``wsi-pipeline run`` that is a setting is a RunConfig field, and a value given either way arrives
in the run's RunConfig (a flag the parser accepts and the config drops would pass unseen)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import wsi_pipeline
from wsi_pipeline.cli import build_parser
from wsi_pipeline.commands.run import build_config
from wsi_pipeline.commands.run_options import flag_name, setting_fields
from wsi_pipeline.config import RunConfig, load_config

PACKAGE = Path(wsi_pipeline.__path__[0])

# A value other than the default for each setting: (its text on the command line, its TOML value,
# what the RunConfig holds). A new setting fails the tests below until it has one here.
SAMPLES = {
    "model": ("/models/a.card.json", '"/models/a.card.json"', "/models/a.card.json"),
    "backend": ("torch", '"torch"', "torch"),
    "tile": ("256", "256", 256),
    "overlap": ("32", "32", 32),
    "mpp": ("0.25", "0.25", 0.25),
    "level": ("1", "1", 1),
    "tissue": ("all", '"all"', "all"),
    "mask": ("/masks/m.png", '"/masks/m.png"', "/masks/m.png"),
    "min_tissue": ("0.5", "0.5", 0.5),
    "batch_size": ("3", "3", 3),
    "workers": ("5", "5", 5),
    "decode": ("cpu", '"cpu"', "cpu"),
    "resample": ("reduced", '"reduced"', "reduced"),
    "streams": ("7", "7", 7),
    "score_threshold": ("0.6", "0.6", 0.6),
    "nms_iou": ("0.4", "0.4", 0.4),
    "nms_metric": (None, '"ios"', "ios"),
    "merge": ("wbf", '"wbf"', "wbf"),
    "drop_edge_boxes": (None, "false", False),
    "blend": ("hann", '"hann"', "hann"),
    "sigma_scale": (None, "0.25", 0.25),
    "formats": ("csv", '["csv"]', ("csv",)),
    "overlay_size": ("512", "512", 512),
    "on_damaged_tile": ("fail", '"fail"', "fail"),
    "plugins": ("colorsys", '["colorsys"]', ("colorsys",)),
    "dask": ("tcp://scheduler:8786", '"tcp://scheduler:8786"', "tcp://scheduler:8786"),
    "slide_timeout": ("90", "90", 90.0),
    "slide_hash": ("full", '"full"', "full"),
}
# The options of ``wsi-pipeline run`` that are not settings of the run's result or its course.
COMMAND_OPTIONS = {"help", "inputs", "out", "config", "force", "progress", "quiet"}
SETTINGS = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extra"]


def _parse(*argv: str):
    return build_parser().parse_args(["run", "slide.tiff", "--out", "out", *argv])


def test_every_setting_has_a_sample():
    assert set(SAMPLES) == set(SETTINGS)
    for name, (_, _, value) in SAMPLES.items():
        assert value != getattr(RunConfig(), name), name


@pytest.mark.parametrize("name", SETTINGS)
def test_a_setting_given_on_the_command_line_reaches_the_run(name):
    flags = {f.name: flag_name(f, cli) for f, cli in setting_fields()}
    text, _, value = SAMPLES[name]
    if name not in flags:
        assert text is None, f"{name}: a sample for a flag it does not have"
        pytest.skip(f"{name} is a config-file key only")
    config = build_config(_parse(flags[name], text))
    assert getattr(config, name) == value
    others = {n: getattr(config, n) for n in SETTINGS if n != name}
    assert others == {n: getattr(RunConfig(), n) for n in SETTINGS if n != name}


@pytest.mark.parametrize("name", SETTINGS)
def test_a_setting_given_in_the_config_file_reaches_the_run(name, tmp_path):
    _, toml, value = SAMPLES[name]
    path = tmp_path / "run.toml"
    path.write_text(f"[run]\n{name} = {toml}\n")
    assert getattr(load_config(path), name) == value
    assert getattr(build_config(_parse("--config", str(path))), name) == value


def test_every_option_of_the_run_command_is_a_setting_or_the_command_s_own():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    dests = {a.dest for a in run._actions}
    assert dests - COMMAND_OPTIONS == {f.name for f, _ in setting_fields()}
    assert {f.name for f, _ in setting_fields()} <= set(SETTINGS)


def test_a_flag_replaces_the_file_and_an_excluding_flag_clears_its_partner(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('level = 1\noverlap = 32\nplugins = ["colorsys"]\n')
    config = build_config(_parse("--config", str(path), "--mpp", "0.5", "--overlap", "16", "--plugin", "json"))
    assert (config.mpp, config.level, config.overlap, config.plugins) == (0.5, None, 16, ("colorsys", "json"))


def test_the_run_log_config_line_holds_every_setting():
    assert list(RunConfig().as_dict()) == SETTINGS


# The names a module holds a run's RunConfig by.
CONFIG_NAMES = {"config", "cfg", "settings"}


def _owner_name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _settings_read() -> set[str]:
    """The attributes read of a RunConfig (``config.tile``, ``self.settings.tile``) outside config.py."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and _owner_name(node.value) in CONFIG_NAMES:
                names.add(node.attr)
    return names


def test_every_setting_is_read_by_the_package():
    """A field no module reads is accepted and never applied; the plugins are applied as the
    config is checked (``load_plugins`` in RunConfig.validate)."""
    unread = set(SETTINGS) - _settings_read() - {"plugins"}
    assert unread == set()
