"""Procedural slide content with known truth: :class:`SyntheticScene`.

A scene is a pure function of level-0 coordinates and a seed. Nothing global is stored:

* regions (tissue, tumour) come from :class:`~.noise.LatticeField` noise,
  thresholded; the thresholds are fixed once from a 64 x 64 sample of the field;
* objects are generated per 512 x 512 level-0 *cell* from a random generator seeded by
  (seed, cell x, cell y); an object belongs to the cell holding its centre, and a region
  is rendered or listed by visiting every cell its objects could reach from.

So any window of a 100,000 x 100,000 scene renders in memory proportional to the window,
and rendering a window in one piece or in parts gives identical pixels.

Coordinates are level-0 pixels, origin top-left, x right, y down. An output pixel ``(r, c)``
of a render at ``downsample`` d covers level-0 ``[x0 + c*d, x0 + (c+1)*d)`` and is sampled
at its centre, so a render at d equals (up to the fading of sub-pixel objects) an area
downsample of the render at 1: pyramid levels drawn this way agree with each other.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import cv2
import numpy as np

from ..errors import ConfigError
from ..validation import is_instance
from .noise import LatticeField, PeriodicTexture, make_texture, mix_int
from .objects import CellObjects, coverage, industrial_objects, pathology_objects

CELL_SIZE_LEVEL0 = 512
MAX_SIDE = 1_000_000
KINDS = ("pathology", "industrial")

_CACHE_CELLS = 512

# Pathology look (RGB), tuned by eye to H&E slides.
_BG = np.array([241.0, 240.0, 243.0], np.float32)
_BG_GRAIN = 2.2
_STROMA_LIGHT = np.array([238.0, 176.0, 212.0], np.float32)
_STROMA_DARK = np.array([212.0, 134.0, 186.0], np.float32)
_TUMOUR = np.array([192.0, 112.0, 178.0], np.float32)
_FIBRE = np.array([-7.0, -11.0, -6.0], np.float32)
_NUC_TISSUE = np.array([98.0, 52.0, 142.0], np.float32)
_NUC_TUMOUR = np.array([64.0, 28.0, 110.0], np.float32)

# From this downsample on, nuclei are under ~1.5 output px: they are drawn as their mean
# coverage of tissue and tumour (measured on rendered scenes; independent of mpp) instead
# of one by one, so overviews of huge scenes need not generate every cell.
_STATISTICAL_DOWNSAMPLE = 16.0
_COVERAGE_TISSUE = 0.017
_COVERAGE_TUMOUR = 0.151

# Industrial look (grey, slightly blue).
_METAL = 150.0
_METAL_TINT = np.array([0.985, 1.0, 1.03], np.float32)
_DARK, _BRIGHT = 38.0, 236.0
# Defects are left out from this downsample on (all under ~1 output px, and sparse).
_INDUSTRIAL_NO_DEFECTS_DOWNSAMPLE = 64.0


def _centres(origin: int, length: int, downsample: float) -> np.ndarray:
    n = math.ceil(length / downsample)
    return origin + (np.arange(n, dtype=np.float64) + 0.5) * downsample


def _check_region(width: int, height: int, downsample: float) -> None:
    if width <= 0 or height <= 0:
        raise ConfigError(f"region size must be positive, got {width} x {height}")
    if not downsample >= 1.0 or not math.isfinite(downsample):
        raise ConfigError(f"downsample must be a finite number >= 1, got {downsample}")


class SyntheticScene:
    """A deterministic procedural slide of ``width`` x ``height`` level-0 pixels.

    ``kind="pathology"``: near-white background, blobby H&E-like tissue (about 35-55% of
    the slide) with tumour sub-regions, nucleus objects (class 0 "nucleus"), denser, larger
    and darker in tumour. Region labels: 0 background, 1 tissue (non-tumour), 2 tumour.
    Sizes follow ``mpp`` (um per level-0 pixel): nuclei are 8-20 px across at 0.25.

    ``kind="industrial"``: brushed grey metal, sparse defects: class 0 "spot" (dark or
    bright discs 6-40 px), class 1 "scratch" (thin segments 30-200 px long). Region label
    1 ("surface") everywhere; ``mpp`` is None.
    """

    def __init__(self, width: int, height: int, seed: int, kind: str = "pathology", mpp: float | None = 0.25):
        if kind not in KINDS:
            raise ConfigError(f"synthetic slide kind must be one of {', '.join(KINDS)}, got {kind!r}")
        for name, v in (("width", width), ("height", height)):
            if not is_instance(v, (int, np.integer)):
                raise ConfigError(f"synthetic slide {name} must be an integer, got {v!r}")
            if not 1 <= v <= MAX_SIDE:
                raise ConfigError(f"synthetic slide {name} must be within 1..{MAX_SIDE} pixels, got {v}")
        if kind == "pathology":
            if mpp is None or not (0.01 <= float(mpp) <= 100.0):
                raise ConfigError(f"synthetic pathology mpp must be within 0.01..100 um/px, got {mpp!r}")
        self.width = int(width)
        self.height = int(height)
        self.seed = int(seed)
        self.kind = kind
        self.mpp: float | None = float(mpp) if kind == "pathology" else None
        self.cell_size = CELL_SIZE_LEVEL0
        self.cells_x = -(-self.width // self.cell_size)
        self.cells_y = -(-self.height // self.cell_size)
        self._cache: OrderedDict[tuple[int, int], CellObjects] = OrderedDict()
        self._key = mix_int(self.seed, KINDS.index(kind))
        if kind == "pathology":
            self.class_names = ["nucleus"]
            self.class_colors = [(150, 40, 200)]
            self.region_class_names = ["background", "tissue", "tumour"]
            self.region_class_colors = [(255, 255, 255), (60, 160, 60), (220, 40, 40)]
            self._init_pathology()
        else:
            self.class_names = ["spot", "scratch"]
            self.class_colors = [(230, 160, 0), (0, 170, 230)]
            self.region_class_names = ["background", "surface"]
            self.region_class_colors = [(255, 255, 255), (128, 128, 128)]
            self._init_industrial()

    def __repr__(self) -> str:
        return (
            f"SyntheticScene(width={self.width}, height={self.height}, seed={self.seed}, "
            f"kind={self.kind!r}, mpp={self.mpp})"
        )

    # ------------------------------------------------------------------ set-up

    def _init_pathology(self) -> None:
        side = min(self.width, self.height)
        spacing = float(np.clip(0.6 * side, 512, 32768))
        self._tissue = LatticeField(mix_int(self._key, 1), spacing, octaves=3)
        self._tumour = LatticeField(mix_int(self._key, 2), spacing / 2, octaves=2)
        self._edge_margin = 0.07 * side + 16
        self._size_scale = 0.25 / self.mpp  # nucleus sizes in px follow the pixel size
        self._max_half_extent = 10.0 * self._size_scale + 1.0
        self._fibres = PeriodicTexture(make_texture(mix_int(self._key, 3), 512, 2.5, 1.0))
        self._grain = PeriodicTexture(make_texture(mix_int(self._key, 4), 512, 0.0, 0.0))

        # Thresholds from a coarse sample of the fields, so each seed covers a set fraction.
        u = np.random.default_rng(mix_int(self._key, 5)).random()
        coverage = 0.35 + 0.2 * u
        xs = (np.arange(64) + 0.5) * self.width / 64
        ys = (np.arange(64) + 0.5) * self.height / 64
        gx, gy = (a.ravel() for a in np.meshgrid(xs, ys))
        f = self._tissue_points(gx, gy)
        f_std = float(f.std()) or 1.0
        self._t_tissue = float(np.quantile(f, 1.0 - coverage))
        self._t_inner = self._t_tissue + 0.08 * f_std
        g = self._tumour.points(gx, gy)
        inner = f > self._t_inner
        g_std = float(g.std()) or 1.0
        self._t_tumour = float(np.quantile(g[inner], 0.7)) if inner.sum() > 16 else float(g.max()) + 1
        # Soft edges: a few level-0 pixels wide (field change over ~3 px of a typical slope).
        self._eps_tissue = 6.0 * f_std / self._tissue.fine_spacing
        self._eps_tumour = 16.0 * g_std / self._tumour.fine_spacing
        self._shade_scale = 1.0 / (2.0 * g_std)

    def _init_industrial(self) -> None:
        side = min(self.width, self.height)
        self._light = LatticeField(mix_int(self._key, 1), float(np.clip(side / 1.5, 512, 32768)), 2)
        self._brush = PeriodicTexture(make_texture(mix_int(self._key, 3), 1024, 24.0, 0.6))
        self._grain = PeriodicTexture(make_texture(mix_int(self._key, 4), 512, 0.0, 0.0))
        self._max_half_extent = 102.0

    # ------------------------------------------------------------------ fields

    def _edge_penalty(self, coords: np.ndarray, size: int) -> np.ndarray:
        dist = np.minimum(coords, size - coords)
        ramp = np.clip(1.0 - dist / self._edge_margin, 0.0, None)
        return (-1.5 * ramp * ramp).astype(np.float32)

    def _tissue_points(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        f = self._tissue.points(x, y)
        return (f + self._edge_penalty(np.ravel(y), self.height)) + self._edge_penalty(np.ravel(x), self.width)

    def _tissue_grid(self, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        f = self._tissue.grid(xs, ys)
        return (f + self._edge_penalty(ys, self.height)[:, None]) + self._edge_penalty(xs, self.width)[None, :]

    def labels_at(self, x_level0: np.ndarray, y_level0: np.ndarray) -> np.ndarray:
        """Region label (see :attr:`region_class_names`) at level-0 points: (N,) uint8."""
        x = np.ravel(np.asarray(x_level0, np.float64))
        y = np.ravel(np.asarray(y_level0, np.float64))
        if self.kind == "industrial":
            return np.ones(x.size, np.uint8)
        f = self._tissue_points(x, y)
        g = self._tumour.points(x, y)
        return self._labels(f, g)

    def _labels(self, f: np.ndarray, g: np.ndarray) -> np.ndarray:
        lab = (f > self._t_tissue).astype(np.uint8)
        lab[(f > self._t_inner) & (g > self._t_tumour)] = 2
        return lab

    def region_mask(
        self, x0_level0: int, y0_level0: int, width: int, height: int, downsample: float = 1.0
    ) -> np.ndarray:
        """Region labels on the render grid of the region: (ceil(h/d), ceil(w/d)) uint8.

        Pathology: 0 background, 1 tissue (non-tumour), 2 tumour. Industrial: all 1.
        """
        _check_region(width, height, downsample)
        xs = _centres(x0_level0, width, downsample)
        ys = _centres(y0_level0, height, downsample)
        if self.kind == "industrial":
            return np.ones((ys.size, xs.size), np.uint8)
        return self._labels(self._tissue_grid(xs, ys), self._tumour.grid(xs, ys))

    # ------------------------------------------------------------------ objects

    def _cell_rng(self, cx: int, cy: int) -> np.random.Generator:
        return np.random.default_rng(mix_int(self._key, 7, cx, cy))

    def _cell(self, cx: int, cy: int) -> CellObjects:
        key = (cx, cy)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        objs = self._gen_pathology(cx, cy) if self.kind == "pathology" else self._gen_industrial(cx, cy)
        self._cache[key] = objs
        if len(self._cache) > _CACHE_CELLS:
            self._cache.popitem(last=False)
        return objs

    def _gen_pathology(self, cx: int, cy: int) -> CellObjects:
        return pathology_objects(
            self._cell_rng(cx, cy), cx, cy, self.cell_size, self._size_scale, self.labels_at, self.width, self.height
        )

    def _gen_industrial(self, cx: int, cy: int) -> CellObjects:
        return industrial_objects(self._cell_rng(cx, cy), cx, cy, self.cell_size, self.width, self.height)

    def _objects_near(self, x0: float, y0: float, x1: float, y1: float) -> CellObjects:
        """Objects whose box meets [x0, x1) x [y0, y1), cells visited in row-major order."""
        m = self._max_half_extent
        c = self.cell_size
        cx0 = max(int(math.floor((x0 - m) / c)), 0)
        cy0 = max(int(math.floor((y0 - m) / c)), 0)
        cx1 = min(int(math.floor((x1 + m) / c)), self.cells_x - 1)
        cy1 = min(int(math.floor((y1 + m) / c)), self.cells_y - 1)
        parts = []
        for cy in range(cy0, cy1 + 1):
            for cx in range(cx0, cx1 + 1):
                objs = self._cell(cx, cy)
                if objs.labels.size:
                    b = objs.boxes
                    hit = (b[:, 2] > x0) & (b[:, 0] < x1) & (b[:, 3] > y0) & (b[:, 1] < y1)
                    if hit.any():
                        parts.append(objs.select(hit))
        return CellObjects.concat(parts)

    def objects_in(
        self, x0_level0: float, y0_level0: float, width: float, height: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Objects whose box intersects the region.

        Returns boxes (N, 4) float32 x0, y0, x1, y1 in level-0 pixels and labels (N,)
        int64 indexing :attr:`class_names`.
        """
        objs = self._objects_near(x0_level0, y0_level0, x0_level0 + width, y0_level0 + height)
        return objs.boxes.copy(), objs.labels.copy()

    def iter_cells(self):
        """Yield (cell_x, cell_y, boxes (N,4) float32, labels (N,) int64) for every cell,
        row-major; each object appears exactly once (in the cell holding its centre)."""
        for cy in range(self.cells_y):
            for cx in range(self.cells_x):
                objs = self._gen_pathology(cx, cy) if self.kind == "pathology" else self._gen_industrial(cx, cy)
                yield cx, cy, objs.boxes, objs.labels

    # ------------------------------------------------------------------ drawing

    def _window_objects(self, x0: float, y0: float, xs: np.ndarray, ys: np.ndarray, d: float):
        # Margin of 2 output px: anti-aliasing reaches about a pixel beyond an object's box.
        m = 2.0 * d
        return self._objects_near(x0 - m, y0 - m, x0 + xs.size * d + m, y0 + ys.size * d + m)

    def render(self, x0_level0: int, y0_level0: int, width: int, height: int, downsample: float = 1.0) -> np.ndarray:
        """Render a level-0 region at ``downsample``.

        Returns (ceil(height / downsample), ceil(width / downsample), 3) uint8 RGB,
        C-contiguous. Origins that are multiples of ``downsample`` put output pixels on the
        slide's level grid (as a pyramid level stores them).
        """
        _check_region(width, height, downsample)
        d = float(downsample)
        xs = _centres(x0_level0, width, d)
        ys = _centres(y0_level0, height, d)
        if self.kind == "pathology":
            planes = self._render_pathology(x0_level0, y0_level0, xs, ys, d)
        else:
            planes = self._render_industrial(x0_level0, y0_level0, xs, ys, d)
        out = []
        for v in planes:
            v += 0.5
            np.clip(v, 0.0, 255.0, out=v)
            out.append(v.astype(np.uint8))
        return cv2.merge(out)

    # Colour is computed per channel on contiguous (H, W) planes: numpy broadcasting
    # over a trailing axis of 3 runs about 3x slower.

    def _render_pathology(self, x0, y0, xs, ys, d) -> list[np.ndarray]:
        shape = (ys.size, xs.size)
        grain = self._grain.sample(xs, ys, d)
        grain *= _BG_GRAIN
        f = self._tissue_grid(xs, ys)
        soft = max(1.0, d / 4.0)  # edges stay about an output pixel soft when zoomed out
        inv_eps = 1.0 / (self._eps_tissue * soft)
        alpha = np.clip((f - self._t_tissue) * inv_eps + 0.5, 0.0, 1.0)
        if not alpha.any():
            return [grain + _BG[c] for c in range(3)]
        g = self._tumour.grid(xs, ys)
        inner = np.clip((f - self._t_inner) * inv_eps + 0.5, 0.0, 1.0)
        w_tumour = np.clip((g - self._t_tumour) * (1.0 / (self._eps_tumour * soft)) + 0.5, 0.0, 1.0)
        w_tumour *= inner
        a_shade = np.clip((g - self._t_tumour) * self._shade_scale + 0.5, 0.0, 1.0)
        a_shade *= alpha
        a_tumour = w_tumour * alpha
        a_fibre = self._fibres.sample(xs, ys, d)
        a_fibre *= alpha
        grain *= 1.0 - alpha  # background grain fades under tissue
        cov = None
        if d >= _STATISTICAL_DOWNSAMPLE:
            cov = w_tumour * (_COVERAGE_TUMOUR - _COVERAGE_TISSUE)
            cov += _COVERAGE_TISSUE
            cov *= alpha
            objs = CellObjects.empty()
        else:
            objs = self._window_objects(x0, y0, xs, ys, d)
        if objs.labels.size:
            cov = coverage(objs, np.ones(objs.labels.size, bool), x0, y0, shape, d, self._max_half_extent)
            if not cov.any():
                cov = None
        planes = []
        for c in range(3):
            v = grain + float(_BG[c])
            v += alpha * float(_STROMA_LIGHT[c] - _BG[c])
            v += a_shade * float(_STROMA_DARK[c] - _STROMA_LIGHT[c])
            v += a_tumour * float(_TUMOUR[c] - _STROMA_DARK[c])
            v += a_fibre * float(_FIBRE[c])
            if cov is not None:
                nuc = w_tumour * float(_NUC_TUMOUR[c] - _NUC_TISSUE[c])
                nuc += float(_NUC_TISSUE[c])
                nuc -= v
                nuc *= cov
                v += nuc
            planes.append(v)
        return planes

    def _render_industrial(self, x0, y0, xs, ys, d) -> list[np.ndarray]:
        shape = (ys.size, xs.size)
        grey = self._light.grid(xs, ys)
        grey *= 14.0
        grey += _METAL
        grey += 7.0 * self._brush.sample(xs, ys, d)
        grey += 3.0 * self._grain.sample(xs, ys, d)
        planes = [grey * float(t) for t in _METAL_TINT]
        if d >= _INDUSTRIAL_NO_DEFECTS_DOWNSAMPLE:
            return planes
        objs = self._window_objects(x0, y0, xs, ys, d)
        for bright, colour in ((False, _DARK), (True, _BRIGHT)):
            sel = objs.bright == bright
            if sel.any():
                cov = coverage(objs, sel, x0, y0, shape, d, self._max_half_extent)
                for v in planes:
                    v += cov * (colour - v)
        return planes
