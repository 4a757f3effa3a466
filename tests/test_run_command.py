"""``wsi-pipeline run``: inputs, outputs per slide, manifest, resume, failures, exit codes, Dask."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import corrupt_stored_tile

from wsi_pipeline.batch import expand_inputs, run_batch, run_key
from wsi_pipeline.batch.folder import output_names
from wsi_pipeline.batch.jobs import process_slide
from wsi_pipeline.batch.resume import RunKey
from wsi_pipeline.config import RunConfig
from wsi_pipeline.errors import ModelError, UsageError
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.outputs import OUTPUT_FILES
from wsi_pipeline.pipeline import DEFAULT_MODEL
from wsi_pipeline.synthetic import write_synthetic_slide


def _cli(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    """Two small pathology slides (one in a sub-folder) and a file that is no slide."""
    d = tmp_path_factory.mktemp("batch_in")
    (d / "sub").mkdir()
    write_synthetic_slide(d / "a.tiff", 1536, 1536, seed=21, kind="pathology")
    write_synthetic_slide(d / "sub" / "b.tiff", 2048, 1024, seed=22, kind="pathology")
    (d / "notes.txt.bak").write_text("x")
    return d


def _mtimes(out: Path, name: str) -> dict[str, int]:
    return {f: (out / "slides" / name / f).stat().st_mtime_ns for f in OUTPUT_FILES}


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["slides"]


# -- inputs -----------------------------------------------------------------------


def test_inputs_from_folders_globs_and_lists(slides, tmp_path):
    found = expand_inputs([slides])
    assert [p.name for p in found] == ["a.tiff", "b.tiff"]  # recursive, by extension; truth files left out
    assert [p.name for p in expand_inputs([str(slides / "**" / "*.tiff")])] == ["a.tiff", "b.tiff"]
    lst = tmp_path / "list.txt"
    lst.write_text(f"# slides\n{slides / 'sub' / 'b.tiff'}\n{slides / 'a.tiff'}\n\n{slides / 'a.tiff'}\n")
    assert [p.name for p in expand_inputs([lst])] == ["b.tiff", "a.tiff"]  # order kept, duplicates dropped
    table = tmp_path / "list.csv"
    table.write_text(f"case,path\n1,{slides / 'a.tiff'}\n2,missing.svs\n")
    got = expand_inputs([table])
    assert [p.name for p in got] == ["a.tiff", "missing.svs"]  # a listed missing file fails as a slide
    assert got[1].parent == tmp_path  # relative to the list
    with pytest.raises(UsageError, match="no such file or folder"):
        expand_inputs([tmp_path / "nope"])
    with pytest.raises(UsageError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.svs")])
    assert expand_inputs([slides], exclude=slides / "sub") == [slides / "a.tiff"]


def test_output_names_disambiguate_equal_stems(tmp_path):
    names = output_names([Path("/x/case1.svs"), Path("/y/case1.svs"), Path("/y/slide.ome.tif")])
    assert names[0] != names[1] and names[0].startswith("case1-") and names[2] == "slide"


# -- one batch, then resume -----------------------------------------------------------


def test_batch_outputs_failures_resume_and_force(slides, tmp_path):
    bad = tmp_path / "in"
    bad.mkdir()
    (bad / "garbage.svs").write_bytes(b"not a slide at all")
    out = tmp_path / "out"
    r = _cli("run", slides, bad, "--out", out)
    assert r.returncode == 1, r.stderr  # one slide failed
    assert "Traceback" not in r.stderr + r.stdout
    for name in ("a", "b"):
        assert sorted(os.listdir(out / "slides" / name)) == sorted(OUTPUT_FILES)
    assert not (out / "slides" / "garbage").exists()  # nothing that looks like a result
    m = _manifest(out)
    assert m["a"]["status"] == m["b"]["status"] == "done"
    assert m["garbage"]["status"] == "failed" and "garbage.svs" in m["garbage"]["error"]
    assert m["a"]["counts"]["nucleus"] > 0
    log = (out / "run.log").read_text()
    assert "garbage.svs" in log and "ERROR" in log
    assert "garbage  failed" in r.stdout and "a        done" in r.stdout

    before = _mtimes(out, "a")
    r = _cli("run", slides, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "done earlier" in r.stdout
    assert _mtimes(out, "a") == before  # not redone

    r = _cli("run", slides, "--out", out, "--min-tissue", "0.2")  # other settings: redone
    assert r.returncode == 0
    assert _mtimes(out, "a") != before
    changed = _mtimes(out, "a")
    r = _cli("run", slides / "a.tiff", "--out", out, "--min-tissue", "0.2", "--force")
    assert r.returncode == 0 and _mtimes(out, "a") != changed
    assert not [p for p in (out / "slides").iterdir() if ".partial" in p.name or ".old" in p.name]


def test_corrupt_tile_fails_only_that_slide(slides, tmp_path):
    broken = tmp_path / "broken.tiff"
    write_synthetic_slide(broken, 2048, 2048, seed=23, kind="pathology")
    corrupt_stored_tile(broken)
    out = tmp_path / "out"
    r = _cli("run", broken, slides / "a.tiff", "--out", out, "--tissue", "all")
    assert r.returncode == 1
    m = _manifest(out)
    assert m["broken"]["status"] == "failed" and "cannot decode stored tile" in m["broken"]["error"]
    assert m["a"]["status"] == "done"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "run.lock", "run.log", "slides"]
    assert [p.name for p in (out / "slides").iterdir()] == ["a"]


def test_resume_after_kill_9(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i in range(4):
        write_synthetic_slide(src / f"s{i}.tiff", 2560, 2560, seed=30 + i, kind="pathology")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wsi_pipeline", "run", str(src), "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Waits on the run's progress (its first slide done), not on a clock.
    while not (out / "slides" / "s0" / "summary.json").exists():
        assert proc.poll() is None, "the run ended before its first slide was written"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = [n for n in ("s0", "s1", "s2", "s3") if (out / "slides" / n).exists()]
    assert "s0" in finished and len(finished) < 4, finished
    for n in finished:  # a slide folder is complete or absent
        assert sorted(os.listdir(out / "slides" / n)) == sorted(OUTPUT_FILES)
    kept = {n: _mtimes(out, n) for n in finished}
    r = _cli("run", src, "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    for n, m in kept.items():
        assert _mtimes(out, n) == m  # finished slides are not redone
    m = _manifest(out)
    assert all(m[f"s{i}"]["status"] == "done" for i in range(4))
    assert not [p for p in (out / "slides").iterdir() if p.name.startswith(".")]


# -- failures inside a slide, without the CLI -------------------------------------------


class _Failing:
    """A pipeline that writes part of its outputs, then fails as ``exc``."""

    def __init__(self, exc):
        self.exc = exc
        self.closed = False

    def run(self, path, out_dir, **kw):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "detections.geojson").write_text("{}")
        raise self.exc

    def close(self):
        self.closed = True


def test_out_of_disk_leaves_nothing_that_looks_complete(tmp_path):
    exc = OSError(errno.ENOSPC, "No space left on device")
    o = process_slide(_Failing(exc), tmp_path / "x.tiff", "x", tmp_path, RunKey({"settings": "0"}))
    assert o.status == "failed" and "out of disk space" in o.error
    assert list((tmp_path / "slides").iterdir()) == []


class _FailingLater:
    """A pipeline whose run returns at once and whose files then fail to be written (a full disk)."""

    def run(self, path, out_dir, wait_written=True, **kw):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "detections.geojson").write_text("{}")

        class Pending:
            summary = {"counts": {}}

            @staticmethod
            def wait_written():
                raise OSError(errno.ENOSPC, "No space left on device")

        return Pending()


def test_a_write_that_fails_after_the_run_returned_fails_the_slide(tmp_path):
    from wsi_pipeline.batch.jobs import start_slide

    started = start_slide(
        _FailingLater(), tmp_path / "x.tiff", "x", tmp_path, RunKey({"settings": "0"}), wait_written=False
    )
    assert started.outcome is None  # stitched; the files are still being written
    o = started.finish()
    assert o.status == "failed" and "out of disk space" in o.error
    assert list((tmp_path / "slides").iterdir()) == []


def test_model_failure_is_recorded_and_the_batch_goes_on(slides, tmp_path):
    config = RunConfig(model=str(DEFAULT_MODEL), slide_timeout=0)  # in this process: the fake is not picklable
    key = run_key(config, load_card(DEFAULT_MODEL))
    fake = _Failing(ModelError("the model produced NaN"))
    report = run_batch(
        [slides / "a.tiff", slides / "sub" / "b.tiff"], tmp_path, lambda: fake, config, key, progress=False
    )
    assert [o.status for o in report.outcomes] == ["failed", "failed"]
    assert "NaN" in report.outcomes[1].error and report.exit_code == 1 and fake.closed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "run.lock", "slides"]
    assert list((tmp_path / "slides").iterdir()) == []


# -- usage errors: exit code 2 ---------------------------------------------------------------


def test_usage_errors_exit_2(slides, tmp_path):
    out = tmp_path / "out"
    for args, message in [
        (("run", tmp_path / "nope.svs", "--out", out), "no such file"),
        (("run", slides, "--out", out, "--overlap", "600"), "overlap"),
        (("run", slides, "--out", out, "--model", tmp_path / "none.card.json"), "none.card.json"),
        (("run", slides, "--out", out, "--backend", "magic"), "invalid choice"),
    ]:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr
    cfg = tmp_path / "run.toml"
    cfg.write_text("overlap = 64\ntile_size = 512\n")
    r = _cli("run", slides, "--out", out, "--config", cfg)
    assert r.returncode == 2 and "run.toml: unknown key 'tile_size'" in r.stderr
    cfg.write_text("[run]\noverlap = 'wide'\n")
    r = _cli("run", slides, "--out", out, "--config", cfg)
    assert r.returncode == 2 and "overlap: expected int, found str 'wide'" in r.stderr


def test_a_model_that_differs_from_its_card_is_a_usage_error(slides, tmp_path):
    """The batch's parent reads the card without opening the model; the slide process checks it."""
    import shutil

    card = json.loads(DEFAULT_MODEL.read_text())
    model = DEFAULT_MODEL.parent / card["model_file"]
    shutil.copy(model, tmp_path / model.name)
    card["outputs"][1]["dtype"] = "float16"
    bad = tmp_path / DEFAULT_MODEL.name
    bad.write_text(json.dumps(card))
    out = tmp_path / "out"
    r = _cli("run", slides / "a.tiff", "--out", out, "--model", bad, "--backend", "ort")
    assert r.returncode == 2, r.stderr
    assert "scores" in r.stderr and "float16" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists() or _manifest(out) == {}


