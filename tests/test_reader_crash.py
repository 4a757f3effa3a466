"""A reader that crashes the process (OpenSlide's C code on a damaged file) fails only its slide:
the batch goes on and its manifest ends final, also with slides run in the calling process; so does
a crash of OpenSlide's format detection, and ``info`` answers either with one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wsi_pipeline.errors import SlideOpenError
from wsi_pipeline.slide import open_slide
from wsi_pipeline.slide.isolated import call_isolated
from wsi_pipeline.slide.readers import OpenSlideReader, SlideReader
from wsi_pipeline.synthetic import write_synthetic_slide

REPO = Path(__file__).resolve().parent.parent

# Loaded by every interpreter of the run (the CLI and the processes it starts): a reader that,
# like OpenSlide, may crash, asked first for files named crash*, that dies of SIGSEGV opening one.
CRASHING_READER = textwrap.dedent("""
    import os
    import signal

    from wsi_pipeline.slide import readers


    class CrashingReader(readers.OpenSlideReader):
        @classmethod
        def reads(cls, path, probe):
            return os.path.basename(path).startswith("crash")

        @classmethod
        def open(cls, path):
            os.kill(os.getpid(), signal.SIGSEGV)


    readers.register_reader(CrashingReader, before=readers.SLIDE_READERS[0], replace=True)
""")


# OpenSlide's format detection dying of SIGSEGV on files named crash*, in every interpreter of the run.
CRASHING_DETECTION = textwrap.dedent("""
    import os
    import signal

    import openslide

    _detect_format = openslide.OpenSlide.detect_format


    def detect_format(cls, path):
        if os.path.basename(path).startswith("crash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        return _detect_format(path)


    openslide.OpenSlide.detect_format = classmethod(detect_format)
""")


def _hooked(tmp_path: Path, hook: str) -> dict:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(hook)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(hooks), str(REPO)]))


def _slides(tmp_path: Path) -> Path:
    slides = tmp_path / "in"
    slides.mkdir()
    write_synthetic_slide(slides / "b_good.tiff", 400, 400, seed=5, kind="pathology")
    shutil.copy(slides / "b_good.tiff", slides / "crash_a.tiff")
    return slides


def test_a_crash_in_the_helper_process_is_an_error_naming_the_file_and_the_next_call_starts_another():
    pid = call_isolated("a.svs", "reading it", os.getpid)
    assert pid != os.getpid() and call_isolated("a.svs", "reading it", os.getpid) == pid  # kept
    with pytest.raises(SlideOpenError, match=r"a\.svs: OpenSlide crashed reading it \(signal 11, SIGSEGV\)"):
        call_isolated("a.svs", "reading it", signal.raise_signal, signal.SIGSEGV)
    assert call_isolated("b.svs", "reading it", os.getpid) not in (pid, os.getpid())
    with pytest.raises(SlideOpenError, match="no such file"):  # its errors raised here
        call_isolated("b.svs", "reading it", open_slide, "/nonexistent/b.svs")


def test_openslide_is_the_reader_that_may_crash():
    assert OpenSlideReader.may_crash and not SlideReader.may_crash


@pytest.mark.parametrize("slide_timeout", ["0", "600"])
@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (CRASHING_READER, "the process running the slide died (signal 11)"),
        (CRASHING_DETECTION, "signal 11"),  # OpenSlide's format detection crashes
    ],
    ids=["reader", "format-detection"],
)
def test_a_crash_fails_its_slide_alone_and_the_batch_goes_on(tmp_path, slide_timeout, hook, message):
    env = _hooked(tmp_path, hook)
    slides = _slides(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", str(slides), "--out", str(out), "--backend", "ort",
         "--slide-timeout", slide_timeout],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode > 0, f"the run itself died ({proc.returncode})\n{proc.stderr}"
    manifest = json.loads((out / "manifest.json").read_text())["slides"]
    assert {name: rec["status"] for name, rec in manifest.items()} == {"crash_a": "failed", "b_good": "done"}
    assert message in manifest["crash_a"]["error"], manifest["crash_a"]["error"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("hook", "doing"), [(CRASHING_DETECTION, "detecting its format"), (CRASHING_READER, "reading it")]
)
def test_info_on_a_file_openslide_crashes_on_answers_one_line(tmp_path, hook, doing):
    env = _hooked(tmp_path, hook)
    slides = _slides(tmp_path)
    crash = slides / "crash_a.tiff"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "info", str(crash)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode > 0, f"info itself died ({proc.returncode})\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "crash_a.tiff" in lines[0], proc.stderr
    assert f"OpenSlide crashed {doing} (signal 11, SIGSEGV)" in lines[0], proc.stderr
    good = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "info", "--json", str(slides / "b_good.tiff")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert good.returncode == 0 and json.loads(good.stdout)["dimensions"] == [400, 400], good.stderr
