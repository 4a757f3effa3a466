"""The maintained benchmark tools still run: each one's ``--smoke`` mode (a tiny slide, one round).

Their figures are not checked (a smoke run's mean nothing), only that the tool runs to its end and
writes the JSON record it promises. Every tool in benchmarks/ but the GPU machine's (bench_gpu,
bench_product_gpu) is here; the one-off probes in benchmarks/probes/ are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# tool, extra arguments, keys its JSON record must hold
SMOKE = [
    ("bench_reader.py", [], {"median_patches_per_s", "stored_tiles_per_patch", "date", "cpus"}),
    ("bench_cpu_pipeline.py", [], {"pipeline_tiles_per_s", "model_alone_tiles_per_s", "ratio_of_medians"}),
    ("bench_storage_kinds.py", ["--backend", "ort"], {"rows", "model_alone_tiles_per_s_mpp_card"}),
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
    ("bench_merge_replay.py", [], {"replay_seconds", "boxes_added"}),
    ("bench_zarr_dicom.py", [], {"results"}),
    ("bench_qc_latency.py", [], {"rows", "backend"}),
    ("bench_first_write.py", [], {"runs"}),  # imports torch at its top, as the scripts it stands for do
]
NEEDS_TORCH = {"bench_first_write.py"}


@pytest.mark.parametrize("tool, extra, keys", SMOKE, ids=[s[0] for s in SMOKE])
def test_a_maintained_benchmark_runs_in_its_smoke_mode(tool, extra, keys, tmp_path):
    if tool in NEEDS_TORCH:
        pytest.importorskip("torch")
    out = tmp_path / "out.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the tools' slides go with the test's folder
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / tool), "--smoke", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert keys <= set(record), sorted(keys - set(record))
    rows = record.get("rows", [])
    assert all("error" not in row for row in (rows.values() if isinstance(rows, dict) else rows)), rows
    assert all("error" not in r for r in record.get("results", {}).values()), record["results"]


def test_every_maintained_tool_but_the_gpu_machines_has_a_smoke_run_here():
    """A new tool in benchmarks/ is added to SMOKE (or is a probe, in benchmarks/probes/)."""
    tools = {p.name for p in BENCHMARKS.glob("bench_*.py")} - {"bench_gpu.py", "bench_product_gpu.py"}
    assert tools == {tool for tool, _, _ in SMOKE}
