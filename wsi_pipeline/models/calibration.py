"""Sample representative tiles from slides for INT8 calibration and accuracy checks.

Tiles are read at the model's resolution (``mpp``; or level 0 when the model
or the slide has none), where the slide has tissue (an Otsu mask of the
thumbnail, or everywhere), spread evenly over the slides, and written as JPEG
files with a ``manifest.json`` that records where each came from (slide,
level-0 origin, downsample).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import cv2
import numpy as np

from ..errors import ConfigError
from ..geometry import TilingGeometry

MANIFEST = "manifest.json"


def _candidate_origins(slide, tile_extent_level0: float, tissue: str, min_tissue: float) -> np.ndarray:
    """Level-0 (x0, y0) of non-overlapping tile cells with at least ``min_tissue`` tissue."""
    from ..tiling.tissue import tissue_mask

    w0, h0 = slide.dimensions
    cols, rows = int(w0 // tile_extent_level0), int(h0 // tile_extent_level0)
    if cols < 1 or rows < 1:
        return np.zeros((0, 2), np.int64)
    tm = tissue_mask(slide, method=tissue)
    # Tissue fraction per cell: the mask averaged over each cell's footprint.
    mh = max(1, round(rows * tile_extent_level0 / tm.downsample[1]))
    mw = max(1, round(cols * tile_extent_level0 / tm.downsample[0]))
    cropped = tm.mask[:mh, :mw].astype(np.float32)
    frac = cv2.resize(cropped, (cols, rows), interpolation=cv2.INTER_AREA)
    ys, xs = np.nonzero(frac >= min_tissue)
    return np.stack([xs * tile_extent_level0, ys * tile_extent_level0], axis=1).round().astype(np.int64)


def sample_calibration_tiles(
    slides: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    n: int = 300,
    tile_px: int = 512,
    mpp: float | None = None,
    tissue: str = "otsu",
    min_tissue: float = 0.5,
    seed: int = 0,
    quality: int = 92,
    prefix: str = "",
) -> list[dict]:
    """Write ``n`` tiles of ``tile_px`` square from ``slides`` into ``out_dir``; return the manifest rows.

    ``mpp``: the model's micrometres per pixel (tiles are resampled to it
    where the slide knows its own and is not coarser, as a run reads them:
    :func:`~wsi_pipeline.geometry.read_resolution`); None reads level 0. ``tissue``: "otsu"
    or "all" (industrial images). Each slide contributes about ``n /
    len(slides)`` tiles, chosen at random (``seed``) among cells with at least
    ``min_tissue`` tissue.
    """
    from ..slide import open_slide
    from ..tiling.grid import Tile, read_tile

    if not slides:
        raise ConfigError("calibration-sample: expected at least one slide, found none")
    if n < 1:
        raise ConfigError(f"calibration-sample: --n: expected >= 1, found {n}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shares = [n // len(slides) + (1 if i < n % len(slides) else 0) for i in range(len(slides))]
    rows: list[dict] = []
    for path, share in zip(slides, shares, strict=True):
        if share == 0:
            continue
        with open_slide(path) as slide:
            geometry = TilingGeometry.for_slide(slide, tile_px, 0, preferred_mpp=mpp)
            downsample = geometry.downsample
            extent = geometry.tile_extent_level0
            origins = _candidate_origins(slide, extent, tissue, min_tissue)
            if len(origins) == 0:
                raise ConfigError(
                    f"{path}: no {tile_px} px tile with {min_tissue:.0%} tissue "
                    f"(tissue method {tissue!r}); try --tissue all or --min-tissue lower"
                )
            picks = rng.choice(len(origins), min(share, len(origins)), replace=False)
            level, read_px = geometry.level, geometry.read_size
            stem = Path(path).stem.split(".")[0]
            for i in sorted(picks.tolist()):
                x0, y0 = (int(v) for v in origins[i])
                # As a run reads a tile: resized from its level, a band at a time where it is large.
                region = read_tile(slide, Tile(0, 0, 0, x0, y0, tile_px, downsample, level, read_px))
                name = f"{prefix}{stem}_{x0}_{y0}.jpg"
                ok = cv2.imwrite(str(out / name), region[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
                if not ok:
                    raise ConfigError(f"{out / name}: cannot write the tile")
                rows.append(
                    {
                        "file": name,
                        "slide": os.path.basename(os.fspath(path)),
                        "x0_level0": x0,
                        "y0_level0": y0,
                        "downsample": downsample,
                        "tile_px": tile_px,
                    }
                )
    manifest_path = out / MANIFEST
    previous = json.loads(manifest_path.read_text())["tiles"] if manifest_path.is_file() else []
    keep = [r for r in previous if r["file"] not in {row["file"] for row in rows} and (out / r["file"]).is_file()]
    manifest_path.write_text(json.dumps({"tiles": keep + rows}, indent=1) + "\n")
    return rows
