"""The maintained benchmark tools still run: each one's ``--smoke`` mode (a tiny slide, one round).

Their figures are not checked (a smoke run's mean nothing), only that the tool runs to its end and
writes the JSON record it promises. Every tool in benchmarks/ is here; the one-off probes in
benchmarks/probes/ are not. A tool that cannot run here ends with one line saying what it needs
(the harness's ``require``: an optional package's extra; ``require_cuda``: a CUDA GPU, for
bench_gpu and bench_product_gpu) and exit code 2; its case is then skipped with that line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
EXIT_CANNOT_RUN = 2  # benchmarks/harness.py's
# The line a tool that cannot run here ends with: an optional package missing, or no CUDA GPU.
CANNOT_RUN = re.compile(
    r"^\S+ needs (the (?P<extra>\w+) extra: pip install 'wsi-pipeline\[(?P=extra)\]' "
    r"\((?P<module>[\w-]+) is not installed\)|a CUDA GPU)$"
)

# tool, extra arguments, keys its JSON record must hold
SMOKE = [
    ("bench_reader.py", [], {"median_patches_per_s", "stored_tiles_per_patch", "date", "cpus"}),
    ("bench_cpu_pipeline.py", [], {"pipeline_tiles_per_s", "model_alone_tiles_per_s", "ratio_of_medians"}),
    (
        "bench_storage_kinds.py",
        ["--backend", "ort", "--corpus", "aperio-reduced-flagged,aperio-classic@ycbcr-jfif+tables"],
        {"rows", "model_alone_tiles_per_s_mpp_card"},
    ),
    ("bench_batch.py", ["--backend", "ort"], {"rows", "slides"}),
    ("bench_memory.py", [], {"rows"}),
    ("bench_heatmap_pyramid.py", [], {"close_s"}),
    ("bench_latency.py", [], {"rows", "backend"}),
    ("bench_stitch_quality.py", [], {"pathology", "industrial"}),
    ("bench_stitch.py", [], {"global_nms", "blending"}),
    ("bench_stitcher.py", [], {"rounds", "tiles"}),
    ("bench_writers.py", [], {"seconds", "detections"}),
    ("bench_model.py", [], {"rows", "threads"}),
    ("bench_outputs.py", [], {"results"}),
    ("bench_object_size.py", [], {"rows", "kind"}),
    ("bench_plan.py", [], {"plan_seconds", "tiles"}),
    ("bench_remote.py", [], {"rows", "size_px"}),
    ("bench_merge_replay.py", [], {"replay_seconds", "boxes_added"}),
    ("bench_zarr_dicom.py", [], {"results"}),
    ("bench_qc_latency.py", [], {"rows", "backend"}),
    ("bench_first_write.py", [], {"runs"}),  # imports torch at its top, as the scripts it stands for do
    ("bench_gpu.py", [], {"a_model_alone", "b_executor_host", "c_end_to_end", "gpu", "date"}),
    ("bench_product_gpu.py", [], {"model_alone_tiles_per_s", "product_gpu_decode", "batch_cli", "ratios", "gpu"}),
]


def skip_reason(run: subprocess.CompletedProcess) -> str | None:
    """The line a tool that cannot run here ended with, or None where it ran (or failed otherwise)."""
    lines = run.stderr.strip().splitlines()
    if run.returncode != EXIT_CANNOT_RUN or not lines:
        return None
    match = CANNOT_RUN.match(lines[-1])
    if match is None:
        return None
    module = match.group("module")
    # A package the line calls missing is missing here too (the tool does not skip on a guess).
    assert module is None or importlib.util.find_spec(module.replace("-", "_")) is None, lines[-1]
    return lines[-1]


def run_smoke(tool: str, extra: list[str], out: Path, tmp_path: Path, env: dict | None = None):
    env = {**os.environ, **(env or {}), "TMPDIR": str(tmp_path)}  # the tools' slides go with the test's folder
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / tool), "--smoke", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("tool, extra, keys", SMOKE, ids=[s[0] for s in SMOKE])
def test_a_maintained_benchmark_runs_in_its_smoke_mode(tool, extra, keys, tmp_path):
    out = tmp_path / "out.json"
    run = run_smoke(tool, extra, out, tmp_path)
    reason = skip_reason(run)
    if reason:
        pytest.skip(reason)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert keys <= set(record), sorted(keys - set(record))
    rows = record.get("rows", [])
    assert all("error" not in row for row in (rows.values() if isinstance(rows, dict) else rows)), rows
    assert all("error" not in r for r in record.get("results", {}).values()), record["results"]
    corpus = extra[extra.index("--corpus") + 1].split(",") if "--corpus" in extra else []
    assert all(any(row.get("kind") == f"corpus:{name}" for row in rows) for name in corpus), (corpus, rows)


def test_every_maintained_tool_has_a_smoke_run_here():
    """A new tool in benchmarks/ is added to SMOKE (or is a probe, in benchmarks/probes/)."""
    tools = {p.name for p in BENCHMARKS.glob("bench_*.py")}
    assert tools == {tool for tool, _, _ in SMOKE}


@pytest.mark.parametrize(
    "tool, hidden, extra",
    [("bench_zarr_dicom.py", "zarr", "zarr"), ("bench_outputs.py", "pyarrow", "parquet")],
)
def test_a_tool_without_an_optional_package_ends_with_one_line_naming_its_extra(tool, hidden, extra, tmp_path):
    """As in a core install: the package (the first the tool asks for) is hidden from the tool's process
    (None in sys.modules, which import and importlib.util.find_spec both read as not installed)."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{hidden!r}] = None\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    run = run_smoke(tool, [], tmp_path / "out.json", tmp_path, env={"PYTHONPATH": path})
    assert run.returncode == EXIT_CANNOT_RUN, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"{tool} needs the {extra} extra: pip install 'wsi-pipeline[{extra}]' ({hidden} is not installed)"
    )
