"""A run's first steps, made ahead: the slide opened, its tiling, tissue mask and the tiles to run.

:meth:`~.pipeline.Pipeline.plan` makes a :class:`SlidePlan` (e.g. on another thread while the previous
slide runs) and :meth:`~.pipeline.Pipeline.run` takes it; :func:`make_plan` does the steps for a card and
its settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import slide_warnings
from .config import RunConfig
from .errors import SlideError
from .geometry import TilingGeometry
from .inference.card_spec import ModelCard
from .slide import Slide, as_slide
from .stages import StageTimer
from .stitch import blend
from .stitch.blend import BlendGeometry, band_bytes
from .tiling import TileGrid, tissue_mask
from .tiling.grid import Tile


@dataclass
class SlidePlan:
    """A run's first steps, made ahead (:meth:`Pipeline.plan`): the slide opened, its tiling, tissue mask
    and the tiles to run. Give it to :meth:`Pipeline.run` of the pipeline that made it (once), or
    :meth:`close` it.

    ``seconds``: what the steps took (``open``, ``tissue_mask``), counted in the run's summary.
    """

    slide: Slide
    owns: bool  # the plan opened the slide: the run (or close) closes it
    is_array: bool
    geometry: TilingGeometry
    grid: TileGrid
    method: str
    mask: Any
    tiles: list[Tile]
    seconds: dict[str, float] = field(default_factory=dict)
    made_by: Any = None  # the pipeline that made it: its card and settings decided the tiling
    warnings: list[str] = field(default_factory=list)  # about the slide, while the plan was made
    file_stamp: tuple[int, ...] | None = None  # the slide file's (size, mtime, inode) before it was opened

    def close(self) -> None:
        if self.owns:
            self.slide.close()

    def file_changed(self) -> bool:
        """Whether the slide file was replaced or rewritten since the plan opened it."""
        return self.file_stamp is not None and file_stamp(self.slide.path) != self.file_stamp


def file_stamp(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """(size, mtime, inode) of a slide file, or None where there is none to stat."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def make_plan(
    source: str | os.PathLike[str] | Slide | np.ndarray,
    card: ModelCard,
    cfg: RunConfig,
    timer: StageTimer,
    made_by: Any = None,
) -> SlidePlan:
    """Open ``source``, tile it for ``card`` and ``cfg`` and find its tissue, timed as ``open`` and
    ``tissue_mask``; a slide opened here is closed again if a later step fails."""
    owns = not isinstance(source, Slide)
    stamp = file_stamp(source) if isinstance(source, str | os.PathLike) else None
    said: list[str] = []
    with slide_warnings.recording(said):
        with timer("open"):
            slide = as_slide(source)
        try:
            slide.on_damaged_tile = cfg.on_damaged_tile
            slide.reduced_decode = cfg.resample == "reduced"
            with timer("tissue_mask"):
                geometry = plan_geometry(slide, card, cfg)
                grid = TileGrid(slide, geometry=geometry)
                method = cfg.tissue if cfg.tissue != "auto" else ("otsu" if card.mpp is not None else "all")
                mask = tissue_mask(slide, method, mask_path=cfg.mask)
                tiles = grid.select(mask.tile_fractions(grid), cfg.min_tissue)
        except BaseException:
            if owns:
                slide.close()
            raise
    return SlidePlan(
        slide,
        owns,
        isinstance(source, np.ndarray),
        geometry,
        grid,
        method,
        mask,
        tiles,
        made_by=made_by,
        warnings=said,
        file_stamp=stamp,
    )


def plan_geometry(slide: Slide, card: ModelCard, cfg: RunConfig) -> TilingGeometry:
    """The slide's tiling: the card's tile and heatmap stride, the config's level or mpp, else the card's mpp.

    Raises:
        SlideError: the slide is so wide for its height that a heatmap band would not fit in memory,
            or its heatmap would hold more than ``blend.MAX_HEATMAP_PIXELS`` a class.
    """
    geometry = TilingGeometry.for_slide(
        slide,
        card.input.size_hw[0],
        cfg.overlap,
        level=cfg.level,
        mpp=cfg.mpp,
        preferred_mpp=card.mpp if cfg.level is None and cfg.mpp is None else None,
        heatmap_stride=card.heatmap.stride if card.heatmap is not None else None,
    )
    warn_other_resolution(slide, card, cfg, geometry)
    if card.heatmap is not None:
        need = band_bytes(BlendGeometry.from_tiling(geometry), len(card.heatmap.classes))
        if need > blend.MAX_BAND_BYTES:
            w, h = slide.dimensions
            raise SlideError(
                slide.path,
                f"{w} x {h} px: the heatmap is blended in bands as wide as the slide, and this slide's "
                f"band would need {need / 2**30:.1f} GiB (at most {blend.MAX_BAND_BYTES / 2**30:.1f} GiB): "
                "a slide this wide for its height is refused",
            )
        hw, hh = geometry.heatmap_width, geometry.heatmap_height
        if hw * hh > blend.MAX_HEATMAP_PIXELS:
            w, h = slide.level_dimensions[geometry.level]
            raise SlideError(
                slide.path,
                f"level {geometry.level} claims {w} x {h} px: its heatmap at stride {card.heatmap.stride} would be "
                f"{hw} x {hh} px ({hw * hh / 2**30:.1f} G px a class; at most {blend.MAX_HEATMAP_PIXELS / 2**30:g} "
                "G px, made and written whether tiles run there or not: a sparse or forged matrix?); read it at a "
                "coarser --mpp or --level, or with a model without a heatmap",
            )
    return geometry


# Relative difference from the card's mpp past which a resolution the settings chose is another
# resolution than the model's: scanners of one nominal magnification differ by a few percent.
OTHER_RESOLUTION_RTOL = 0.05


def warn_other_resolution(slide: Slide, card: ModelCard, cfg: RunConfig, geometry: TilingGeometry) -> None:
    """Warn (for the slide's summary) where the config's ``mpp`` or ``level`` reads the slide at
    another resolution than the model card's, naming both; a model without an mpp takes any."""
    if card.mpp is None or (cfg.mpp is None and cfg.level is None):
        return  # the card's own resolution: read_resolution warns where the slide cannot give it
    chose = f"mpp = {cfg.mpp:g}" if cfg.mpp is not None else f"level = {cfg.level}"
    if slide.mpp is None:
        slide_warnings.warn(
            f"{slide.path}: read at level {geometry.level} ({chose}), whose resolution is unknown; "
            f"the model {card.name} was made for {card.mpp:.4g} um/px"
        )
        return
    read_mpp = float(slide.mpp[0]) * geometry.downsample
    if abs(read_mpp - card.mpp) > OTHER_RESOLUTION_RTOL * card.mpp:
        slide_warnings.warn(
            f"{slide.path}: read at {read_mpp:.4g} um/px ({chose}), but the model {card.name} was made for "
            f"{card.mpp:.4g} um/px: its detections may be fewer or wrong at another resolution"
        )
