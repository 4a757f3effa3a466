"""Tiling: the tile grid, tissue masks and the streaming loader."""

from .grid import DEFAULT_OVERLAP, DEFAULT_TILE_SIZE, Tile, TileGrid, read_tile
from .loader import Batch, TileLoader
from .tissue import TissueMask, mask_from_file, otsu_tissue_mask, tissue_mask

__all__ = [
    "Tile",
    "TileGrid",
    "read_tile",
    "DEFAULT_TILE_SIZE",
    "DEFAULT_OVERLAP",
    "Batch",
    "TileLoader",
    "TissueMask",
    "tissue_mask",
    "otsu_tissue_mask",
    "mask_from_file",
]
