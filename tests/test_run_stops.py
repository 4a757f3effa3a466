"""A signal during a run's set-up (before its first slide starts) is recorded as one during a slide
is: run.log says which signal and when, in which step; the folder's lock is free; the manifest is
written, with no slide that had not started marked done."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The step the run is held in, what the script replaces to hold it there, and how run.log names it.
STEPS = {
    "folder": ("clean_leftovers", "preparing the output folder"),
    "plan": ("plan", "planning: which slides are done"),
    "start": ("make_runner", "starting the slide process"),
}
SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path

    # A test run in the background ignores SIGINT, and children inherit that: Ctrl-C's usual meaning.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from wsi_pipeline import cli
    from wsi_pipeline.batch import runner

    replaced, marker, closed = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def hold(*args, **kwargs):
        marker.write_text("held")
        while True:
            time.sleep(0.02)

    class HeldRunner:
        def prepare(self):
            hold()

        def close(self):
            closed.write_text("closed")

    setattr(runner, replaced, (lambda *a: HeldRunner()) if replaced == "make_runner" else hold)
    sys.exit(cli.main(["run", *sys.argv[4:]]))
""")


def _run_held(tmp_path: Path, step: str) -> tuple[subprocess.Popen, Path]:
    slides = tmp_path / "in"
    slides.mkdir()
    for name in ("a.tiff", "b.tiff"):
        (slides / name).write_bytes(b"not read: the run is stopped before" * 10)
    out = tmp_path / "out"
    marker, closed = tmp_path / "held", tmp_path / "closed"
    argv = [str(slides), "--out", str(out), "--progress", "none"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, STEPS[step][0], str(marker), str(closed), *argv],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Waits on the run's progress (the step reached), not on a clock: it ends when the child does.
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    return proc, out


@pytest.mark.parametrize(
    ("step", "signum"),
    [("folder", signal.SIGTERM), ("plan", signal.SIGTERM), ("start", signal.SIGTERM), ("start", signal.SIGINT)],
)
def test_a_signal_during_set_up_is_logged_with_its_moment_and_leaves_the_folder_free(tmp_path, step, signum):
    proc, out = _run_held(tmp_path, step)
    os.killpg(proc.pid, signum)
    assert proc.wait(timeout=120) == (143 if signum == signal.SIGTERM else 130)
    said = [ln for ln in (out / "run.log").read_text().splitlines() if "run stopped by" in ln]
    name = "SIGTERM" if signum == signal.SIGTERM else r"SIGINT \(Ctrl-C\)"
    assert len(said) == 1
    when = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}"
    during = re.escape(f"during set-up ({STEPS[step][1]}), before any slide started: no slide marked")
    assert re.search(rf"WARNING run stopped by {name} at {when}, {during}$", said[0]), said[0]
    # The lock is free: another run could take the folder now.
    fd = os.open(out / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    doc = json.loads((out / "manifest.json").read_text())
    assert all(record["status"] != "done" for record in doc["slides"].values())
    assert not (out / "slides").exists() or not list((out / "slides").iterdir())
    if step == "start":
        assert (tmp_path / "closed").read_text() == "closed"  # the slide runner it started is ended
