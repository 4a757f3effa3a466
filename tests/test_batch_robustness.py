"""A batch survives any one slide and any input around it: names, folder, disk, time, Ctrl-C,
configs, model cards, lists, and resume that never keeps a stale result."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import wsi_pipeline.batch.manifest as manifest_file
from wsi_pipeline.batch import expand_inputs, run_batch, run_key
from wsi_pipeline.batch.folder import OutputFolderError, lock_output_folder, output_names
from wsi_pipeline.batch.resume import RunKey
from wsi_pipeline.batch.runner import plan
from wsi_pipeline.config import RunConfig, load_config
from wsi_pipeline.errors import ConfigError, ModelError, UsageError
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.outputs import OUTPUT_FILES
from wsi_pipeline.pipeline import DEFAULT_MODEL
from wsi_pipeline.synthetic import write_synthetic_slide

ENGINES = DEFAULT_MODEL.parent


def _cli(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(os.fsdecode, map(os.fspath, args))],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


# wsi_pipeline.review draws with matplotlib, which a core install lacks.
NOTEBOOKS_EXTRA = "needs matplotlib, of the notebooks extra: pip install 'wsi-pipeline[notebooks]'"


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["slides"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 600 x 600 pathology slide."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.tiff"
    write_synthetic_slide(path, 600, 600, seed=5, kind="pathology")
    return path


# -- a pipeline stand-in that writes complete outputs, hangs, crashes or is interrupted -----------


class _Result:
    def __init__(self, counts, warnings=()):
        self.summary = {"counts": counts, "warnings": list(warnings)}


class _SlowWrittenResult(_Result):
    """A result whose files are written only once the batch folder's ``events.log`` shows the run of
    slide ``after`` (at most 30 s later: a child that never runs it fails the test's order of events,
    within the slides' time limit); the log then says they are."""

    def __init__(self, counts, name: str, log: Path, after: str):
        super().__init__(counts)
        self.name, self.log, self.after = name, log, after

    def wait_written(self):
        _wait_for_event(self.log, f"run {self.after}", 30)
        _event(self.log, f"written {self.name}")


def _event(log: Path, what: str) -> None:
    with open(log, "a") as f:
        f.write(f"{what}\n")


def _wait_for_event(log: Path, what: str, timeout_s: float) -> bool:
    """Poll ``log`` until it holds the line ``what`` (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what in log.read_text().split("\n"):
            return True
        time.sleep(0.01)
    return False


class FakePipeline:
    """Writes every output file (summary with the batch's entries); by slide file name: ``hang*``
    sleeps for good, ``crash*`` kills its process, ``ctrlc*`` raises KeyboardInterrupt, ``full*``
    fails with a full disk, ``slowwrite*`` writes its files (``wait_written=False``) only once the
    slide ``written_after`` has run. Each run is noted in the batch folder's ``events.log``."""

    def __init__(self, written_after: str | None = None):
        self.closed = False
        self.written_after = written_after

    def run(self, path, out_dir, progress=False, keep_heatmap=None, extra_summary=None, wait_written=True):
        name = Path(path).name
        out = Path(out_dir)
        out.mkdir(parents=True)
        log = out.parent.parent / "events.log"
        _event(log, f"run {name}")
        (out / "detections.csv").write_text("partial")
        if name.startswith("hang"):
            time.sleep(3600)
        if name.startswith("crash"):
            os._exit(3)
        if name.startswith("ctrlc"):
            raise KeyboardInterrupt
        if name.startswith("full"):
            raise OSError(errno.ENOSPC, "No space left on device")
        for f in OUTPUT_FILES:
            (out / f).write_text("x")
        (out / "summary.json").write_text(
            json.dumps({"counts": {"nucleus": 1}, "heatmap_scores": {}, **(extra_summary or {})})
        )
        if name.startswith("slowwrite") and not wait_written:
            return _SlowWrittenResult({"nucleus": 1}, name, log, self.written_after)
        return _Result({"nucleus": 1}, [f"{path}: level 0 is 0.499 um/px"] if name.startswith("warn") else [])

    def close(self):
        self.closed = True


class FakeFactory:
    """Picklable: the child process that runs the slides builds its own :class:`FakePipeline`."""

    def __init__(self, written_after: str | None = None):
        self.written_after = written_after

    def __call__(self):
        return FakePipeline(self.written_after)


class BrokenFactory:
    """A pipeline that cannot be built (a backend this machine lacks, say)."""

    def __call__(self):
        raise UsageError("no such backend here")


class _FakePlan:
    def __init__(self, path: Path, log: Path):
        self.path, self.log = Path(path), log

    def close(self) -> None:
        _event(self.log, f"closed plan {self.path.name}")


class PlanningFakePipeline(FakePipeline):
    """:class:`FakePipeline` that also plans: ``plan`` notes the slide and the thread it runs on;
    ``run`` of a plan notes that it was planned and closes it."""

    def plan(self, path):
        log = Path(path).parent.parent / "out" / "events.log"
        _event(log, f"plan {Path(path).name} on {threading.current_thread().name.split('_')[0]}")
        return _FakePlan(path, log)

    def run(self, path, out_dir, **kwargs):
        if isinstance(path, _FakePlan):
            plan, path = path, path.path
            _event(plan.log, f"planned {path.name}")
            try:
                return super().run(path, out_dir, **kwargs)
            finally:
                plan.close()
        return super().run(path, out_dir, **kwargs)


class PlanningFakeFactory(FakeFactory):
    def __call__(self):
        return PlanningFakePipeline(self.written_after)


class DicomLoggingPipeline(FakePipeline):
    """Logs as pydicom does when an encoder fails (the traceback with it), then writes its outputs."""

    def run(self, path, out_dir, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            logging.getLogger("pydicom").exception(exc)
        return super().run(path, out_dir, **kwargs)


class DicomLoggingFactory:
    def __call__(self):
        return DicomLoggingPipeline()


def _slides(folder: Path, *names: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in names:
        (folder / n).write_bytes(n.encode() * 100)
        paths.append(folder / n)
    return paths


def _key(config: RunConfig) -> RunKey:
    return run_key(config, load_card(DEFAULT_MODEL))


# -- time limit, crashes, Ctrl-C ---------------------------------------------------------------------


@pytest.mark.parametrize("first", ["good1", "slowwrite1"])
def test_a_crash_in_the_slide_run_ahead_costs_only_that_slide(tmp_path, first):
    """The child runs the next slide while the previous one's files are written: when that next slide
    kills it, the previous slide is run again and done, the crashing one failed, the rest done, and
    no half-written folder is left (the first slide's files written only once the crashing slide has
    started: the child dies while they are written)."""
    paths = _slides(tmp_path / "in", f"{first}.tiff", "crash.tiff", "good2.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=60)
    report = run_batch(paths, tmp_path / "out", FakeFactory("crash.tiff"), config, _key(config), progress=False)
    good1, crash, good2 = report.outcomes
    assert good1.status == "done" and good2.status == "done", (good1, good2)
    assert crash.status == "failed" and "died (exit code 3)" in crash.error
    assert sorted(p.name for p in (tmp_path / "out" / "slides").iterdir()) == sorted([first, "good2"])


def test_the_child_runs_two_slides_ahead_while_files_are_written(tmp_path):
    """The first slide's files are written only once c has run: the child runs the next two slides
    (b, c) while they are written (the parent asks for the second only once the first is written,
    so d runs after); all end done."""
    paths = _slides(tmp_path / "in", "slowwrite.tiff", "b.tiff", "c.tiff", "d.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=60)
    report = run_batch(paths, tmp_path / "out", FakeFactory("c.tiff"), config, _key(config), progress=False)
    assert [o.status for o in report.outcomes] == ["done"] * 4
    events = (tmp_path / "out" / "events.log").read_text().split("\n")
    assert events.index("run c.tiff") < events.index("written slowwrite.tiff") < events.index("run d.tiff")
    assert events.count("run b.tiff") == events.count("run c.tiff") == 1


def test_the_child_plans_the_slide_after_those_it_runs_ahead(tmp_path):
    """Each slide is opened and its tissue found (Pipeline.plan) on the child's planning thread, the
    slide after the two run ahead while another slide runs; every plan is run, and closed, once."""
    paths = _slides(tmp_path / "in", "slowwrite.tiff", "b.tiff", "c.tiff", "d.tiff", "e.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=60)
    factory = PlanningFakeFactory("c.tiff")
    report = run_batch(paths, tmp_path / "out", factory, config, _key(config), progress=False)
    assert [o.status for o in report.outcomes] == ["done"] * 5
    events = (tmp_path / "out" / "events.log").read_text().split("\n")
    for p in paths:
        assert events.count(f"plan {p.name} on plan-slide") == 1, events
        assert events.count(f"planned {p.name}") == events.count(f"closed plan {p.name}") == 1, events
        assert events.index(f"plan {p.name} on plan-slide") < events.index(f"planned {p.name}")
    # d and e are named (to be run ahead and planned) only once the parent asks for b, after
    # slowwrite's files are written.
    written = events.index("written slowwrite.tiff")
    assert written < events.index("run d.tiff") and written < events.index("plan e.tiff on plan-slide"), events


def test_a_slide_past_its_time_limit_is_failed_and_the_batch_goes_on(tmp_path):
    paths = _slides(tmp_path / "in", "hang[1].tiff", "crash.tiff", "good.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=3)
    # A batch that waited on the hanging slide would never end: its outcome says it was stopped.
    report = run_batch(paths, tmp_path / "out", FakeFactory(), config, _key(config), progress=False)
    hang, crash, good = report.outcomes
    assert hang.status == "failed" and "did not finish within 3 s" in hang.error and "hang[1].tiff" in hang.error
    assert crash.status == "failed" and "died (exit code 3)" in crash.error
    assert good.status == "done"
    m = _manifest(tmp_path / "out")
    assert [m[n]["status"] for n in ("hang[1]", "crash", "good")] == ["failed", "failed", "done"]
    assert os.listdir(tmp_path / "out" / "slides") == ["good"]  # no half-written folder left


@pytest.mark.parametrize("slide_timeout", [0, None])
def test_a_pipeline_that_cannot_be_built_stops_the_batch_with_no_slide_running(tmp_path, slide_timeout):
    paths = _slides(tmp_path / "in", "a.tiff", "b.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=slide_timeout)
    with pytest.raises(UsageError, match="no such backend here"):
        run_batch(paths, tmp_path / "out", BrokenFactory(), config, _key(config), progress=False)
    manifest = tmp_path / "out" / "manifest.json"
    statuses = {rec["status"] for rec in _manifest(tmp_path / "out").values()} if manifest.exists() else set()
    assert "running" not in statuses


def test_the_default_time_limit_grows_with_the_slide_file(tmp_path):
    from wsi_pipeline.batch.slide_runners import slide_time_limit

    small = _slides(tmp_path, "a.tiff")[0]
    big = tmp_path / "big.tiff"
    with open(big, "wb") as f:
        f.truncate(2 << 30)  # sparse
    assert slide_time_limit(RunConfig(), small) == pytest.approx(3600, abs=1)
    assert slide_time_limit(RunConfig(), big) == pytest.approx(3 * 3600)
    assert slide_time_limit(RunConfig(slide_timeout=10), big) == 10
    assert slide_time_limit(RunConfig(slide_timeout=0), big) is None


def test_ctrl_c_during_start_up_is_one_line_not_a_traceback(monkeypatch, capsys):
    from wsi_pipeline import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)  # Ctrl-C while the commands' modules import
    assert cli.main(["run", "x"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_in_process_marks_the_slide_interrupted(tmp_path):
    paths = _slides(tmp_path / "in", "good.tiff", "ctrlc.tiff", "later.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    with pytest.raises(KeyboardInterrupt):
        run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False)
    m = _manifest(tmp_path / "out")
    assert [m[n]["status"] for n in ("good", "ctrlc", "later")] == ["done", "interrupted", "pending"]
    assert os.listdir(tmp_path / "out" / "slides") == ["good"]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_the_child_and_marks_the_slide_interrupted(tmp_path, signum, code):
    """SIGTERM, what a scheduler sends, is Ctrl-C: the manifest says interrupted, no partial folder stays."""
    paths = _slides(tmp_path / "in", "hang.tiff", "later.tiff")
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import signal
        import sys
        # A test run started in the background (a non-interactive shell's `cmd &`) ignores SIGINT, and
        # children inherit that: give this process Ctrl-C's usual meaning whatever it inherited.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path[:0] = {[str(Path(__file__).parent), *sys.path]!r}
        from pathlib import Path
        from test_batch_robustness import FakeFactory, _key
        from wsi_pipeline.batch import run_batch
        from wsi_pipeline.cli import sigterm_as_interrupt
        from wsi_pipeline.errors import Terminated
        from wsi_pipeline.config import RunConfig
        from wsi_pipeline.pipeline import DEFAULT_MODEL
        import logging
        logging.getLogger("wsi_pipeline").addHandler(logging.FileHandler({str(tmp_path / "run.log")!r}))
        config = RunConfig(model=str(DEFAULT_MODEL))
        try:
            with sigterm_as_interrupt():
                run_batch([Path(p) for p in {[str(p) for p in paths]!r}], {str(out)!r}, FakeFactory(), config,
                          _key(config), progress=False)
        except Terminated:
            sys.exit(143)
        except KeyboardInterrupt:
            sys.exit(130)
    """)
    # Its own process group, as a scheduler's job: the signal goes to the child too, as it would.
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    # Waits on the run's progress (the child inside the slide), not on a clock.
    while not list((out / "slides").glob(".hang.partial-*")):
        assert proc.poll() is None, "the run ended before its slide started"
        time.sleep(0.05)
    os.killpg(proc.pid, signum)
    assert proc.wait(timeout=60) == code
    m = _manifest(out)
    assert m["hang"]["status"] == "interrupted" and m["later"]["status"] == "pending"
    assert os.listdir(out / "slides") == []  # the stopped child's folder is removed
    # The log says which signal stopped the run, when, and the slide it stopped.
    name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT (Ctrl-C)"
    said = [ln for ln in (tmp_path / "run.log").read_text().splitlines() if "run stopped by" in ln]
    assert said == [f"run stopped by {name} at {m['hang']['finished']}, while running {paths[0]}: marked interrupted"]
    assert m["hang"]["stopped_by"] == name
    # A rerun says why it redoes the slide; one never started is not "redone".
    from wsi_pipeline.batch.runner import plan

    config = RunConfig(model=str(DEFAULT_MODEL))
    with _captured_log() as lines:
        todo, _ = plan(paths, out, _key(config), False, ["hang", "later"], _manifest(out))
    assert [n for _, n in todo] == ["hang", "later"]
    assert lines == [f"{paths[0]}: redone: interrupted in an earlier run ({name} at {m['hang']['finished']})"]


@contextlib.contextmanager
def _captured_log():
    """The messages of the wsi_pipeline logger meanwhile."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("wsi_pipeline")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_a_rerun_says_why_it_redoes_a_slide_an_earlier_run_left_unfinished(tmp_path):
    from wsi_pipeline.batch.runner import plan

    paths = _slides(tmp_path / "in", "failed.tiff", "killed.tiff", "new.tiff")
    earlier = {
        "failed": {"status": "failed", "finished": "T1", "error": "a corrupt tile"},
        "killed": {"status": "running", "started": "T2"},
        "new": {"status": "pending"},
    }
    config = RunConfig(model=str(DEFAULT_MODEL))
    with _captured_log() as lines:
        todo, done = plan(paths, tmp_path / "out", _key(config), False, ["failed", "killed", "new"], earlier)
    assert len(todo) == 3 and not done
    assert lines == [
        f"{paths[0]}: redone: failed in an earlier run (at T1): a corrupt tile",
        f"{paths[1]}: redone: an earlier run stopped while it ran (started at T2, the run killed or its machine down)",
    ]


# -- the output folder ---------------------------------------------------------------------------------


def test_slide_names_never_meet_each_other_or_the_batch_files(tmp_path, tiny):
    src = tmp_path / "in"
    (src / "d1").mkdir(parents=True)
    (src / "d2").mkdir()
    names = [
        "manifest.json.tiff",
        "run.log.tiff",
        "run.lock.tiff",
        "..tiff",
        "...tiff",
        "Case.tiff",
        "d1/case.tiff",
        "d2/case.tiff",
    ]
    for n in names:
        shutil.copy(tiny, src / n)
    crafted = output_names([src / "d1/case.tiff", src / "d2/case.tiff"])[0]  # a hashed name ...
    shutil.copy(tiny, src / f"{crafted}.tiff")  # ... taken by another slide's file name
    paths = [src / n for n in names] + [src / f"{crafted}.tiff"]
    folder_names = output_names(paths)
    assert len({n.casefold() for n in folder_names}) == len(paths)
    assert not [n for n in folder_names if n.startswith(".") or "/" in n]
    assert folder_names == output_names(paths)  # stable from run to run

    out = tmp_path / "out"
    r = _cli("run", *paths, "--out", out, "--tissue", "all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "run.lock", "run.log", "slides"]
    m = _manifest(out)
    assert len(m) == len(paths) and {rec["status"] for rec in m.values()} == {"done"}
    assert sorted(os.listdir(out / "slides")) == sorted(folder_names)
    sources = {json.loads((out / "slides" / n / "summary.json").read_text())["slide"] for n in folder_names}
    assert len(sources) == len(paths)  # every slide kept its own result


@pytest.mark.parametrize("first,second", [("d1/frame.png", "d2/frame.png"), ("qc_frame.png", "qc_frame.jpg")])
def test_a_later_run_never_replaces_another_slides_results(tmp_path, caplog, first, second):
    """A slide of the same stem in a later run gets a name of its own; the earlier results, and
    their manifest record, are kept, and the log says where each went."""
    out = tmp_path / "out"
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    key = _key(config)
    a = _slides(tmp_path / "in" / Path(first).parent, Path(first).name)
    b = _slides(tmp_path / "in" / Path(second).parent, Path(second).name)
    b[0].write_bytes(b"other" * 50)
    caplog.set_level("INFO", "wsi_pipeline")
    run_batch(a, out, FakePipeline, config, key, progress=False)
    report = run_batch(b, out, FakePipeline, config, key, progress=False)
    stem = Path(first).stem
    (name_b,) = [o.name for o in report.outcomes]
    assert name_b != stem and name_b.startswith(f"{stem}-")
    assert sorted(os.listdir(out / "slides")) == sorted([stem, name_b])
    m = _manifest(out)
    assert m[stem]["path"] == str(a[0]) and m[name_b]["path"] == str(b[0])
    assert {m[stem]["status"], m[name_b]["status"]} == {"done"}
    assert f"slides/{stem} holds the results of {a[0]} from an earlier run, which are kept" in caplog.text
    # Each slide keeps its name on later runs, alone or together: nothing is redone.
    assert [o.status for o in run_batch(a + b, out, FakePipeline, config, key, progress=False).outcomes] == [
        "skipped",
        "skipped",
    ]


def test_slides_with_warnings_are_marked_in_the_manifest_and_the_table(tmp_path):
    paths = _slides(tmp_path / "in", "warned.tiff", "plain.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    report = run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False)
    m = _manifest(tmp_path / "out")
    assert m["warned"]["warnings"] == [f"{paths[0]}: level 0 is 0.499 um/px"] and m["plain"]["warnings"] == []
    table = report.table()
    assert "done (1 warning)" in table and f"warning: warned: {paths[0]}: level 0 is 0.499 um/px" in table
    # A rerun that skips them still marks the slide, from its summary.
    (tmp_path / "out" / "slides" / "warned" / "summary.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "out" / "slides" / "warned" / "summary.json").read_text()), "warnings": ["w"]}
        )
    )
    again = run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False).table()
    assert "done earlier (1 warning)" in again


def test_a_second_run_into_the_same_folder_is_refused(tmp_path, tiny):
    out = tmp_path / "out"
    (out / "slides").mkdir(parents=True)
    in_progress = out / "slides" / ".tiny.partial-1-0"
    in_progress.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from wsi_pipeline.batch.folder import lock_output_folder
        with lock_output_folder({str(out)!r}):
            print("held", flush=True)
            time.sleep(120)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _cli("run", tiny, "--out", out)
        assert r.returncode == 2 and "another run" in r.stderr and str(holder.pid) in r.stderr
        assert "Traceback" not in r.stderr
        assert in_progress.is_dir()  # the first run's work is left alone
        with pytest.raises(UsageError, match="another run"), lock_output_folder(out):
            pass
    finally:
        holder.kill()
        holder.wait()
    with lock_output_folder(out), lock_output_folder(out):  # free again; re-entrant in one thread
        pass


def test_what_stands_where_a_slide_folder_goes_is_replaced_and_not_left(tmp_path, tiny):
    out = tmp_path / "out"
    (out / "slides").mkdir(parents=True)
    (out / "slides" / "tiny").write_text("a file where the slide's folder goes")
    r = _cli("run", tiny, "--out", out, "--tissue", "all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(out / "slides")) == ["tiny"]
    assert sorted(os.listdir(out / "slides" / "tiny")) == sorted(OUTPUT_FILES)
    pytest.importorskip("matplotlib", reason=NOTEBOOKS_EXTRA)
    from wsi_pipeline.review import load_run

    run = load_run(out)  # a batch folder of one slide
    assert run.run_dir == out / "slides" / "tiny" and len(run.detections) == sum(run.summary["counts"].values())


@pytest.mark.skipif(os.geteuid() == 0, reason="permissions do not bind root")
def test_a_read_only_old_result_is_replaced_and_not_left(tmp_path):
    paths = _slides(tmp_path / "in", "a.tiff")
    out = tmp_path / "out"
    old = out / "slides" / "a"
    (old / "sub").mkdir(parents=True)
    (old / "sub" / "f").write_text("old")
    os.chmod(old / "sub", 0o500)
    os.chmod(old, 0o500)
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    report = run_batch(paths, out, FakePipeline, config, _key(config), progress=False)
    assert report.outcomes[0].status == "done"
    assert sorted(os.listdir(out / "slides")) == ["a"] and not (out / "slides" / "a" / "sub").exists()


def test_a_hidden_slide_file_in_a_folder_is_skipped_with_a_word(tmp_path, caplog):
    _slides(tmp_path / "in", "..tiff", ".hidden.svs", "shown.tiff", ".notes.txt")
    caplog.set_level("WARNING", "wsi_pipeline")
    assert [p.name for p in expand_inputs([tmp_path / "in"])] == ["shown.tiff"]
    assert "..tiff: skipped: a hidden file" in caplog.text and ".hidden.svs: skipped" in caplog.text
    assert ".notes.txt" not in caplog.text
    assert expand_inputs([tmp_path / "in" / "..tiff"]) == [tmp_path / "in" / "..tiff"]  # named: run


def test_undecodable_file_names_are_logged_and_recorded(tmp_path, tiny):
    src = tmp_path / "in"
    src.mkdir()
    name = os.fsdecode(b"caf\xe9.tiff")
    shutil.copy(tiny, src / name)
    out = tmp_path / "out"
    r = _cli("run", src, "--out", out, "--tissue", "all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Logging error" not in r.stderr and "Traceback" not in r.stderr
    log = (out / "run.log").read_text(encoding="utf-8")
    assert "caf\\udce9.tiff: done" in log
    assert _manifest(out)[os.fsdecode(b"caf\xe9")]["status"] == "done"
    assert "caf\\udce9  done" in r.stdout


def test_a_full_disk_fails_the_slide_and_the_batch_goes_on(tmp_path):
    paths = _slides(tmp_path / "in", "full.tiff", "good.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    report = run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False)
    full, good = report.outcomes
    assert full.status == "failed" and "out of disk space" in full.error and "full.tiff" in full.error
    assert good.status == "done"
    assert _manifest(tmp_path / "out")["full"]["status"] == "failed"


class OpeningFakePipeline(FakePipeline):
    """:class:`FakePipeline` that opens the slide first, as the pipeline does."""

    def run(self, path, out_dir, **kwargs):
        from wsi_pipeline.slide import open_slide

        open_slide(path).close()
        return super().run(path, out_dir, **kwargs)


@pytest.mark.timeout(120)
def test_a_fifo_among_the_slides_fails_at_once_and_the_batch_goes_on(tmp_path, tiny):
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(tiny, folder / "b_good.tiff")
    os.mkfifo(folder / "a_pipe.tiff")  # no writer: opening it for reading would wait for ever
    slides = expand_inputs([folder])
    assert [p.name for p in slides] == ["a_pipe.tiff", "b_good.tiff"]
    assert expand_inputs([folder / "a_pipe.tiff"]) == [folder / "a_pipe.tiff"]  # named alone: a slide too
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    report = run_batch(slides, tmp_path / "out", OpeningFakePipeline, config, _key(config), progress=False)
    pipe, good = report.outcomes
    assert pipe.status == "failed" and "a_pipe.tiff: a FIFO (named pipe), not a regular file" in pipe.error
    assert good.status == "done"


def test_a_manifest_that_cannot_be_written_stops_the_run_saying_why(tmp_path, monkeypatch):
    paths = _slides(tmp_path / "in", "a.tiff", "b.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    real = manifest_file.write_json
    calls = []

    def write_json(path, obj, **kw):
        calls.append(path)
        if len(calls) > 3:  # pending a, pending b, running a: then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, obj, **kw)

    monkeypatch.setattr(manifest_file, "write_json", write_json)
    with pytest.raises(OutputFolderError, match=r"manifest\.json: cannot record .*No space left.*the run stops"):
        run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False)


# -- resume -------------------------------------------------------------------------------------------


def _copy_card(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    doc = json.loads(DEFAULT_MODEL.read_text())
    shutil.copy(ENGINES / doc["model_file"], folder / doc["model_file"])
    for k, v in changes.items():
        doc[k] = v
    path = folder / DEFAULT_MODEL.name
    path.write_text(json.dumps(doc))
    return path


def test_resume_redoes_a_slide_when_the_card_the_slide_or_the_mask_changed(tmp_path, caplog):
    paths = _slides(tmp_path / "in", "a.tiff", "b.tiff")
    out = tmp_path / "out"
    card_path = _copy_card(tmp_path / "model")
    mask = tmp_path / "mask.geojson"
    mask.write_text(json.dumps({"type": "Polygon", "coordinates": [[[0, 0], [10, 0], [10, 10], [0, 0]]]}))
    config = RunConfig(model=str(card_path), slide_timeout=0, tissue="file", mask=str(mask))

    def rerun() -> list[str]:
        key = run_key(config, load_card(card_path))
        todo, _ = plan(paths, out, key, force=False)
        run_batch(paths, out, FakePipeline, config, key, progress=False)
        return [name for _, name in todo]

    assert rerun() == ["a", "b"]
    assert rerun() == []
    doc = json.loads(card_path.read_text())
    doc["decoder"]["params"]["score_threshold"] = 0.9  # the same ONNX file, another card
    card_path.write_text(json.dumps(doc))
    caplog.set_level("INFO", "wsi_pipeline")
    assert rerun() == ["a", "b"]
    assert "a.tiff: redone: the model card changed" in caplog.text
    paths[1].write_bytes(b"another image" * 100)  # replaced under the same name
    assert rerun() == ["b"]
    assert "the slide file changed (size 600 -> 1300 bytes)" in caplog.text
    paths[1].write_bytes(b"Another image" * 100)  # same size, other content
    assert rerun() == ["b"]
    assert "the slide file changed (same size, different content)" in caplog.text
    mask.write_text(mask.read_text().replace("10", "20"))
    assert rerun() == ["a", "b"]
    assert "the mask file changed" in caplog.text


def test_resume_sees_an_edit_the_sampled_fingerprint_misses_and_a_replaced_file(tmp_path, caplog):
    paths = _slides(tmp_path / "in", "a.tiff")
    big = paths[0]
    data = bytearray(np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(bytes(data))
    out = tmp_path / "out"
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    key = _key(config)

    def todo() -> list[str]:
        run_batch(paths, out, FakePipeline, config, key, progress=False)
        return [name for _, name in plan(paths, out, key, force=False)[0]]

    assert todo() == []
    caplog.set_level("INFO", "wsi_pipeline")
    before = os.stat(big)
    data[(2 << 20) + 100] ^= 0xFF  # between the sampled blocks: the fingerprint stays
    with open(big, "r+b") as f:  # edited in place: the same inode
        f.write(bytes(data))
    os.utime(big, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert plan(paths, out, key, force=False)[0] != []
    assert "the slide file changed (modified since its run" in caplog.text
    assert todo() == []
    big.rename(tmp_path / "old.tiff")  # replaced by a copy of itself: another inode, the same mtime
    shutil.copy2(tmp_path / "old.tiff", big)
    assert plan(paths, out, key, force=False)[0] != []
    assert "replaced by another file" in caplog.text


def test_a_full_slide_hash_sees_an_edit_anywhere_even_with_the_mtime_put_back(tmp_path):
    from wsi_pipeline.batch.resume import why_redo
    from wsi_pipeline.file_identity import input_identity

    big = tmp_path / "big.svs"
    data = bytearray(np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(bytes(data))
    st = os.stat(big)
    sampled, full = input_identity(big), input_identity(big, "full")
    data[(2 << 20) + 100] ^= 0xFF
    with open(big, "r+b") as f:
        f.write(bytes(data))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # as an archive restores it
    key = RunKey({"settings": "s"}, "full")
    summary = {"run_key": key.value, "run_key_parts": key.parts}
    assert input_identity(big) == sampled  # sampled: the edit is missed
    assert why_redo({**summary, "input": full}, key, input_identity(big, "full"), []) == (
        "the slide file changed (same size, different content)"
    )
    assert "fingerprint was taken otherwise" in why_redo({**summary, "input": sampled}, key, full, [])


def test_input_identity_sees_changes_anywhere_in_a_file_or_a_folder_slide(tmp_path):
    from wsi_pipeline.file_identity import input_identity

    big = tmp_path / "big.svs"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(bytes(data))
    first = input_identity(big)
    assert first == input_identity(big) and first["size"] == 4 << 20
    for offset in (10, (4 << 20) - 10):  # the header, the tail
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        big.write_bytes(bytes(changed))
        assert input_identity(big)["fingerprint"] != first["fingerprint"]
    folder = tmp_path / "dicom_slide"
    folder.mkdir()
    (folder / "a.dcm").write_bytes(b"a" * 10)
    before = input_identity(folder)
    (folder / "a.dcm").write_bytes(b"a" * 11)
    assert input_identity(folder) != before
    assert input_identity(tmp_path / "missing.svs") is None


# -- usage errors before any slide runs --------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"mpp": math.nan}, "mpp"),
        ({"mpp": math.inf}, "mpp"),
        ({"sigma_scale": 0.0}, "sigma_scale"),
        ({"sigma_scale": -1.0}, "sigma_scale"),
        ({"batch_size": 100000}, "batch_size: expected between 1 and 1024"),
        ({"streams": 1000}, "streams: expected between 1 and 32"),
        ({"workers": 10**6}, "workers"),
        ({"overlay_size": 10**6}, "overlay_size"),
        ({"slide_timeout": -1.0}, "slide_timeout"),
        ({"slide_timeout": math.nan}, "slide_timeout"),
        ({"model": "a\x00b"}, "model"),
        ({"tile": 30000}, "tile"),
        ({"mpp": 1e300}, "mpp: expected a positive number of micrometres per pixel, 1e-06 to 1e"),
        ({"model": "m" * 100_000}, r"model: expected a path of at most 4096 .*100000 characters\)$"),
        ({"mask": "/" + "n" * 300 + "/mask.png"}, "mask: expected a path"),
        ({"dask": "local:999999"}, "dask: expected local:N with N from 1 to"),
        ({"dask": "local:-1"}, "dask: expected local:N"),
    ],
)
def test_impossible_settings_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


def test_config_files_that_are_not_text_are_usage_errors(tmp_path, tiny):
    out = tmp_path / "out"
    for name, content, message in [
        ("latin1.toml", b"overlap = 64\n# caf\xe9\n", "expected UTF-8 text, found byte 0xe9"),
        ("nul.toml", b"overlap = 64\x00\n", "not valid TOML"),
        ("nan.toml", b"mpp = nan\n", "mpp: expected a positive number"),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path / name)
    r = _cli("run", tiny, "--out", out, "--config", tmp_path / "latin1.toml")
    assert r.returncode == 2 and "latin1.toml" in r.stderr and "Traceback" not in r.stderr
    r = _cli("run", tiny, "--out", out, "--mpp", "inf")
    assert r.returncode == 2 and "mpp" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "cluster.toml").write_text('dask = "local:999999"\n')
    r = _cli("run", tiny, "--out", out, "--config", tmp_path / "cluster.toml")
    assert r.returncode == 2 and "dask: expected local:N" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_an_overlap_too_large_for_the_model_names_the_setting_not_the_card():
    from wsi_pipeline import Pipeline

    with pytest.raises(ConfigError, match=r"^config \(model \S+, 512 px tiles\): overlap: expected .* found 600$"):
        Pipeline.from_card(backend="ort", overlap=600)


def test_config_file_paths_are_relative_to_its_folder(tmp_path):
    folder = tmp_path / "conf"
    card = _copy_card(folder / "models")
    (folder / "mask.png").write_bytes(b"x")
    (folder / "run.toml").write_text(
        '[run]\nmodel = "models/nuclei_pathology.card.json"\ntissue = "file"\nmask = "mask.png"\n'
    )
    config = load_config(folder / "run.toml")
    assert Path(config.model) == card and Path(config.mask) == folder / "mask.png"
    assert load_card(config.model).model_path.parent == card.parent


def test_a_missing_mask_is_one_usage_error(tmp_path, tiny):
    out = tmp_path / "out"
    r = _cli("run", tiny, tiny.parent, "--out", out, "--tissue", "file", "--mask", tmp_path / "missing.geojson")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("missing.geojson: mask file not found") == 1 and "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists()  # no slide was tried
    bad = tmp_path / "bad.geojson"
    bad.write_text('{"type": "FeatureCollection", "features": []}')
    with pytest.raises(UsageError, match="bad.geojson: not a usable mask"):
        run_key(RunConfig(model=str(DEFAULT_MODEL), tissue="file", mask=str(bad)), load_card(DEFAULT_MODEL))


def test_tissue_help_says_what_auto_does():
    r = _cli("run", "--help")
    text = " ".join(r.stdout.split())
    assert "auto: otsu for a model with an mpp (pathology), all for one without (industrial)" in text


def test_lists_that_are_not_text_are_usage_errors(tmp_path):
    lst = tmp_path / "list.txt"
    lst.write_bytes(b"a.tiff\n\xff\xfe.tiff\n")
    with pytest.raises(UsageError, match=r"list.txt: the list of slides is not UTF-8 text \(byte 0xff"):
        expand_inputs([lst])
    lst.write_bytes(b"a.tiff\nb\x00.tiff\n")
    with pytest.raises(UsageError, match="list.txt: line 2: the list of slides holds a NUL byte"):
        expand_inputs([lst])


def test_a_link_that_loops_in_a_folder_fails_that_entry_alone(tmp_path, tiny):
    """A looping link among a folder's entries (whatever its name) fails as a slide of its own,
    saying what it is; the folder's other slides run (exit 1: a slide failed)."""
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(tiny, folder / "ok.tiff")
    os.symlink(folder / "loop2", folder / "loop1.tiff")
    os.symlink(folder / "loop1.tiff", folder / "loop2")
    assert expand_inputs([folder]) == [folder / "loop1.tiff", folder / "loop2", folder / "ok.tiff"]
    out = tmp_path / "out"
    r = _cli("run", folder, "--out", out, "--tissue", "all")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    m = _manifest(out)
    assert m["ok"]["status"] == "done"
    for name, file in (("loop1", "loop1.tiff"), ("loop2", "loop2")):
        assert m[name]["status"] == "failed"
        assert m[name]["error"] == f"{folder / file}: a symbolic link that loops (it never reaches a file)"


def test_a_sub_folder_that_cannot_be_read_fails_as_an_entry_of_its_own(tmp_path, tiny, monkeypatch):
    """A sub-folder without permission is a failed entry naming it (its slides would never run,
    unseen); the other slides run and the batch ends 1."""
    from wsi_pipeline.batch.jobs import PipelineFactory

    src = tmp_path / "in"
    (src / "locked").mkdir(parents=True)
    shutil.copy(tiny, src / "a.tiff")
    shutil.copy(tiny, src / "locked" / "b.tiff")
    os.chmod(src / "locked", 0)
    try:
        if os.access(src / "locked", os.R_OK):  # root reads it all the same: make listing it fail as it would
            real_scandir = os.scandir

            def scandir(path="."):
                if not isinstance(path, int) and os.fspath(path) == str(src / "locked"):
                    raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
                return real_scandir(path)

            monkeypatch.setattr(os, "scandir", scandir)
        assert expand_inputs([src]) == [src / "a.tiff", src / "locked"]
        config = RunConfig(model=str(DEFAULT_MODEL), backend="ort", tissue="all", slide_timeout=0)
        out = tmp_path / "out"
        report = run_batch(expand_inputs([src]), out, PipelineFactory(config), config, _key(config), progress=False)
    finally:
        os.chmod(src / "locked", 0o755)
    assert report.exit_code == 1
    assert [(o.name, o.status) for o in report.outcomes] == [("a", "done"), ("locked", "failed")]
    assert report.outcomes[1].error == f"{src / 'locked'}: folder cannot be read (Permission denied)"
    assert _manifest(out)["locked"]["status"] == "failed"


def test_pydicom_s_logged_traceback_stays_out_of_the_batch_log_under_the_cli(tmp_path, monkeypatch):
    """The command line sets pydicom's logger to CRITICAL (its failures are the slide's one-line
    error); the slide process copies that level, so none of its records reach the parent's log."""
    from wsi_pipeline import cli

    for name in ("pydicom", "tifffile"):  # put back after the test: main sets them for the process
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    assert cli.main(["info"]) == 0  # the shipped models: no slide
    assert logging.getLogger("pydicom").level == logging.CRITICAL
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger().addHandler(handler)
    try:
        paths = _slides(tmp_path / "in", "a.tiff")
        config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=60)
        report = run_batch(paths, tmp_path / "out", DicomLoggingFactory(), config, _key(config), progress=False)
    finally:
        logging.getLogger().removeHandler(handler)
    assert [o.status for o in report.outcomes] == ["done"]
    assert not [r for r in seen if r.name == "pydicom"]


def test_dask_without_dask_installed_is_a_usage_error(monkeypatch):
    from wsi_pipeline.batch.distributed import check_address

    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # import fails as when not installed
    with pytest.raises(UsageError, match="dask.distributed is not installed"):
        check_address("local:2")


def test_dask_address_is_checked_before_any_slide(tmp_path):
    pytest.importorskip("dask.distributed")
    paths = _slides(tmp_path / "in", "a.tiff")
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)
    with pytest.raises(UsageError, match="local:N"):
        run_batch(paths, tmp_path / "out", FakePipeline, config, _key(config), progress=False, dask="local:x")
    assert not (tmp_path / "out").exists()


# -- model cards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        (b'{"name": "caf\xe9"}', "expected UTF-8 text, found byte 0xe9"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"version": ' + b"9" * 5001 + b"}", "not valid JSON"),
        (b'{"mpp": Infinity}', "Infinity is not a number JSON allows"),
        (b'{"mpp": NaN}', "NaN is not a number JSON allows"),
    ],
)
def test_cards_that_are_not_plain_json_are_refused(tmp_path, text, message):
    card = tmp_path / "m.card.json"
    card.write_bytes(text)
    with pytest.raises(ModelError, match=message):
        load_card(card)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_file": "../../../../etc/passwd"}, "model_file.*inside the card's folder"),
        ({"model_file": "/etc/passwd"}, "model_file.*inside the card's folder"),
        ({"mpp": "1e400"}, "field 'mpp': expected a positive number"),  # a literal JSON reads as inf
        ({"mpp": "-1"}, "field 'mpp': expected a positive number"),
    ],
)
def test_cards_with_impossible_fields_are_refused(tmp_path, changes, message):
    mpp = changes.pop("mpp", None)
    card = _copy_card(tmp_path / "model", **changes, **({"mpp": "MPP"} if mpp else {}))
    card.write_text(card.read_text().replace('"MPP"', mpp or '"MPP"'))
    with pytest.raises(ModelError, match=message):
        load_card(card)


def test_an_input_size_beyond_the_bound_is_refused(tmp_path):
    doc = json.loads(DEFAULT_MODEL.read_text())
    doc["input"]["size"] = [30000, 30000]
    card = _copy_card(tmp_path / "model", input=doc["input"])
    with pytest.raises(ModelError, match=r"input.size.*at most 4096|from 1 to 4096"):
        load_card(card)


def test_a_card_cli_error_is_a_usage_error(tmp_path, tiny):
    card = _copy_card(tmp_path / "model", model_file="../../../../etc/passwd")
    r = _cli("run", tiny, "--out", tmp_path / "out", "--model", card)
    assert r.returncode == 2 and "inside the card's folder" in r.stderr and "Traceback" not in r.stderr
    assert "passwd" not in r.stdout


def test_a_label_past_the_card_classes_fails_the_slide():
    import dataclasses

    from wsi_pipeline.inference.decoders import decode

    card = load_card(DEFAULT_MODEL)
    one_class = dataclasses.replace(card, classes=card.classes[:1])
    p = {"boxes": "boxes", "scores": "scores", "labels": "labels", **card.decoder.params}
    outputs = {
        p["boxes"]: np.array([[[0, 0, 10, 10], [5, 5, 20, 20]]], np.float32),
        p["scores"]: np.array([[0.9, 0.8]], np.float32),
        p["labels"]: np.array([[0, 1]], np.int64),
    }
    if card.heatmap is not None:
        hm = card.heatmap
        s = card.input.size_hw[0] // hm.stride
        outputs[hm.output] = np.zeros((1, len(hm.classes), s, s), np.float32)
    with pytest.raises(ModelError, match="gave label 1, but the card names 1 classes"):
        decode(outputs, one_class)
    assert len(decode(outputs, dataclasses.replace(card, classes=card.classes * 2))[0]) == 2


def test_a_log_that_cannot_be_written_is_said_once_without_tracebacks(tmp_path, capsys):
    import logging

    from wsi_pipeline.batch.folder import BatchLogHandler

    handler = BatchLogHandler(tmp_path / "run.log")
    logger = logging.getLogger("wsi_pipeline.test_full_disk")
    logger.addHandler(handler)
    try:
        logger.warning("before: %s", os.fsdecode(b"caf\xe9"))
        handler.flush()

        def full(text):
            raise OSError(errno.ENOSPC, "No space left on device")

        handler.stream.write = full
        logger.warning("lost 1")
        logger.warning("lost 2")
    finally:
        logger.removeHandler(handler)
        vars(handler.stream).pop("write", None)
        handler.close()
    err = capsys.readouterr().err
    assert err.count("cannot write the log") == 1 and "No space left" in err
    assert "Logging error" not in err and "Traceback" not in err
    assert "before: caf\\udce9" in (tmp_path / "run.log").read_text(encoding="utf-8")


def test_load_run_on_a_batch_folder_of_several_slides_names_them(tmp_path):
    pytest.importorskip("matplotlib", reason=NOTEBOOKS_EXTRA)
    from wsi_pipeline.errors import WSIPipelineError
    from wsi_pipeline.review import load_run

    for name in ("a", "b"):
        (tmp_path / "slides" / name).mkdir(parents=True)
    with pytest.raises(WSIPipelineError, match=r"a batch folder of 2 slides.*\(names: a, b\)"):
        load_run(tmp_path)


_HEAP_PROBE = """
import sys
import numpy as np
from wsi_pipeline.batch.slide_worker import map_large_blocks_alone

if sys.argv[1] == "set":
    assert map_large_blocks_alone()
big = np.ones(30 << 20, np.uint8)  # freeing a 30 MB block raises glibc's default threshold to 30 MB
del big
blocks = [np.ones(5 << 20, np.uint8) for _ in range(20)]
del blocks[:-1]  # the last block stays: the heap below it cannot shrink
rss_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(rss_kb)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_slide_process_gives_freed_large_blocks_back_to_the_system():
    def rss_mb(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) / 1024

    kept, given_back = rss_mb("default"), rss_mb("set")
    # 19 freed blocks of 5 MB stay resident by default and go back with the setting.
    assert kept - given_back > 60, (kept, given_back)


def test_the_batch_package_hands_on_its_names_without_importing_the_slide_process():
    """``python -m wsi_pipeline.batch.slide_worker`` must find the worker not yet imported by its package."""
    code = (
        "import sys, wsi_pipeline.batch as b\n"
        "assert 'wsi_pipeline.batch.slide_worker' not in sys.modules\n"
        "from wsi_pipeline.batch import run_batch, run_key\n"
        "from wsi_pipeline.batch.runner import resume_state\n"
        "assert callable(run_key) and run_batch.__module__ == 'wsi_pipeline.batch.runner'\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)
