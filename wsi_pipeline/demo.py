"""``make demo``: write a small synthetic slide, describe it, and run the detector over its tissue tiles."""

from __future__ import annotations

import argparse
import os

from .commands.info import describe
from .inference import create_backend, decode
from .slide import open_slide
from .slide.synthetic import write_synthetic_slide
from .tiling import TileGrid, TileLoader, tissue_mask

MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "engines", "nuclei_pathology.card.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo_out")
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo_slide.tiff")
    info = write_synthetic_slide(path, args.size, args.size, seed=4242, kind="pathology")
    print(f"wrote {path} ({info['object_count']} nuclei in its ground truth {info['truth_path']})")
    d = describe(path)
    print(f"format {d['format']}, backend {d['backend']}, {d['level_count']} levels, mpp {d['mpp']}")
    backend = create_backend(MODEL, "ort")
    with open_slide(path) as slide:
        grid = TileGrid(slide, mpp=backend.card.mpp) if backend.card.mpp else TileGrid(slide)
        tiles = grid.select(tissue_mask(slide).tile_fractions(grid), 0.05)
        print(f"{grid}: {len(tiles)} of {len(grid)} tiles hold tissue")
        n = 0
        for batch in TileLoader(slide, tiles, batch_size=8, workers=2):
            n += sum(len(t) for t in decode(backend.infer(batch.images), backend.card))
    print(f"detector found {n} nuclei in the tissue tiles (before stitching)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
