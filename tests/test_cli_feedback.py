"""What the command line tells its user: progress and warnings on stderr, advice that applies,
usage errors that leave nothing behind, training that never replaces a model unasked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wsi_pipeline import cli
from wsi_pipeline.batch import BatchReport
from wsi_pipeline.batch.jobs import SlideOutcome
from wsi_pipeline.errors import UsageError
from wsi_pipeline.slide import open_slide
from wsi_pipeline.synthetic import write_synthetic_slide


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture(scope="module")
def coarse_slide(tmp_path_factory):
    """A small slide at 0.5 um/px: coarser than the pathology model's 0.25, so the run warns."""
    path = tmp_path_factory.mktemp("coarse") / "coarse.tiff"
    write_synthetic_slide(path, 1024, 1024, seed=3, kind="pathology", mpp=0.5)
    return path


# -- progress and warnings on stderr ----------------------------------------------------


def test_non_interactive_run_logs_each_slide_and_warning_to_stderr(coarse_slide, tmp_path):
    proc = _cli("run", coarse_slide, "--out", tmp_path / "out", "--backend", "ort")  # stderr is a pipe
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert any(f"{coarse_slide}: started (1 of 1)" in ln for ln in lines), proc.stderr
    done = [ln for ln in lines if f"{coarse_slide}: done in " in ln]
    assert len(done) == 1 and " tiles read, nucleus " in done[0], proc.stderr
    warn = [ln for ln in lines if "WARNING" in ln]
    assert len(warn) == 1 and "coarser than the model's 0.25 um/px" in warn[0], proc.stderr
    assert "warning: " not in warn[0] and "\n" not in warn[0]
    assert "UserWarning" not in proc.stderr and not any(line.startswith("  ") for line in lines), proc.stderr
    assert "nucleus" in proc.stdout  # the results table stays on stdout
    # run.log keeps the same lines
    assert "coarser than the model's" in (tmp_path / "out" / "run.log").read_text()


