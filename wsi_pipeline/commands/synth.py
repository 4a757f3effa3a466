"""``wsi-pipeline synth``: write a synthetic slide and its truth GeoJSON."""

from __future__ import annotations

import argparse

from ..synthetic import KINDS, write_synthetic_slide


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "synth",
        help="write a synthetic slide (pyramidal TIFF) and its truth GeoJSON",
        description="Write a deterministic synthetic slide: pathology (pyramidal JPEG TIFF "
        "that OpenSlide opens, with an mpp) or industrial (BigTIFF), and its ground truth "
        "as GeoJSON in level-0 pixels (default: OUT with .truth.geojson).",
    )
    p.add_argument("out", metavar="OUT.tiff", help="slide file to write")
    p.add_argument("--width", type=int, required=True, help="level-0 width in pixels")
    p.add_argument("--height", type=int, required=True, help="level-0 height in pixels")
    p.add_argument("--seed", type=int, default=0, help="scene seed (default 0)")
    p.add_argument("--kind", choices=KINDS, default="pathology", help="scene kind (default pathology)")
    p.add_argument(
        "--truth", metavar="PATH", default=None, help="truth GeoJSON to write (default: OUT with .truth.geojson)"
    )
    p.add_argument("--mpp", type=float, default=0.25, help="microns per level-0 pixel, pathology only (default 0.25)")
    p.add_argument("--tile-size", type=int, default=256, help="TIFF tile side in pixels (default 256)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default 90)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    info = write_synthetic_slide(
        args.out,
        args.width,
        args.height,
        args.seed,
        kind=args.kind,
        truth_path=args.truth,
        mpp=args.mpp,
        tile_size=args.tile_size,
        quality=args.quality,
    )
    counts = ", ".join(f"{n} {name}" for name, n in info["object_counts"].items())
    mpp = f", mpp {info['mpp']:g}" if info["mpp"] is not None else ""
    print(
        f"wrote {info['path']} ({info['kind']}, {info['width']}x{info['height']}, "
        f"{len(info['level_dimensions'])} levels{mpp}; {counts}) and {info['truth_path']}"
    )
    return 0
