"""Tissue masks: which parts of a slide hold anything worth running a model on.

A mask is a boolean image over the whole slide at a coarse scale
(``downsample`` level-0 pixels per mask pixel). It comes from the slide's
thumbnail (Otsu on saturation, then morphology), from a user's mask image,
from GeoJSON polygons in level-0 pixels, or covers everything (``all``, for
industrial images).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import cv2
import numpy as np

from ..errors import ConfigError
from ..slide.base import Slide, thumbnail_source
from ..special_files import open_regular, special_kind
from .grid import TileGrid

DEFAULT_THUMBNAIL_SIZE = 2048
# A selection warns when it keeps fewer tiles than this share of what the image's
# content (anything not blank background) would need, for content above MIN_CONTENT_FRACTION.
LOW_SELECTION_RATIO = 0.25
MIN_CONTENT_FRACTION = 0.02


@dataclass
class TissueMask:
    """``mask``: HxW bool; ``downsample``: level-0 pixels per mask pixel (x, y).

    ``content_fraction``: the fraction of the slide that is not blank
    background (anything stained or coloured), where the mask was computed
    from the slide's pixels; None for ``all`` and user masks. ``source``: how
    the thumbnail was made (level, decode, stored tiles decoded, seconds).
    """

    mask: np.ndarray
    downsample: tuple[float, float]
    content_fraction: float | None = None
    # Where an Otsu mask's thumbnail came from (:func:`mask_source`), for summary.json.
    source: dict | None = None

    @property
    def fraction(self) -> float:
        """Fraction of the slide covered by tissue."""
        return float(self.mask.mean()) if self.mask.size else 0.0

    def area_level0_px(self) -> float:
        """Tissue area in level-0 pixels squared."""
        return float(self.mask.sum()) * self.downsample[0] * self.downsample[1]

    def selection_warning(
        self, n_selected: int, n_tiles: int, min_tissue: float, method: str | None = None
    ) -> str | None:
        """Why a selection of ``n_selected`` of ``n_tiles`` tiles looks wrong, or None.

        Wrong: no tile at all, or far fewer tiles (under a quarter) than the
        part of the slide that is not blank background would need. The advice
        names the setting that excluded the tiles, given the tissue ``method``
        in force (``otsu``, ``all`` or ``file``).
        """
        lower = f"lower min_tissue (--min-tissue, now {min_tissue:g})"
        if method == "all":
            hint = f"tissue 'all' counts every pixel as tissue, so min_tissue excluded them: {lower}"
        elif method == "file":
            hint = f"check that the mask file covers the image, or {lower}"
        else:
            hint = f"if the image is all foreground, use tissue 'all' (--tissue all) or a mask file, or {lower}"
        if n_tiles and n_selected == 0:
            return (
                f"no tile selected: none of the {n_tiles} tiles has a tissue fraction >= {min_tissue} "
                f"(tissue covers {100 * self.fraction:.1f} % of the image), so nothing was detected; {hint}"
            )
        content = self.content_fraction
        if (
            content is not None
            and content >= MIN_CONTENT_FRACTION
            and n_selected < LOW_SELECTION_RATIO * content * n_tiles
        ):
            return (
                f"only {n_selected} of {n_tiles} tiles selected, though {100 * content:.0f} % of the image "
                f"is not blank background (tissue mask {100 * self.fraction:.1f} %); {hint}"
            )
        return None

    def tile_fractions(self, grid: TileGrid) -> np.ndarray:
        """Tissue fraction of each tile of ``grid``: ``n_rows x n_cols`` float32 in [0, 1].

        Computed with an integral image, so the cost does not depend on the
        number of tiles. A tile's part past the slide's border is the image
        reflected (:func:`~.grid.fill_past_edge`), so the fraction is that of
        its part inside the slide: an image smaller than a tile is one tile,
        as much tissue as the image.
        """
        # (H+1) x (W+1) int32 counts of tissue pixels (exact: a mask has far fewer than 2**31 pixels).
        integral = cv2.integral(np.asarray(self.mask, dtype=bool).view(np.uint8))
        mh, mw = self.mask.shape
        g = grid.geometry
        extent = g.tile_extent_level0
        x0 = g.col_x0_level0(np.arange(g.n_cols)) / self.downsample[0]
        y0 = g.row_y0_level0(np.arange(g.n_rows)) / self.downsample[1]
        x1 = x0 + extent / self.downsample[0]
        y1 = y0 + extent / self.downsample[1]
        xi0 = np.clip(np.round(x0).astype(int), 0, mw)
        xi1 = np.clip(np.round(x1).astype(int), 0, mw)
        yi0 = np.clip(np.round(y0).astype(int), 0, mh)
        yi1 = np.clip(np.round(y1).astype(int), 0, mh)
        s = (
            integral[yi1[:, None], xi1[None, :]]
            - integral[yi0[:, None], xi1[None, :]]
            - integral[yi1[:, None], xi0[None, :]]
            + integral[yi0[:, None], xi0[None, :]]
        )
        full = (np.minimum(y1, mh) - y0)[:, None] * (np.minimum(x1, mw) - x0)[None, :]
        return np.clip(s / np.maximum(full, 1e-9), 0, 1).astype(np.float32)


def otsu_tissue_mask(thumbnail: np.ndarray, min_saturation: int = 15, kernel_px: int = 5) -> np.ndarray:
    """Tissue as pixels of a thumbnail more saturated than the background.

    Bright, grey slide background has low saturation; stained tissue has high.
    The threshold is Otsu's where it separates background from tissue (see
    :func:`saturation_threshold`), and the floor ``min_saturation`` where the
    image has no background to separate (an all-tissue crop) or no tissue
    (all background). Returns HxW bool.
    """
    return _tissue_from_saturation(_saturation(thumbnail), min_saturation, kernel_px)


def _tissue_from_saturation(sat: np.ndarray, min_saturation: int = 15, kernel_px: int = 5) -> np.ndarray:
    mask = sat > saturation_threshold(sat, min_saturation)
    # Dark, unsaturated pixels (black pen, folds) are not tissue either way;
    # very dark saturated ones still count.
    k = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (kernel_px, kernel_px))
    m = cv2.morphologyEx(mask.astype(np.uint8), cv2.MORPH_CLOSE, k)
    m = cv2.morphologyEx(m, cv2.MORPH_OPEN, k)
    return m.astype(bool)


def _saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation (0..255) of an RGB image, lightly blurred against JPEG noise."""
    return cv2.GaussianBlur(cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)[..., 1], (5, 5), 0)


