"""The batch's own files in its output folder: a link planted there is refused, never written
through; a damaged manifest is set aside with a warning naming it; an --out that is a file is a
usage error. Every hostile folder is made here."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wsi_pipeline.batch.folder import lock_output_folder
from wsi_pipeline.batch.manifest import Manifest
from wsi_pipeline.errors import SpecialFileError, UsageError
from wsi_pipeline.io.atomic import atomic_write, partial_name, write_json

PRECIOUS = b"a file outside the output folder\n"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(os.fspath, args)], capture_output=True, text=True, timeout=600
    )


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


@pytest.fixture()
def precious(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture()
def slide(small_slide) -> Path:
    return small_slide


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, precious, slide):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(precious, out / "run.lock")
    with pytest.raises(UsageError, match=r"run\.lock: a symbolic link, not a regular file"), lock_output_folder(out):
        pass
    r = _cli("run", slide, "--out", out, "--backend", "ort")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = _error_lines(r.stderr)
    assert "run.lock: a symbolic link, not a regular file" in line
    assert precious.read_bytes() == PRECIOUS


def test_a_run_log_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, precious, slide):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(precious, out / "run.log")
    r = _cli("run", slide, "--out", out, "--backend", "ort")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = _error_lines(r.stderr)
    assert "run.log: a symbolic link, not a regular file" in line
    assert precious.read_bytes() == PRECIOUS


def test_a_temporary_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, precious):
    final = tmp_path / "manifest.json"
    os.symlink(precious, partial_name(final))
    with pytest.raises(SpecialFileError, match="a symbolic link"):
        write_json(final, {"slides": {}})
    assert precious.read_bytes() == PRECIOUS
    assert not final.exists()


def test_a_link_put_in_place_after_the_check_is_not_followed_either(tmp_path, precious, monkeypatch):
    from wsi_pipeline import special_files
    from wsi_pipeline.io import atomic

    os.symlink(precious, partial_name(tmp_path / "out.txt"))
    for module in (special_files, atomic):  # the checks before opening miss it: O_NOFOLLOW refuses it
        monkeypatch.setattr(module, "special_kind", lambda path, follow_links=True: None)
    with pytest.raises(SpecialFileError, match="a symbolic link"), atomic_write(tmp_path / "out.txt", "wb") as f:
        f.write(b"through the link")
    assert precious.read_bytes() == PRECIOUS
    assert not (tmp_path / "out.txt").exists()


def test_a_manifest_that_is_a_link_is_set_aside_unread(tmp_path, precious, caplog):
    precious.write_text(json.dumps({"format": 2, "slides": {"x": {"status": "done", "path": "/x"}}}))
    before = precious.read_bytes()
    os.symlink(precious, tmp_path / "manifest.json")
    with caplog.at_level(logging.WARNING, "wsi_pipeline"):
        manifest = Manifest(tmp_path)
    assert manifest.slides == {}
    assert "manifest.json: a symbolic link, not a regular file; set aside as manifest.damaged-" in caplog.text
    manifest.update("s0", status="done")
    assert json.loads((tmp_path / "manifest.json").read_text())["slides"] == {"s0": {"status": "done"}}
    assert precious.read_bytes() == before


@pytest.mark.parametrize(
    "text,reason",
    [
        ('{"slides": ["s0", "s1"]}', 'expected "slides" to be an object of records by name, found list'),
        ('{"slides": {"s0": "done", "s1": {}}}', 'expected the record of slide "s0" to be an object, found str'),
        ('{"slides": {"s0": [1, 2]}}', 'expected the record of slide "s0" to be an object, found list'),
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"slides": {"s0"', "not JSON (JSONDecodeError"),
        ("[" * 100_000 + "]" * 100_000, "not JSON (RecursionError"),
        (b"\xff\xfe{}", "not JSON (UnicodeDecodeError"),
    ],
)
def test_a_damaged_manifest_is_set_aside_with_a_warning_naming_it(tmp_path, caplog, text, reason):
    path = tmp_path / "manifest.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with caplog.at_level(logging.WARNING, "wsi_pipeline"):
        manifest = Manifest(tmp_path)
    assert manifest.slides == {}
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(f"{path}: {reason}") and "set aside as manifest.damaged-" in message, message
    (aside,) = tmp_path.glob("manifest.damaged-*.json")
    assert aside.read_bytes() == path.with_name(aside.name).read_bytes()
    assert not path.exists()
    manifest.update("s2", status="pending")  # no record of the damaged one is written back
    assert json.loads(path.read_text())["slides"] == {"s2": {"status": "pending"}}


def test_a_run_over_a_damaged_manifest_warns_once_and_runs(tmp_path, slide):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"slides": ["s0", "s1"]}')
    r = _cli("run", slide, "--out", out, "--backend", "ort", "--tissue", "all")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "manifest.json" in ln]
    assert len(warned) == 1 and "set aside as manifest.damaged-" in warned[0], r.stderr
    assert set(json.loads((out / "manifest.json").read_text())["slides"]) == {"s"}


def test_an_output_folder_that_is_a_file_is_a_usage_error(tmp_path, slide):
    out = tmp_path / "out.txt"
    out.write_bytes(PRECIOUS)
    with pytest.raises(UsageError, match=r"out\.txt: the output folder is a file, not a folder"):
        with lock_output_folder(out):
            pass
    r = _cli("run", slide, "--out", out, "--backend", "ort")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert _error_lines(r.stderr) == [f"error: {out}: the output folder is a file, not a folder"]
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert out.read_bytes() == PRECIOUS