def test_config_file_mirrors_the_flags_and_flags_win(slides, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nmin_tissue = 0.5\noverlap = 32\nmerge = 'ownership'\n")
    out = tmp_path / "out"
    r = _cli("run", slides / "a.tiff", "--out", out, "--config", cfg, "--overlap", "96")
    assert r.returncode == 0, r.stderr
    params = json.loads((out / "slides" / "a" / "summary.json").read_text())["parameters"]
    assert params["min_tissue"] == 0.5 and params["merge"] == "ownership" and params["overlap"] == 96


# -- Dask ------------------------------------------------------------------------------


def test_dask_local_cluster_matches_a_local_run(slides, tmp_path):
    pytest.importorskip("dask.distributed")
    local, dist = tmp_path / "local", tmp_path / "dask"
    assert _cli("run", slides, "--out", local).returncode == 0
    r = _cli("run", slides, "--out", dist, "--dask", "local:2", timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("a", "b"):
        one, other = local / "slides" / name, dist / "slides" / name
        assert (one / "detections.csv").read_bytes() == (other / "detections.csv").read_bytes()
        s_local = json.loads((one / "summary.json").read_text())
        s_dist = json.loads((other / "summary.json").read_text())
        assert s_local["counts"] == s_dist["counts"] and s_local["run_key"] == s_dist["run_key"]
        for cls, scores in s_local["heatmap_scores"].items():
            assert scores == pytest.approx(s_dist["heatmap_scores"][cls])
    m = _manifest(dist)
    assert {m[n]["status"] for n in ("a", "b")} == {"done"}
    assert all(m[n]["worker"] for n in ("a", "b"))  # ran on the cluster's workers
    r = _cli("run", slides, "--out", dist, "--dask", "local:2")  # resume works the same way
    assert r.returncode == 0 and r.stdout.count("done earlier") == 2
