"""Write synthetic slides to disk: pyramidal JPEG tiled TIFF plus truth GeoJSON.

File layout:

* pathology: a tiled TIFF (BigTIFF once level 0 exceeds 2 GiB raw), one full page per
  pyramid level (not SubIFDs: OpenSlide's generic-tiff reader sees successive pages as
  levels), each level half the previous, down to the first level whose longer side is
  <= 1024 px; RGB JPEG tiles; X/YResolution = 1e4 / (mpp * downsample) per CENTIMETER,
  so OpenSlide reports ``openslide.mpp-x == mpp``; ImageDescription
  ``wsi-pipeline synthetic pathology seed=S mpp=M``.
* industrial: a BigTIFF with the same tiled JPEG pyramid and no resolution unit (no mpp).

Tiles are rendered from the scene straight at each level's downsample and handed to
tifffile as a generator, a few tiles at a time, so memory stays bounded whatever the
slide size. Both outputs go to a temporary name first and are renamed when complete.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import tifffile

from ..errors import ConfigError
from ..io.atomic import partial_name
from .scene import SyntheticScene
from .truth import default_truth_path, write_truth

# Stop the pyramid at the first level whose longer side is at most this.
_SMALLEST_LEVEL_SIDE = 1024
# Level-0 pixels rendered per call (tile rows are rendered this wide at once).
_RENDER_CHUNK_WIDTH = 1024


def level_dimensions(width: int, height: int) -> list[tuple[int, int]]:
    """(width, height) of each pyramid level: level k is ceil(level-0 size / 2**k)."""
    dims = [(width, height)]
    while max(dims[-1]) > _SMALLEST_LEVEL_SIDE:
        k = len(dims)
        dims.append((math.ceil(width / 2**k), math.ceil(height / 2**k)))
    return dims


def _level_tiles(scene: SyntheticScene, level_w: int, level_h: int, downsample: int, tile: int) -> Iterator[np.ndarray]:
    """Tiles (tile, tile, 3) uint8 of one level in row-major order (tifffile's order);
    edge tiles are full size and show the scene beyond the slide edge (TIFF crops them)."""
    n_x = -(-level_w // tile)
    n_y = -(-level_h // tile)
    per_call = max(1, _RENDER_CHUNK_WIDTH // tile)
    span = tile * downsample  # level-0 pixels per tile
    for ty in range(n_y):
        for tx0 in range(0, n_x, per_call):
            n = min(per_call, n_x - tx0)
            strip = scene.render(tx0 * span, ty * span, n * span, span, downsample)
            for i in range(n):
                yield strip[:, i * tile : (i + 1) * tile]


def _check_options(tile_size: int, quality: int) -> None:
    if not isinstance(tile_size, (int, np.integer)) or not 16 <= tile_size <= 4096 or tile_size % 16:
        raise ConfigError(f"tile size must be a multiple of 16 within 16..4096 pixels, got {tile_size!r}")
    if not isinstance(quality, (int, np.integer)) or not 1 <= quality <= 100:
        raise ConfigError(f"JPEG quality must be within 1..100, got {quality!r}")


def write_synthetic_slide(
    path: str | os.PathLike[str],
    width: int,
    height: int,
    seed: int,
    kind: str = "pathology",
    truth_path: str | os.PathLike[str] | None = None,
    mpp: float = 0.25,
    tile_size: int = 256,
    quality: int = 90,
) -> dict:
    """Render a synthetic slide to ``path`` and its truth GeoJSON beside it.

    ``truth_path`` defaults to ``path`` with its extension replaced by ``.truth.geojson``.
    Returns an info dict: path, truth_path, kind, seed, width, height, mpp (None for
    industrial), tile_size, level_dimensions [(w, h), ...], object_count and
    object_counts {class name: n}.
    """
    _check_options(tile_size, quality)
    scene = SyntheticScene(width, height, seed, kind=kind, mpp=mpp)
    path = os.fspath(path)
    truth_path = os.fspath(truth_path) if truth_path is not None else default_truth_path(path)
    if os.path.abspath(truth_path) == os.path.abspath(path):
        raise ConfigError(f"truth path {truth_path} must differ from the slide path")
    for target in (path, truth_path):
        parent = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(parent):
            raise ConfigError(f"cannot write {target}: folder {parent} does not exist")

    dims = level_dimensions(scene.width, scene.height)
    bigtiff = kind == "industrial" or scene.width * scene.height * 3 > 2**31
    if kind == "pathology":
        description = f"wsi-pipeline synthetic pathology seed={scene.seed} mpp={scene.mpp:g}"
    else:
        description = f"wsi-pipeline synthetic industrial seed={scene.seed}"
    tmp = partial_name(path)
    try:
        with tifffile.TiffWriter(tmp, bigtiff=bigtiff) as tw:
            for k, (lw, lh) in enumerate(dims):
                d = 2**k
                extra = {}
                if scene.mpp is not None:
                    per_cm = 1e4 / (scene.mpp * d)
                    extra = {"resolution": (per_cm, per_cm), "resolutionunit": "CENTIMETER"}
                else:
                    extra = {"resolutionunit": "NONE"}
                tw.write(
                    _level_tiles(scene, lw, lh, d, tile_size),
                    shape=(lh, lw, 3),
                    dtype=np.uint8,
                    tile=(tile_size, tile_size),
                    photometric="rgb",
                    compression="jpeg",
                    compressionargs={"level": quality},
                    subfiletype=0 if k == 0 else 1,
                    description=description if k == 0 else None,
                    software="wsi-pipeline",
                    metadata=None,
                    **extra,
                )
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    counts = write_truth(scene, truth_path)
    return {
        "path": path,
        "truth_path": truth_path,
        "kind": kind,
        "seed": scene.seed,
        "width": scene.width,
        "height": scene.height,
        "mpp": scene.mpp,
        "tile_size": tile_size,
        "level_dimensions": dims,
        "object_count": sum(counts.values()),
        "object_counts": counts,
    }
