"""Latency of the Python API on camera-sized images: p50 / p99 with one caller and with four.

Renders ``--images`` synthetic industrial images of ``--size`` squared once,
then times ``Pipeline.run(image)`` per image:

* one caller: the images one after the other;
* four callers: four threads, each running its quarter of the images at once
  (their tiles share batches through the pipeline's tile service).

Latency is the wall time of one ``run`` call as its caller sees it.

    python benchmarks/bench_latency.py [--images 100] [--size 4096] [--backend ort] [--json out.json]
    python benchmarks/bench_latency.py --smoke      # seconds: four small images, two callers
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from harness import ROOT, SMOKE_SLIDE_PX, add_common_args, machine, write_json

from wsi_pipeline import Pipeline
from wsi_pipeline.synthetic import SyntheticScene

MODEL = str(ROOT / "engines" / "defects_industrial.card.json")


def _stats(lat: list[float]) -> dict[str, float]:
    a = np.asarray(lat)
    return {
        "n": len(a),
        "p50_s": round(float(np.percentile(a, 50)), 3),
        "p99_s": round(float(np.percentile(a, 99)), 3),
        "mean_s": round(float(a.mean()), 3),
        "max_s": round(float(a.max()), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--callers", type=int, default=4)
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.images, args.size, args.callers = 4, SMOKE_SLIDE_PX, 2

    distinct = min(args.images, 8)  # rendering is slow; cycle through a few different images
    images = [
        SyntheticScene(args.size, args.size, seed=500 + i, kind="industrial").render(0, 0, args.size, args.size)
        for i in range(distinct)
    ]
    work = [images[i % distinct] for i in range(args.images)]
    with Pipeline.from_card(MODEL, backend=args.backend) as pipe:
        pipe.run(work[0])  # warm-up: sessions, buffers
        one: list[float] = []
        t_one = time.perf_counter()
        for img in work:
            t = time.perf_counter()
            pipe.run(img)
            one.append(time.perf_counter() - t)
        t_one = time.perf_counter() - t_one

        many: list[float] = []
        lock = threading.Lock()
        barrier = threading.Barrier(args.callers)

        def caller(k: int) -> None:
            barrier.wait()
            for img in work[k :: args.callers]:
                t = time.perf_counter()
                pipe.run(img)
                with lock:
                    many.append(time.perf_counter() - t)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(args.callers)]
        t_many = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        t_many = time.perf_counter() - t_many
        info = {
            "backend": pipe.backend_name,
            "batch_size": pipe.batch_size,
            "streams": pipe.executor.streams,
            "mixed_batches": pipe.service.mixed_batches,
            "batches": pipe.service.batches_run,
        }
    rows = {
        "one caller": {**_stats(one), "images_per_s": round(args.images / t_one, 2)},
        f"{args.callers} callers": {**_stats(many), "images_per_s": round(args.images / t_many, 2)},
    }
    print(f"{args.images} images of {args.size} x {args.size}, {info}")
    print(f"{'':<12}{'p50 s':>8}{'p99 s':>8}{'max s':>8}{'images/s':>10}")
    for k, r in rows.items():
        print(f"{k:<12}{r['p50_s']:>8.3f}{r['p99_s']:>8.3f}{r['max_s']:>8.3f}{r['images_per_s']:>10.2f}")
    write_json(
        args.json, {**machine(), "smoke": args.smoke, "images": args.images, "size": args.size, **info, "rows": rows}
    )


if __name__ == "__main__":
    main()
