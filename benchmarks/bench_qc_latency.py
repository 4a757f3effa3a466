"""QC latency on the CPU: one camera frame per ``Pipeline.run`` call, per frame size and setting.

For each frame size (synthetic industrial frames, the shipped ``defects_industrial``
model, ONNX Runtime) and each setting of sessions (``streams``: the CPU
workers, each an ONNX Runtime session with cores / streams intra-op threads)
and ``batch_size`` (a frame's tiles in one batch, or half of them in each
session's), the
median and worst of ``--runs`` calls after one warm-up call. The settings' pipelines are built
together and called in turn, round after round, so that a machine whose load changes meanwhile
weighs on each setting alike.

    python benchmarks/bench_qc_latency.py [--sizes 512,1024,2048] [--runs 5] [--backend ort]

With ``--backend auto`` on a GPU machine the settings are the GPU's defaults
(one line per size: its batch and streams are sized by the device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from harness import add_common_args, machine, write_json

from wsi_pipeline import Pipeline
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.synthetic import SyntheticScene

# (name, streams, batch_size): None the default; 0 a frame's tiles, -1 half of them (one batch per session).
SETTINGS = [
    ("default", None, None),
    ("2 sessions, batch 8", 2, 8),
    ("2 sessions, batch half a frame", 2, -1),
    ("1 session, batch 8", 1, 8),
    ("1 session, batch a frame", 1, 0),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backend", default="ort")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.runs = "512", 1
    settings = SETTINGS if args.backend == "ort" else SETTINGS[:1]
    record = {**machine(gpu=args.backend != "ort"), "smoke": args.smoke, "backend": args.backend, "rows": []}
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    print("| frame | tiles | setting | median s | worst s |")
    print("|---|---:|---|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        frame = SyntheticScene(size, size, seed=7, kind="industrial").render(0, 0, size, size)
        g = TilingGeometry(size, size, 512, 64)
        tiles = g.n_rows * g.n_cols
        pipes = []
        for _, streams, batch in settings:
            per_batch = {0: tiles, -1: -(-tiles // 2)}.get(batch, batch)
            overrides = {} if streams is None else {"streams": streams, "batch_size": per_batch}
            pipes.append(Pipeline.from_card("defects_industrial", backend=args.backend, **overrides))
        try:
            times: list[list[float]] = [[] for _ in pipes]
            for pipe in pipes:
                pipe.run(frame)  # warm-up
            for _ in range(args.runs):
                for pipe, kept in zip(pipes, times, strict=True):
                    t0 = time.perf_counter()
                    pipe.run(frame)
                    kept.append(time.perf_counter() - t0)
            names = [
                n if args.backend == "ort" else f"{p.backend_name}, batch {p.batch_size}"
                for (n, _, _), p in zip(settings, pipes, strict=True)
            ]
        finally:
            for pipe in pipes:
                pipe.close()
        for name, kept in zip(names, times, strict=True):
            print(f"| {size} x {size} | {tiles} | {name} | {statistics.median(kept):.3f} | {max(kept):.3f} |")
            record["rows"].append(
                {
                    "frame_px": size,
                    "tiles": tiles,
                    "setting": name,
                    "median_s": statistics.median(kept),
                    "worst_s": max(kept),
                }
            )
    write_json(args.json, record)


if __name__ == "__main__":
    main()
