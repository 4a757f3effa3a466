"""``wsi-pipeline train``: train the demo detector on synthetic scenes (needs torch)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the demo detector on synthetic scenes and export ONNX + card (needs torch)",
        description="Train the shipped demo detector (pathology nuclei + tumour heatmap, or industrial "
        "defects) from synthetic scenes, seeded, on CPU, and write OUT/NAME.onnx and its card. "
        "Same as python -m wsi_pipeline.models.train.",
    )
    p.add_argument("--kind", choices=["pathology", "industrial"], required=True)
    p.add_argument("--out", type=Path, default=Path("engines"), help="output folder (default engines/)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import BackendUnavailableError

    try:
        from ..models.train import train
    except ImportError as exc:
        raise BackendUnavailableError(f"training needs torch (pip install '.[train]'): {exc}") from exc
    train(args.kind, args.out, steps=args.steps, seed=args.seed, threads=args.threads,
          log=lambda msg: print(msg, flush=True))
    return 0
