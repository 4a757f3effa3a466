"""QC latency on the CPU: one camera frame per ``Pipeline.run`` call, per frame size and setting.

For each frame size (synthetic industrial frames, the shipped ``defects_industrial``
model, ONNX Runtime) and each setting of sessions (``streams``: the CPU
workers, each an ONNX Runtime session with cores / streams intra-op threads)
and ``batch_size`` (a frame's tiles in one batch, or half of them in each
session's), the
median and worst of ``--runs`` calls after one warm-up call.

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
    ("default: 2 sessions, batch 8", None, None),
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
        for name, streams, batch in settings:
            per_batch = {0: tiles, -1: -(-tiles // 2)}.get(batch, batch)
            overrides = {} if streams is None else {"streams": streams, "batch_size": per_batch}
            with Pipeline.from_card("defects_industrial", backend=args.backend, **overrides) as pipe:
                pipe.run(frame)  # warm-up
                times = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    pipe.run(frame)
                    times.append(time.perf_counter() - t0)
                name = name if args.backend == "ort" else f"{pipe.backend_name}, batch {pipe.batch_size}"
            print(f"| {size} x {size} | {tiles} | {name} | {statistics.median(times):.3f} | {max(times):.3f} |")
            record["rows"].append(
                {
                    "frame_px": size,
                    "tiles": tiles,
                    "setting": name,
                    "median_s": statistics.median(times),
                    "worst_s": max(times),
                }
            )
    write_json(args.json, record)


if __name__ == "__main__":
    main()
