"""A file name cannot forge a line of run.log, stderr or the results table: control characters in
every name shown are escaped."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from wsi_pipeline.slide_warnings import format_warning
from wsi_pipeline.text_escapes import printable

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def test_control_characters_are_escaped_and_the_rest_kept():
    assert printable("evil\nERROR done.svs") == "evil\\nERROR done.svs"
    assert printable("a\rb\tc\x1b[2Jd\x7fe\u2028f") == "a\\rb\\tc\\x1b[2Jd\\x7fe\\u2028f"
    assert printable("caf\udce9 é 中") == "caf\\udce9 é 中"
    assert format_warning("x\ny.tiff: no mpp", UserWarning, "f.py", 1) == "warning: x\\ny.tiff: no mpp\n"


def test_a_file_name_with_a_newline_forges_no_log_line(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    evil = folder / "evil\nERROR done\x1b[2J.tiff"
    evil.write_bytes(b"not a slide at all" * 10)
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", os.fspath(folder), "--out", os.fspath(out), "--progress", "log"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr
    log_lines = (out / "run.log").read_text().splitlines()
    assert log_lines and all(STAMP.match(ln) for ln in log_lines), log_lines
    assert all(STAMP.match(ln) for ln in r.stderr.splitlines()), r.stderr
    assert any("evil\\nERROR done\\x1b[2J.tiff: failed:" in ln for ln in log_lines), log_lines
    assert "\x1b" not in r.stdout + r.stderr
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR done")], r.stdout


def test_an_error_naming_a_file_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "info", os.fspath(tmp_path / "no\nsuch.svs")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1 and r.stderr == f"error: {tmp_path}/no\\nsuch.svs: no such file\n", r.stderr
