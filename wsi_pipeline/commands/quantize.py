"""``wsi-pipeline quantize`` (FP16 / INT8 model variants) and ``wsi-pipeline calibration-sample``."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="make an FP16 or INT8 (Q/DQ) variant of an ONNX model, with its card",
        description="Write MODEL.fp16.onnx or MODEL.int8.onnx beside MODEL (or --out) and its card. "
        "INT8 uses explicit Q/DQ nodes calibrated on tiles (a folder of JPEG/PNG files or a .npz).",
    )
    p.add_argument("model", metavar="MODEL", help="ONNX model or its card (NAME.card.json)")
    p.add_argument(
        "--precision",
        choices=["fp16", "int8"],
        required=True,
        help="fp16: the convolution trunk in float16; int8: Q/DQ nodes calibrated on --calibration "
        "tiles (both for TensorRT; on the CPU fp32 is fastest)",
    )
    p.add_argument(
        "--calibration",
        metavar="DIR",
        default=None,
        help="calibration tiles for int8 (folder of images or .npz), e.g. calibration_data/pathology",
    )
    p.add_argument(
        "--method",
        choices=["minmax", "entropy", "percentile"],
        default="minmax",
        help="int8 calibration method (default minmax)",
    )
    p.add_argument("--limit", type=int, default=None, help="use at most this many calibration tiles")
    p.add_argument("--out", default=None, help="output ONNX path (default NAME.PRECISION.onnx beside MODEL)")
    p.set_defaults(func=run)

    c = subparsers.add_parser(
        "calibration-sample",
        help="sample tissue tiles from slides for INT8 calibration",
        description="Read N tiles at the model's resolution from tissue areas of SLIDES and write them "
        "as JPEG files with a manifest.json (slide, level-0 origin, downsample).",
    )
    c.add_argument(
        "slides", metavar="SLIDE", nargs="+", help="slides to sample from (each gives about N / number of slides tiles)"
    )
    c.add_argument("--out", required=True, help="folder to write the tiles into")
    c.add_argument("--n", type=int, default=300, help="number of tiles (default 300)")
    c.add_argument("--tile-size", type=int, default=512, help="tile side in model pixels (default 512)")
    c.add_argument("--mpp", type=float, default=None, help="model micrometres per pixel (default: read level 0 as is)")
    c.add_argument(
        "--tissue",
        choices=["otsu", "all"],
        default="otsu",
        help="where to sample: tissue by Otsu on the thumbnail, or everywhere (default otsu)",
    )
    c.add_argument("--min-tissue", type=float, default=0.5, help="least tissue fraction of a tile (default 0.5)")
    c.add_argument("--seed", type=int, default=0, help="seed of the tile positions drawn (default 0)")
    c.add_argument("--quality", type=int, default=92, help="JPEG quality of the written tiles (default 92)")
    c.set_defaults(func=run_sample)


def run(args: argparse.Namespace) -> int:
    from ..extras import require

    require("wsi-pipeline quantize", "onnx")  # reads and rewrites the ONNX graph
    from ..models.quantize import make_variant

    card = make_variant(args.model, args.precision, args.calibration, args.out, method=args.method, limit=args.limit)
    print(f"wrote {card.model_path} ({card.precision}, sha256 {card.sha256[:12]}...) and {card.card_path}")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from ..models.calibration import sample_calibration_tiles

    rows = sample_calibration_tiles(
        args.slides,
        args.out,
        n=args.n,
        tile_px=args.tile_size,
        mpp=args.mpp,
        tissue=args.tissue,
        min_tissue=args.min_tissue,
        seed=args.seed,
        quality=args.quality,
    )
    print(f"wrote {len(rows)} tiles from {len(args.slides)} slide(s) into {args.out}")
    return 0
