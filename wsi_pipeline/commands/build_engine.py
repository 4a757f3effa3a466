"""``wsi-pipeline build-engine MODEL.onnx``: build (or find cached) the TensorRT plan of a model."""

from __future__ import annotations

import argparse
import sys

from ..errors import BackendUnavailableError
from ..inference.engine_build import DEFAULT_MAX_BATCH, build_engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-engine",
        help="build the TensorRT engine of an ONNX model for this GPU",
        description="Build a TensorRT plan with a dynamic-batch profile (1 / opt / max). Precision "
        "comes from the ONNX file (FP16 or Q/DQ INT8 graphs). Plans are cached under "
        "engines/cache/ by model SHA-256, GPU name and TensorRT version.",
    )
    p.add_argument("model", help="the ONNX model (its card need not be present)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"largest batch the engine runs (default {DEFAULT_MAX_BATCH})",
    )
    p.add_argument(
        "--opt-batch", type=int, default=None, help="batch size the builder tunes for (default: --max-batch)"
    )
    p.add_argument(
        "--workspace-gb",
        type=float,
        default=None,
        help="cap on the builder's scratch memory, GiB (default: TensorRT's)",
    )
    p.add_argument("--out", default=None, help="also write the plan to this path")
    p.add_argument("--force", action="store_true", help="rebuild even when the cache holds the plan")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        path = build_engine(
            args.model,
            max_batch=args.max_batch,
            opt_batch=args.opt_batch,
            workspace_gb=args.workspace_gb,
            out=args.out,
            force=args.force,
            log=lambda msg: print(msg, file=sys.stderr),
        )
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(
            f"{exc}; build-engine needs TensorRT and a CUDA GPU (without them, "
            "'wsi-pipeline run --backend ort' runs the ONNX model as it is)"
        ) from exc
    print(path)
    return 0