def test_quiet_and_progress_none(coarse_slide, tmp_path):
    quiet = _cli("run", coarse_slide, "--out", tmp_path / "q", "--backend", "ort", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert "coarser than the model's" in (tmp_path / "q" / "run.log").read_text()
    none = _cli("run", coarse_slide, "--out", tmp_path / "n", "--backend", "ort", "--progress", "none")
    assert none.returncode == 0
    assert "started" not in none.stderr and "coarser than the model's" in none.stderr


def test_progress_mode_choice():
    from wsi_pipeline.commands.run_log import progress_mode

    assert progress_mode("auto", False, stderr_is_terminal=True) == "bar"
    assert progress_mode("auto", False, stderr_is_terminal=False) == "log"
    assert progress_mode("log", False, stderr_is_terminal=True) == "log"
    assert progress_mode("bar", True, stderr_is_terminal=True) == "none"


# -- errors name options the command has ---------------------------------------------------


def test_unavailable_backend_is_a_usage_error_with_advice_for_run(coarse_slide, tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    rc = cli.main(["run", str(coarse_slide), "--out", str(out), "--backend", "torch", "--progress", "none"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "CUDA is not available" in err and "--backend ort" in err
    assert "--device" not in err
    assert not out.exists()  # found once the slides' process started: what the run made is gone


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--overlap", "600"],
            "config (model nuclei_pathology, 512 px tiles): overlap: expected at least 0 and less than the "
            "tile size 512, found 600",
        ),
        (["--tile", "256"], "tile: the model nuclei_pathology takes 512 px tiles, found tile = 256"),
    ],
)
def test_a_usage_error_is_found_before_anything_is_written(coarse_slide, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    rc = cli.main(["run", str(coarse_slide), "--out", str(out), "--progress", "none", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines() == [f"error: {message}"], err
    assert not out.exists()
    # A folder an earlier run wrote keeps what it holds, and gets nothing new.
    out.mkdir()
    (out / "run.log").write_text("earlier\n")
    rc = cli.main(["run", str(coarse_slide), "--out", str(out), "--progress", "none", *flags])
    assert rc == 2
    assert sorted(p.name for p in out.iterdir()) == ["run.log"] and (out / "run.log").read_text() == "earlier\n"


def test_build_engine_without_tensorrt_names_no_option_it_lacks(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails as where TensorRT is missing
    monkeypatch.setitem(sys.modules, "tensorrt_bindings", None)
    rc = cli.main(["build-engine", str(Path(__file__).parent.parent / "engines" / "defects_industrial.onnx")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "TensorRT is not installed" in err and "build-engine needs TensorRT" in err
    # build-engine has no --backend; the only --backend named is qualified by the run command
    assert "use --backend" not in err and "wsi-pipeline run --backend ort" in err


# -- training never replaces a model unasked ----------------------------------------------------


def test_train_defaults_to_trained_models_and_needs_force_to_replace(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from wsi_pipeline.models.train import train

    assert cli.build_parser().parse_args(["train", "--kind", "industrial"]).out == Path("trained_models")
    monkeypatch.chdir(tmp_path)
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "nuclei_pathology.onnx").write_bytes(b"shipped model")
    (engines / "nuclei_pathology.card.json").write_text("{}")
    assert cli.main(["train", "--kind", "pathology", "--out", "engines", "--steps", "1"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (engines / "nuclei_pathology.onnx").read_bytes() == b"shipped model"

    path = train("pathology", steps=1, train_scenes=1, log=lambda msg: None)
    assert path.resolve() == tmp_path / "trained_models" / "nuclei_pathology.onnx"
    assert (tmp_path / "trained_models" / "nuclei_pathology.card.json").is_file()
    with pytest.raises(UsageError, match="already exist"):
        train("pathology", steps=1, train_scenes=1, log=lambda msg: None)
    mtime = path.stat().st_mtime_ns
    train("pathology", steps=1, train_scenes=1, force=True, log=lambda msg: None)
    assert path.stat().st_mtime_ns != mtime


# -- help and the results table -------------------------------------------------------------


def test_results_table_aligns_names_of_any_script():
    import unicodedata

    def columns(text: str) -> int:
        return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)

    names = ["plain", "標本スライド", "cafe\u0301", "Ｆｕｌｌ"]
    report = BatchReport([SlideOutcome(n, n, "done", 1.0, {"nucleus": 3}) for n in names], Path("."))
    rows = report.table().splitlines()[2:]
    starts = {columns(row[: row.index("done")]) for row in rows}
    assert len(starts) == 1, report.table()


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


def test_every_option_has_help_and_no_markup():
    import argparse

    parser = cli.build_parser()
    for name, sub in _subparsers(parser):
        for action in sub._actions:
            if action.help is None and not isinstance(action, argparse._SubParsersAction):
                raise AssertionError(f"wsi-pipeline {name} {action.option_strings or action.dest}: no help")
        text = sub.format_help()
        assert "``" not in text, f"wsi-pipeline {name} --help shows raw markup"
    run_help = dict(_subparsers(parser))["run"].format_help()
    run_help = run_help[run_help.index("options:") :]
    for flag in ("--blend", "--overlay-size", "--streams", "--score-threshold"):
        start = run_help.index(flag + " ")
        assert "default" in run_help[start : run_help.index("\n  --", start + 1)], flag


def test_cluster_usage_error_leaves_no_pending_manifest(coarse_slide, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["run", str(coarse_slide), "--out", str(out), "--dask", "local:0", "--progress", "none"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "dask: expected local:N with N from 1 to" in err
    assert not (out / "manifest.json").exists()


# -- shipped models by name, one name per meaning ----------------------------------------------


def test_shipped_models_are_taken_by_name_and_listed(tmp_path, capsys, monkeypatch):
    from wsi_pipeline.config import load_config
    from wsi_pipeline.inference import load_card

    monkeypatch.chdir(tmp_path)  # no engines/ here: the name alone finds the shipped card
    assert load_card("defects_industrial", verify_model=False).name == "defects_industrial"
    toml = tmp_path / "qc.toml"
    toml.write_text('[run]\nmodel = "defects_industrial"\n')
    assert load_config(toml).model == "defects_industrial"
    with pytest.raises(Exception, match="the name of a shipped model: defects_industrial"):
        load_card("no_such_model", verify_model=False)
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "shipped model by name: defects_industrial" in " ".join(capsys.readouterr().out.split())
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "defects_industrial" in out and "nuclei_pathology  (default)" in out


def test_info_names_the_slide_reader_and_keeps_backend_as_an_old_name(coarse_slide, capsys):
    assert cli.main(["info", str(coarse_slide), "--reader", "tifffile"]) == 0
    assert "(read with tifffile)" in capsys.readouterr().out
    assert cli.main(["info", str(coarse_slide), "--backend", "tifffile"]) == 0
    captured = capsys.readouterr()
    assert "(read with tifffile)" in captured.out and "--backend is deprecated here, use --reader" in captured.err


# -- help and info say what the code does ---------------------------------------------------------


def test_decode_help_and_info_follow_the_gpu_decoder_table(coarse_slide, capsys, monkeypatch):
    from wsi_pipeline.commands import info
    from wsi_pipeline.config import decode_help
    from wsi_pipeline.tiling.gpu_choice import GPU_DECODER_BY_COLOUR, storage_gpu_decoder

    text = decode_help()
    for colour, decoder in GPU_DECODER_BY_COLOUR.items():
        assert f"{colour} by {decoder}" in text
    run_help = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert " ".join(text.split()) in " ".join(run_help.split())
    # info: the decoder the table gives the slide's stored tiles, and whether this machine has CUDA.
    monkeypatch.setattr(info, "cuda_may_be_present", lambda: False)
    assert cli.main(["info", str(coarse_slide), "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu_decode"]
    with open_slide(coarse_slide) as slide:
        decoder, why = storage_gpu_decoder(slide.stored_tile_format(0), slide.backend, 0)
    assert gpu == {"decoder": decoder, "why": why, "cuda": False} and decoder == "nvjpeg"
    assert cli.main(["info", str(coarse_slide)]) == 0
    out = capsys.readouterr().out
    assert f"on CUDA  {why}" in out and "no CUDA GPU on this machine" in out
    monkeypatch.setattr(info, "cuda_may_be_present", lambda: True)
    assert cli.main(["info", str(coarse_slide)]) == 0
    assert "no CUDA GPU" not in capsys.readouterr().out
    # RGB JPEG tiles without nvImageCodec: the extra that brings it.
    rgb = {
        "compression": "JPEG",
        "samples_per_pixel": 3,
        "planar": 1,
        "extra_samples": 0,
        "jpeg_kind": "RGB",
        "jpeg_baseline": True,
    }
    monkeypatch.setattr(info, "_installed", lambda module: False)
    fake = type("Slide", (), {"backend": "tifffile", "stored_tile_format": lambda self, level: rgb})()
    said = info.gpu_decode_info(fake)
    assert said["decoder"] == "nvimgcodec" and "pip install 'wsi-pipeline[gpu]'" in said["why"]