def _otsu(values: np.ndarray) -> float:
    thresh, _ = cv2.threshold(values.reshape(-1, 1), 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    return float(thresh)


def saturation_threshold(sat: np.ndarray, min_saturation: int = 15, max_rounds: int = 8) -> float:
    """The saturation above which a pixel is tissue.

    Otsu's threshold splits the histogram in two, but the lower class is
    background only when the slide has background and the stains do not
    split more strongly among themselves. So the lower class is checked: when
    a noticeable part of it (over 5 %) is clearly saturated (over twice
    ``min_saturation``), Otsu is applied again within it; when it holds
    hardly any unsaturated pixels (under 5 % at or below ``min_saturation``),
    the image has no background and the absolute floor ``min_saturation``
    decides. An all-background image has nothing above the floor.
    """
    values = sat.ravel()
    thresh = _otsu(values)
    for _ in range(max_rounds):
        below = values[values <= thresh]
        if below.size == 0:
            return float(min_saturation)
        if np.count_nonzero(below > 2 * min_saturation) <= 0.05 * below.size:
            return max(thresh, float(min_saturation))  # the lower class is background
        if np.count_nonzero(below <= min_saturation) < 0.05 * below.size:
            return float(min_saturation)  # no background to split off
        thresh = _otsu(below)
    return float(min_saturation)


def content_fraction(thumbnail: np.ndarray, min_saturation: int = 15) -> float:
    """Fraction of a thumbnail more saturated than blank background (anything stained or coloured)."""
    return _content_from_saturation(_saturation(thumbnail), min_saturation)


def _content_from_saturation(sat: np.ndarray, min_saturation: int = 15) -> float:
    return float(np.count_nonzero(sat > min_saturation)) / max(1, sat.size)


def tissue_mask(
    slide: Slide,
    method: str = "otsu",
    thumbnail_size: int = DEFAULT_THUMBNAIL_SIZE,
    mask_path: str | os.PathLike[str] | None = None,
) -> TissueMask:
    """A tissue mask of ``slide``.

    ``method``: "otsu" (from the thumbnail), "all" (everything is tissue), or
    "file" with ``mask_path`` a mask image (non-zero = tissue, stretched over
    the whole slide) or a GeoJSON file of polygons in level-0 pixels.
    """
    w0, h0 = slide.dimensions
    if method == "all":
        scale = max(w0, h0) / thumbnail_size
        mw, mh = max(1, round(w0 / scale)), max(1, round(h0 / scale))
        return TissueMask(np.ones((mh, mw), bool), (w0 / mw, h0 / mh))
    if method == "file" or mask_path is not None:
        if mask_path is None:
            raise ConfigError("tissue method 'file' needs a mask path")
        return mask_from_file(slide, mask_path, thumbnail_size)
    if method != "otsu":
        raise ConfigError(f"unknown tissue method {method!r}; expected otsu, all or file")
    start, decoded_before = time.perf_counter(), slide.decoded_tile_count()
    side = thumbnail_side(slide, thumbnail_size)
    # Decoded reduced where a level much larger than the thumbnail is read (a slide of one stored
    # level, say): each stored tile decoded at 1/2 to 1/8 a side, not the whole level at full size.
    thumb = slide.get_thumbnail((side, side), reduced=True)
    th, tw = thumb.shape[:2]
    sat = _saturation(thumb)  # once, for both the mask and the content fraction
    source = mask_source(slide, side, decoded_before)
    source["seconds"] = round(time.perf_counter() - start, 4)
    return TissueMask(_tissue_from_saturation(sat), (w0 / tw, h0 / th), _content_from_saturation(sat), source)


def mask_source(slide: Slide, side: int, decoded_before: int | None) -> dict:
    """How an Otsu mask's thumbnail of long side ``side`` is made: the ``level`` read, its
    ``size``, ``decode`` ("whole" or "1/k": JPEG tiles decoded reduced), ``read`` ("as stored"
    where the level is the thumbnail, else "shrunk"), and ``stored_tiles_decoded`` since
    ``decoded_before`` (None where the reader cannot tell)."""
    tw, th, level, k = thumbnail_source(slide, (side, side), reduced=True)
    lw, lh = slide.level_dimensions[level]
    after = slide.decoded_tile_count()
    return {
        "level": level,
        "size": [tw, th],
        "level_size": [lw, lh],
        "decode": "whole" if k == 1 else f"1/{k}",
        "read": "as stored" if (lw, lh) == (tw, th) else "shrunk",
        "stored_tiles_decoded": None if after is None or decoded_before is None else after - decoded_before,
    }


def thumbnail_side(slide: Slide, largest_px: int = DEFAULT_THUMBNAIL_SIZE) -> int:
    """The long side of the thumbnail an Otsu mask is computed on: that of the finest stored
    level no larger than ``largest_px``, read as stored, where it is at least half of it; else
    ``largest_px`` (a finer level read and shrunk).

    A 6k SVS (levels 1x, 4x, 16x) gives its 4x level's 1,536 px, a sixteenth of the pixels that
    a 2,048 px thumbnail shrunk from level 0 would decode; the mask is then a quarter coarser.
    """
    w0, h0 = slide.dimensions
    for level in range(slide.level_count):
        # The floor keeps the thumbnail's downsample at or above the level's, whatever the
        # rounding of its sizes, so that the thumbnail reads this level.
        side = math.floor(max(w0, h0) / slide.level_downsamples[level])
        if side > largest_px:
            continue
        if side >= largest_px / 2 and slide.best_level_for_downsample(max(w0 / side, h0 / side, 1.0)) == level:
            return side
        break
    return largest_px


def mask_from_file(slide: Slide, path: str | os.PathLike[str], size: int = DEFAULT_THUMBNAIL_SIZE) -> TissueMask:
    """A user's mask: an image (non-zero = tissue) or GeoJSON polygons (level-0 pixels)."""
    path = os.fspath(path)
    w0, h0 = slide.dimensions
    if not os.path.exists(path):
        raise ConfigError(f"{path}: mask file not found")
    if kind := special_kind(path):  # reading a FIFO would wait for a writer
        raise ConfigError(f"{path}: the mask is {kind}, not a regular file")
    if path.lower().endswith((".geojson", ".json")):
        scale = max(w0, h0) / size
        mw, mh = max(1, round(w0 / scale)), max(1, round(h0 / scale))
        mask = np.zeros((mh, mw), np.uint8)
        for ring in geojson_polygons(path):
            pts = np.round(np.asarray(ring, np.float64) / [w0 / mw, h0 / mh]).astype(np.int32)
            cv2.fillPoly(mask, [pts], 1)
        return TissueMask(mask.astype(bool), (w0 / mw, h0 / mh))
    with open_regular(path) as f:
        img = cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_GRAYSCALE)
    if img is None:
        raise ConfigError(f"{path}: not a readable mask image (expected PNG/JPEG/TIFF or GeoJSON)")
    mh, mw = img.shape
    return TissueMask(img > 0, (w0 / mw, h0 / mh))


def geojson_polygons(path: str) -> list[list[list[float]]]:
    """Outer rings of every Polygon / MultiPolygon in a GeoJSON file."""
    try:
        with open_regular(path, "r") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid GeoJSON: {exc}") from exc
    feats = doc.get("features", [doc]) if isinstance(doc, dict) else doc
    rings: list[list[list[float]]] = []
    for feat in feats:
        geom = feat.get("geometry", feat) if isinstance(feat, dict) else None
        if not geom:
            continue
        if geom.get("type") == "Polygon":
            rings.append(geom["coordinates"][0])
        elif geom.get("type") == "MultiPolygon":
            rings.extend(poly[0] for poly in geom["coordinates"])
    if not rings:
        raise ConfigError(f"{path}: no Polygon or MultiPolygon found")
    return rings
