"""``wsi-pipeline train``: train the demo detector on synthetic scenes (needs torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models import DEFAULT_TRAIN_OUT


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train the demo detector on synthetic scenes and export ONNX + card (needs torch)",
        description="Train the shipped demo detector (pathology nuclei + tumour heatmap, or industrial "
        "defects) from synthetic scenes, seeded, on CPU, and write OUT/NAME.onnx and its card "
        "(NAME: nuclei_pathology or defects_industrial). An existing model or card in OUT is replaced "
        "only with --force; the shipped models in engines/ are left alone unless OUT is engines/. "
        "Same as python -m wsi_pipeline.models.train.",
    )
    p.add_argument(
        "--kind",
        choices=["pathology", "industrial"],
        required=True,
        help="pathology: nuclei boxes + tissue/tumour heatmap; industrial: spot/scratch boxes",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_TRAIN_OUT, help="output folder (default %(default)s/)")
    p.add_argument("--force", action="store_true", help="replace a model and card already in OUT")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the preset's)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the weights' initialisation and of the crops drawn (default %(default)s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..extras import require

    require("wsi-pipeline train", "torch", "torchvision", "onnx")
    from ..models.train import train

    train(
        args.kind,
        args.out,
        steps=args.steps,
        seed=args.seed,
        threads=args.threads,
        force=args.force,
        log=lambda msg: print(msg, flush=True),
    )
    return 0
