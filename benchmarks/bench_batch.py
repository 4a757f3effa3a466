"""Slides per hour of a batch run: a plain local run against Dask with 1, 2, 4 ... workers.

Writes ``--slides`` synthetic pathology slides of ``--size`` squared (in
parallel), then runs the same batch into fresh output folders:

* ``local``: ``wsi-pipeline run`` in this process;
* ``dask N``: ``--dask local:N`` (one worker per GPU where there are GPUs,
  each seeing only its own; worker processes otherwise).

Slides/hour and the ratio to the 1-worker Dask run are printed; all modes
run in one process, one after the other, on the same slides.

    python benchmarks/bench_batch.py [--slides 4] [--size 16384] [--dask 1,2] [--json out.json]
    python benchmarks/bench_batch.py --smoke      # seconds: two tiny slides, the local run only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from harness import SMOKE_SLIDE_PX, add_common_args, machine, work_folder, write_json

from wsi_pipeline.batch import run_batch, run_key
from wsi_pipeline.batch.folder import slide_dir
from wsi_pipeline.batch.jobs import PipelineFactory
from wsi_pipeline.config import RunConfig
from wsi_pipeline.inference.card import load_card
from wsi_pipeline.pipeline import DEFAULT_MODEL
from wsi_pipeline.synthetic import write_synthetic_slide


def _write(args: tuple[str, int, int]) -> str:
    path, size, seed = args
    write_synthetic_slide(path, size, size, seed=seed, kind="pathology")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slides", type=int, default=4)
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--dask", default="1", help="comma-separated Dask worker counts to measure (0: skip)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-local", action="store_true", help="skip the plain local run")
    ap.add_argument("--dir", help="work folder (default: a temporary one)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.slides, args.size, args.dask = 2, SMOKE_SLIDE_PX, "0"

    work = work_folder("bench_batch_", args.dir)
    src = work / "slides"
    src.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    jobs = [(str(src / f"s{i}.tiff"), args.size, 100 + i) for i in range(args.slides)]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        slides = [Path(p) for p in pool.map(_write, jobs)]
    print(f"wrote {len(slides)} slides of {args.size} x {args.size} in {time.perf_counter() - t:.0f} s")

    config = RunConfig(model=str(DEFAULT_MODEL), backend=args.backend)
    key = run_key(config, load_card(DEFAULT_MODEL))
    modes = [] if args.no_local else [("local", None)]
    modes += [(f"dask {n}", f"local:{n}") for n in (int(v) for v in args.dask.split(",")) if n > 0]
    rows = []
    for label, dask in modes:
        out = work / label.replace(" ", "_")
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        report = run_batch(slides, out, PipelineFactory(config), config, key, progress=False, dask=dask)
        seconds = time.perf_counter() - t
        assert report.exit_code == 0, report.table()
        tiles = sum(
            json.loads((slide_dir(out, o.name) / "summary.json").read_text())["tiles"]["read"] for o in report.outcomes
        )
        backend = json.loads((slide_dir(out, report.outcomes[0].name) / "summary.json").read_text())["backend"]
        # Steady state: the slides' own times, without start-up (cluster, worker imports, model load),
        # leaving out each worker's first slide (it also builds that worker's pipeline).
        per_worker: dict[str, list[float]] = {}
        for o in report.outcomes:
            per_worker.setdefault(o.worker or "local", []).append(o.seconds)
        steady = [t for ts in per_worker.values() for t in (ts[1:] or ts)]
        n_workers = len(per_worker)
        rows.append(
            {
                "mode": label,
                "seconds": round(seconds, 2),
                "slides_per_hour": round(len(slides) / seconds * 3600, 1),
                "steady_slides_per_hour": round(n_workers * 3600 / (sum(steady) / len(steady)), 1),
                "tiles_per_s": round(tiles / seconds, 1),
                "backend": backend,
            }
        )
        print(
            f"{label:<10} {seconds:8.1f} s  {rows[-1]['slides_per_hour']:8.1f} slides/h  "
            f"(steady {rows[-1]['steady_slides_per_hour']:8.1f})  {rows[-1]['tiles_per_s']:8.1f} tiles/s  ({backend})"
        )
    base = next((r for r in rows if r["mode"] == "dask 1"), rows[0])
    for r in rows:
        r["ratio_to_" + base["mode"].replace(" ", "_")] = round(r["slides_per_hour"] / base["slides_per_hour"], 3)
        r["steady_ratio_to_" + base["mode"].replace(" ", "_")] = round(
            r["steady_slides_per_hour"] / base["steady_slides_per_hour"], 3
        )
    print(json.dumps(rows, indent=1))
    write_json(args.json, {**machine(), "smoke": args.smoke, "slides": len(slides), "size": args.size, "rows": rows})


if __name__ == "__main__":
    main()
