"""The CPU product path against the model alone on the same tiles (ONNX Runtime).

    python benchmarks/bench_cpu_pipeline.py [--size 8192] [--rounds 3] [--json out.json]
    python benchmarks/bench_cpu_pipeline.py --storage svs --mpp 0.5     # Aperio-style SVS, 20x model
    python benchmarks/bench_cpu_pipeline.py --smoke                     # seconds: the tool still runs

On a synthetic pathology slide (seed 7; with ``--storage KIND`` its pixels stored as that kind of
:mod:`wsi_pipeline.synthetic.storage`, e.g. an Aperio-style SVS) and the shipped pathology model
(at its own resolution, or ``--mpp``: tiles read from level 0 and resampled):

- ``Pipeline.run(slide)`` with the default CPU settings (ONNX Runtime, 2
  sessions of 1 thread on a 2-core machine, batch 8), no outputs written:
  tiles read per second of the whole run (open, tissue mask, reading,
  decoding, inference, stitching);
- the model alone on the same tiles, read into memory beforehand: the same
  2 sessions x 1 thread, each running its share of batches of 8 (only
  ``session.run``), tiles per second.

The two are timed in interleaved rounds (pipeline, model, pipeline, ...) and
the medians compared, so a busy neighbour on the machine weighs on both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from harness import SMOKE_ROUNDS, SMOKE_SLIDE_PX, add_common_args, machine, synthetic_slide, work_folder, write_json

from wsi_pipeline import Pipeline
from wsi_pipeline.slide import open_slide
from wsi_pipeline.synthetic.storage import STORAGE_KINDS, write_storage
from wsi_pipeline.tiling.grid import TileGrid, read_tile
from wsi_pipeline.tiling.tissue import tissue_mask


def model_alone(pipe: Pipeline, tiles: np.ndarray, batch: int) -> float:
    """tiles/s of the pipeline's own ONNX Runtime sessions, one thread each, over ``tiles``."""
    workers = pipe.executor._workers
    starts = list(range(0, len(tiles), batch))
    shares = [starts[i :: len(workers)] for i in range(len(workers))]

    def run(worker, share):
        for s in share:
            worker.backend.infer(tiles[s : s + batch])

    threads = [threading.Thread(target=run, args=(w, sh)) for w, sh in zip(workers, shares, strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(tiles) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storage", default="synth", choices=["synth", *STORAGE_KINDS])
    ap.add_argument("--mpp", type=float, help="the grid's resolution (default: the model card's)")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.size, args.rounds = SMOKE_SLIDE_PX, SMOKE_ROUNDS
    path = synthetic_slide(work_folder("bench_cpu_") / "s.tiff", args.size)
    if args.storage != "synth":
        with open_slide(path) as src:
            ext = "svs" if args.storage.startswith("svs") else "tiff"
            path = Path(write_storage(src, path.with_name(f"{args.storage}.{ext}"), args.storage)["path"])
    with Pipeline.from_card(backend="ort", **({"mpp": args.mpp} if args.mpp else {})) as pipe:
        with open_slide(path) as slide:
            grid = TileGrid(slide, geometry=pipe._geometry(slide))
            sel = grid.select(tissue_mask(slide, "otsu").tile_fractions(grid), pipe.config.min_tissue)
            tiles = np.stack([read_tile(slide, t) for t in sel])
        pipe.run(path)  # warm-up
        model_alone(pipe, tiles[: 4 * pipe.batch_size], pipe.batch_size)
        runs, alone = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            res = pipe.run(path)
            runs.append(res.summary["tiles"]["read"] / (time.perf_counter() - t0))
            alone.append(model_alone(pipe, tiles, pipe.batch_size))
            print(f"round: pipeline {runs[-1]:.1f} tiles/s, model alone {alone[-1]:.1f} tiles/s", flush=True)
        out = {
            **machine(),
            "smoke": args.smoke,
            "slide_px": args.size,
            "storage": args.storage,
            "mpp": args.mpp,
            "slide_reader": res.summary.get("slide_reader"),
            "tiles": int(len(tiles)),
            "batch_size": pipe.batch_size,
            "sessions": len(pipe.executor._workers),
            "pipeline_tiles_per_s": runs,
            "model_alone_tiles_per_s": alone,
            "ratio_of_medians": round(statistics.median(runs) / statistics.median(alone), 3),
        }
    print(f"Pipeline.run / model alone (medians): {out['ratio_of_medians']}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
