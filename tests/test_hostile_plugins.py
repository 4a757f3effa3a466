"""Plugins that misbehave at import or in what they register: each is one line naming the plugin
and what it did, never a traceback, a hang, an exit 0 with nothing run, or a built-in reader
silently replaced. Every plugin is written here, into a folder on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PLUGINS = {
    "exits": "import sys\nsys.exit(0)\n",
    "raises_base": "class Stop(BaseException):\n    pass\n\nraise Stop('from the plugin')\n",
    "hangs_in_slide_process": (
        "import sys, threading\nif sys.argv[0].endswith('slide_worker.py'):\n    threading.Event().wait()\n"
    ),
    "hangs_in_writer_process": (
        "import sys, threading\nif sys.argv[0].endswith('writer_process.py'):\n    threading.Event().wait()\n"
    ),
    "takes_a_name": textwrap.dedent("""
        from wsi_pipeline.slide.readers import SlideReader, register_reader

        class Impostor(SlideReader):
            name, suffixes = "tifffile", (".tiff",)

            @classmethod
            def reads(cls, path, probe):
                return True

        register_reader(Impostor, before=None)
    """),
    "opens_none": textwrap.dedent("""
        from wsi_pipeline.slide.readers import SlideReader, register_reader

        class NoneReader(SlideReader):
            name, suffixes = "none-reader", (".none",)

            @classmethod
            def reads(cls, path, probe):
                return probe.extension == ".none"

            @classmethod
            def open(cls, path):
                return None

        register_reader(NoneReader)
    """),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    for name, code in PLUGINS.items():
        (folder / f"{name}.py").write_text(code)
    return folder


@pytest.fixture()
def slide(small_slide) -> Path:
    return small_slide


def _cli(site: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    # The timeout only keeps a broken build from stalling the suite; nothing is timed.
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(os.fspath, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=site,
    )


def _clean(r: subprocess.CompletedProcess, code: int) -> list[str]:
    assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return r.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "plugin,reason",
    [
        ("exits", "plugin 'exits': importing it called sys.exit(0)"),
        ("raises_base", "plugin 'raises_base': importing it failed: Stop: from the plugin"),
        ("takes_a_name", "the name 'tifffile' is taken by wsi_pipeline.slide.readers.TiledTiffReader"),
    ],
)
def test_a_plugin_that_exits_raises_or_takes_a_built_in_name_is_a_usage_error(site, slide, tmp_path, plugin, reason):
    for args in (("info", slide), ("run", slide, "--out", tmp_path / "out", "--backend", "ort")):
        (line,) = _clean(_cli(site, *args, "--plugin", plugin), 2)
        assert line.startswith("error: ") and reason in line, line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_plugin_reader_whose_open_gives_no_slide_is_one_line(site, tmp_path):
    path = tmp_path / "frame.none"
    path.write_bytes(b"pixels")
    (line,) = _clean(_cli(site, "info", path, "--plugin", "opens_none"), 1)
    assert line == (
        f"error: {path}: slide reader 'none-reader' (opens_none.NoneReader) opened it as NoneType, expected a Slide"
    )


@pytest.mark.parametrize("where", ["slide", "writer"])
def test_a_plugin_that_hangs_in_a_helper_process_is_bounded_by_the_slide_time_limit(site, slide, tmp_path, where):
    out = tmp_path / "out"
    args = ("run", slide, "--out", out, "--backend", "ort", "--tissue", "all", "--slide-timeout", "3")
    lines = _clean(_cli(site, *args, "--plugin", f"hangs_in_{where}_process", "--progress", "none"), 1)
    # The slide process's own imports end it before any slide; a writer's outlast the slide's limit,
    # which fails the slide (its process, and the writers with it, stopped).
    said = (
        "not imported within 3 s (the slide time limit) in slide_worker.py"
        if where == "slide"
        else ("s.tiff: did not finish within 3 s (slide_timeout); stopped")
    )
    assert any(said in ln for ln in lines), lines


def test_a_malformed_entry_point_is_one_line(site, slide, tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    dist = folder / "broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[wsi_pipeline.readers]\nthing = mod x:::\n")
    (line,) = _clean(_cli(folder, "info", slide), 2)
    assert line == (
        "error: entry point 'thing' of group wsi_pipeline.readers: expected a module such as "
        "my_package.my_module, found 'mod x:::'"
    )
