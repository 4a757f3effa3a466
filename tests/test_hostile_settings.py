"""Config files and model cards that would hang or overflow the parser: a FIFO in their place, a
document nested tens of thousands deep. Each is one line naming the file, never a wait or a
traceback. Every hostile file is made here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wsi_pipeline.config import load_config
from wsi_pipeline.errors import ConfigError, ModelError
from wsi_pipeline.inference.card_init import check_card


def _cli(*args):
    # The timeout only keeps a broken build from stalling the suite; nothing is timed.
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(os.fspath, args)], capture_output=True, text=True, timeout=600
    )


def _one_error_line(r: subprocess.CompletedProcess, code: int, *parts: str) -> None:
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(p in lines[0] for p in parts), r.stderr


def test_a_config_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "settings.toml"
    os.mkfifo(fifo)  # no writer: opening it for reading would wait for ever
    with pytest.raises(ConfigError, match=r"settings\.toml: cannot read the config file: a FIFO \(named pipe\)"):
        load_config(fifo)
    slide = tmp_path / "s.png"
    slide.write_bytes(b"")
    _one_error_line(_cli("run", slide, "--out", tmp_path / "out", "--config", fifo), 2, "settings.toml", "FIFO")


def test_a_config_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("tile = " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.toml: not valid TOML: nested too deeply"):
        load_config(path)
    slide = tmp_path / "s.png"
    slide.write_bytes(b"")
    r = _cli("run", slide, "--out", tmp_path / "out", "--config", path)
    _one_error_line(r, 2, "deep.toml", "nested too deeply")


@pytest.mark.parametrize("depth", [100_000, 990])
def test_a_card_nested_too_deeply_is_one_line(tmp_path, depth):
    path = tmp_path / "deep.card.json"
    path.write_text('{"name": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ModelError, match=r"deep\.card\.json: "):
        check_card(path, run=False)
    r = _cli("card", "check", path, "--no-run")
    _one_error_line(r, 1, "deep.card.json")


def test_a_card_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "m.card.json"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=r"m\.card\.json: cannot read the model card: a FIFO \(named pipe\)"):
        check_card(fifo, run=False)
