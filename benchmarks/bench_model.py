"""Throughput of the shipped detectors with ONNX Runtime on CPU, per precision.

    python benchmarks/bench_model.py                      # every engines/*.card.json
    python benchmarks/bench_model.py engines/nuclei_pathology.card.json --threads 2 --seconds 10
    python benchmarks/bench_model.py --smoke [--json out.json]   # seconds: one card, batch 1, 0.2 s

Feeds real calibration tiles (calibration_data/) in batches and reports
tiles/s for model inference alone (ORT session run) and for inference plus
decoding. Goal: at least 30 tiles/s for the FP32 model on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness import ROOT, add_common_args, machine, write_json

from wsi_pipeline.inference import create_backend, decode, load_card
from wsi_pipeline.models.quantize import load_calibration_tiles


def calibration_folder(card) -> Path:
    kind = "industrial" if card.mpp is None else "pathology"
    return ROOT / "calibration_data" / kind


def bench(card_path: Path, threads: int, batch: int, seconds: float) -> tuple[float, float]:
    card = load_card(card_path)
    backend = create_backend(card, "ort", max_batch=batch, intra_op_threads=threads)
    tiles = load_calibration_tiles(calibration_folder(card), card.input.size_hw, limit=max(batch, 32))
    batches = [tiles[i : i + batch] for i in range(0, len(tiles) - batch + 1, batch)]
    backend.infer(batches[0])  # warm-up: allocations, kernel selection
    rates = []
    for with_decode in (False, True):
        n, t0, i = 0, time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            out = backend.infer(batches[i % len(batches)])
            if with_decode:
                decode(out, card)
            n += batch
            i += 1
        rates.append(n / (time.perf_counter() - t0))
    return rates[0], rates[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cards", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=5.0)
    add_common_args(parser)
    args = parser.parse_args()
    cards = args.cards or sorted((ROOT / "engines").glob("*.card.json"))
    if args.smoke:
        cards, args.batch, args.seconds = cards[:1], [1], 0.2
    rows = []
    print(f"{'model':40s} {'precision':9s} {'batch':>5s} {'infer tiles/s':>14s} {'+decode tiles/s':>16s}")
    for path in cards:
        card = load_card(path)
        for b in args.batch:
            infer_rate, full_rate = bench(path, args.threads, b, args.seconds)
            print(
                f"{card.model_path.name:40s} {card.precision:9s} {b:5d} {infer_rate:14.1f} {full_rate:16.1f}",
                flush=True,
            )
            rows.append(
                {"model": card.model_path.name, "precision": card.precision, "batch": b}
                | {"infer_tiles_per_s": infer_rate, "infer_and_decode_tiles_per_s": full_rate}
            )
    write_json(args.json, {**machine(), "smoke": args.smoke, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
