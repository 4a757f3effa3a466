"""Training and evaluation tiles rendered from synthetic scenes, and CenterNet targets.

Tiles are rendered on the fly from :class:`wsi_pipeline.synthetic.SyntheticScene`
with fixed seeds (training and held-out seeds never overlap), JPEG-encoded and
decoded again like the tiles of a JPEG-compressed slide, and returned with
their truth in tile pixels (origin top-left of the tile, x right, y down).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from ..synthetic import SyntheticScene

# Seeds: training scenes 1000..1999, held-out evaluation scenes 9000+.
TRAIN_SEEDS = range(1000, 2000)
EVAL_SEEDS = range(9000, 9100)
SCENE_SIZE_PX = 4096
# How tiles are drawn from scenes of each kind: industrial defects are sparse
# (a few per 512 px cell at most), so most tiles are placed on one.
SCENE_SAMPLING = {
    "pathology": {"scene_px": 4096, "object_centred": 0.0},
    "industrial": {"scene_px": 8192, "object_centred": 0.75},
}


@dataclass
class TileSample:
    """One rendered tile and its truth.

    ``image``: ``HxWx3 uint8`` RGB. ``boxes``: ``Nx4 float32`` tile px xyxy,
    clipped to the tile. ``labels``: ``N int64``. ``visible``: ``N float32``
    fraction of each object's level-0 box inside the tile. ``regions``:
    ``(H/stride)x(W/stride) uint8`` label map (0 background, 1 tissue, 2
    tumour, or the scene's own region labels).
    """

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    visible: np.ndarray
    regions: np.ndarray


def make_scene(kind: str, seed: int, size_px: int = SCENE_SIZE_PX):
    return SyntheticScene(size_px, size_px, seed, kind=kind)


def jpeg_roundtrip(image_rgb: np.ndarray, quality: int) -> np.ndarray:
    """Encode and decode with OpenCV's JPEG codec, as a JPEG-tiled slide would store the tile."""
    ok, buf = cv2.imencode(".jpg", image_rgb[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:  # pragma: no cover - OpenCV always encodes a valid uint8 image
        raise RuntimeError("JPEG encode failed")
    return np.ascontiguousarray(cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1])


def render_tile(scene, x0: int, y0: int, tile_px: int, region_stride: int, jpeg_quality: int | None = 90) -> TileSample:
    """Render the ``tile_px`` square at level-0 (x0, y0) of ``scene`` with its truth."""
    image = scene.render(x0, y0, tile_px, tile_px, downsample=1.0)
    if jpeg_quality is not None:
        image = jpeg_roundtrip(image, jpeg_quality)
    boxes0, labels = scene.objects_in(x0, y0, tile_px, tile_px)
    boxes0 = np.asarray(boxes0, np.float32).reshape(-1, 4)
    labels = np.asarray(labels, np.int64).reshape(-1)
    shifted = boxes0 - np.array([x0, y0, x0, y0], np.float32)
    clipped = np.clip(shifted, 0, tile_px)
    area = np.maximum(shifted[:, 2] - shifted[:, 0], 1e-6) * np.maximum(shifted[:, 3] - shifted[:, 1], 1e-6)
    visible = ((clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1]) / area).astype(np.float32)
    keep = visible > 0
    regions = np.asarray(scene.region_mask(x0, y0, tile_px, tile_px, float(region_stride)), np.uint8)
    return TileSample(image, clipped[keep], labels[keep], visible[keep], regions)


def tile_origins(
    scene, seed: int, count: int, scene_px: int, tile_px: int, object_centred: float = 0.0
) -> list[tuple[int, int]]:
    """``count`` deterministic tile origins (level-0 px) inside a ``scene_px`` square scene.

    A fraction ``object_centred`` of them is placed so that an object of the
    scene lies inside the tile (for sparse industrial defects): a class drawn
    uniformly among those present, then one of its objects. The rest are
    uniform.
    """
    rng = np.random.default_rng(seed)
    hi = scene_px - tile_px
    n_obj = int(round(count * object_centred))
    origins = []
    if n_obj:
        boxes, labels = scene.objects_in(0, 0, scene_px, scene_px)
        boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
        labels = np.asarray(labels, np.int64).reshape(-1)
        if len(boxes):
            classes = np.unique(labels)
            picks = [int(rng.choice(np.flatnonzero(labels == rng.choice(classes)))) for _ in range(n_obj)]
            for i in picks:
                cx, cy = (boxes[i, 0] + boxes[i, 2]) / 2, (boxes[i, 1] + boxes[i, 3]) / 2
                jx, jy = rng.uniform(0.1, 0.9, 2) * tile_px
                origins.append((int(np.clip(cx - jx, 0, hi)), int(np.clip(cy - jy, 0, hi))))
    while len(origins) < count:
        origins.append((int(rng.integers(0, hi)), int(rng.integers(0, hi))))
    return origins


def render_tiles(
    kind: str,
    seeds: Iterable[int],
    tiles_per_scene: int,
    tile_px: int = 512,
    region_stride: int = 8,
    jpeg_quality: Sequence[int] | None = (70, 95),
    scene_px: int = SCENE_SIZE_PX,
    object_centred: float = 0.0,
) -> list[TileSample]:
    """Render ``tiles_per_scene`` tiles from each scene seed (see :func:`tile_origins`);
    JPEG quality drawn per tile from the ``jpeg_quality`` range (None: no JPEG)."""
    samples = []
    for seed in seeds:
        scene = make_scene(kind, seed, scene_px)
        rng = np.random.default_rng(seed + 77_000)
        for x0, y0 in tile_origins(scene, seed, tiles_per_scene, scene_px, tile_px, object_centred):
            q = None if jpeg_quality is None else int(rng.integers(jpeg_quality[0], jpeg_quality[1] + 1))
            samples.append(render_tile(scene, x0, y0, tile_px, region_stride, q))
    return samples


# -- augmentation and targets --------------------------------------------------


def augment(sample: TileSample, rng: np.random.Generator, crop_px: int, region_stride: int) -> TileSample:
    """A random ``crop_px`` crop (origin on the region grid), flip and 90-degree rotation."""
    size = sample.image.shape[0]
    cells = (size - crop_px) // region_stride
    ox = int(rng.integers(0, cells + 1)) * region_stride
    oy = int(rng.integers(0, cells + 1)) * region_stride
    image = sample.image[oy : oy + crop_px, ox : ox + crop_px]
    rs = region_stride
    regions = sample.regions[oy // rs : (oy + crop_px) // rs, ox // rs : (ox + crop_px) // rs]
    b = sample.boxes - np.array([ox, oy, ox, oy], np.float32)
    full_area = np.maximum((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]), 1e-6)
    clipped = np.clip(b, 0, crop_px)
    area = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
    keep = area > 0
    boxes, labels = clipped[keep], sample.labels[keep]
    visible = sample.visible[keep] * (area[keep] / full_area[keep])
    if rng.random() < 0.5:  # horizontal flip
        image, regions = image[:, ::-1], regions[:, ::-1]
        boxes = np.stack([crop_px - boxes[:, 2], boxes[:, 1], crop_px - boxes[:, 0], boxes[:, 3]], axis=1)
    k = int(rng.integers(0, 4))
    for _ in range(k):  # rotate 90 degrees counter-clockwise: (x, y) -> (y, W - x)
        image, regions = np.rot90(image), np.rot90(regions)
        boxes = np.stack([boxes[:, 1], crop_px - boxes[:, 2], boxes[:, 3], crop_px - boxes[:, 0]], axis=1)
    return TileSample(
        np.ascontiguousarray(image),
        boxes.astype(np.float32).reshape(-1, 4),
        labels,
        visible.astype(np.float32),
        np.ascontiguousarray(regions),
    )


def center_targets(
    boxes: np.ndarray, labels: np.ndarray, num_classes: int, size_px: int, stride: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CenterNet targets for one tile at ``stride``.

    Returns ``heat [C, S, S] float32`` (a Gaussian per object, 1 at its centre
    cell, S = size_px / stride), ``size [2, S, S]`` (box w, h in px),
    ``offset [2, S, S]`` (centre position within its cell, 0..1) and
    ``mask [S, S] float32`` (1 at centre cells). Gaussian widths follow
    TTFNet: sigma = 0.54 * box side / 6, per axis, in cells.
    """
    s = size_px // stride
    heat = np.zeros((num_classes, s, s), np.float32)
    size = np.zeros((2, s, s), np.float32)
    offset = np.zeros((2, s, s), np.float32)
    mask = np.zeros((s, s), np.float32)
    order = np.argsort(-(boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))  # small boxes last win
    for i in order:
        x0, y0, x1, y1 = boxes[i]
        w, h = x1 - x0, y1 - y0
        if w < 1 or h < 1:
            continue
        cx, cy = (x0 + x1) / 2 / stride, (y0 + y1) / 2 / stride
        ix, iy = min(int(cx), s - 1), min(int(cy), s - 1)
        sx = max(0.54 * w / 6 / stride, 0.5)
        sy = max(0.54 * h / 6 / stride, 0.5)
        rx, ry = int(3 * sx) + 1, int(3 * sy) + 1
        xs = np.arange(max(ix - rx, 0), min(ix + rx + 1, s))
        ys = np.arange(max(iy - ry, 0), min(iy + ry + 1, s))
        g = np.exp(-((xs[None, :] - ix) ** 2) / (2 * sx * sx) - ((ys[:, None] - iy) ** 2) / (2 * sy * sy))
        c = int(labels[i])
        window = heat[c, ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]
        np.maximum(window, g.astype(np.float32), out=window)
        heat[c, iy, ix] = 1.0
        size[:, iy, ix] = (w, h)
        offset[:, iy, ix] = (cx - ix, cy - iy)
        mask[iy, ix] = 1.0
    return heat, size, offset, mask


def region_targets(regions: np.ndarray, region_labels: Sequence[Sequence[int]]) -> np.ndarray:
    """Label map ``HxW`` -> ``[C, H, W] float32`` binary maps.

    Channel c is 1 where the label is in ``region_labels[c]``."""
    return np.stack([np.isin(regions, list(v)).astype(np.float32) for v in region_labels])


def heldout_tiles(
    kind: str, scenes: int = 8, tiles_per_scene: int = 8, jpeg_quality: int = 85, first_seed: int = EVAL_SEEDS[0]
) -> list[TileSample]:
    """Held-out evaluation tiles: scenes with seeds from ``EVAL_SEEDS`` (never trained on)."""
    if first_seed < EVAL_SEEDS[0] or first_seed + scenes > EVAL_SEEDS[-1] + 1:
        raise ValueError(f"held-out seeds must lie in {EVAL_SEEDS}")
    return render_tiles(
        kind,
        range(first_seed, first_seed + scenes),
        tiles_per_scene,
        jpeg_quality=(jpeg_quality, jpeg_quality),
        **SCENE_SAMPLING[kind],
    )
