"""Heatmaps as OME-Zarr (NGFF) multiscale images, written as the blender streams rows.

Layout of the directory (what napari-ome-zarr, QuPath and the OME-NGFF
validator read):

- One zarr group, NGFF **0.4** on **Zarr v2** by default (``ngff_version="0.5"``
  writes NGFF 0.5 on Zarr v3 instead). 0.4 is the default because it is the
  version every current viewer opens: QuPath 0.6 reads OME-Zarr through
  Bio-Formats' OME-Zarr reader, built on Zarr v2 (the Bio-Formats
  converters still write 0.4 only), and napari-ome-zarr reads both 0.4 and
  0.5 (0.5 only with ome-zarr >= 0.12), vizarr both. ome-zarr-py's own reader
  asks for 0.5 unless told otherwise and logs a "version mismatch" for 0.4:
  ``parse_url(path, fmt=FormatV04())`` reads it without one.
- Arrays ``0``, ``1``, ... : the pyramid, axes ``c, y, x``, level 0 the full
  heatmap, each next level the 2x2 mean of the one before (sizes rounded up)
  until a level fits in one tile. Chunks are ``1 x tile x tile``, Blosc-zstd
  compressed (lossless), chunk keys ``/``-separated as NGFF asks.
- ``multiscales`` metadata: axes (``c`` channel, ``y``/``x`` space, in
  micrometres when the physical size is known) and, per level, a ``scale``
  coordinate transformation: ``[1, py * 2**k, px * 2**k]`` µm per pixel
  (pixel units, no unit, when the physical size is unknown).
- ``omero`` metadata: one channel per class with its name (``label``), a
  colour and a display window over the stored range.
- ``wsi_pipeline`` attributes: ``value_scale`` and ``stored_dtype``:
  ``value = stored * value_scale`` (uint8 probabilities are stored as 0..255
  with scale 1/255, as in :mod:`wsi_pipeline.io.ome_tiff`).

Memory: rows are buffered until a full band of ``tile`` rows is there; the
band is written to level 0 and its 2x2 mean handed to level 1's band buffer,
and so on down the pyramid, so no level is ever held whole: RAM is about two
bands of ``C x tile x width`` per level (about 2 x 2 x 256 x 20,000 bytes for
a two-class heatmap 20,000 wide).

The directory is written under a temporary name beside the output
(``.NAME.partial-PID``) and renamed into place on :meth:`close`; the NGFF
metadata is only written at close, so even the temporary directory never
reads as a complete image. :meth:`abort` deletes it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from ome_zarr.format import FormatV04, FormatV05

with warnings.catch_warnings():
    # ome-zarr >= 0.14 builds a deprecated Scaler as a default argument when ome_zarr.writer is
    # imported: a warning about its own signature, not about a call made here (the pyramid is
    # built by this module; only the metadata writer is used), which every run would show.
    warnings.filterwarnings("ignore", "Call to deprecated class Scaler", DeprecationWarning)
    from ome_zarr.writer import write_multiscales_metadata

from wsi_pipeline.io.atomic import partial_name, replace_tree
from wsi_pipeline.io.heatmap_rows import HeatmapRowWriter, halve, pyramid_shapes, quantise

NGFF_VERSIONS = ("0.4", "0.5")
# What a run writes (module docstring: the version QuPath 0.6, napari and vizarr all open).
DEFAULT_NGFF_VERSION = "0.4"
# Colours given to channels without one (hex RGB, as the omero metadata wants them).


class _Level:
    """One pyramid level: a band buffer of ``band_rows`` rows in front of its zarr array."""

    def __init__(self, array: Any, band_rows: int, child: _Level | None):
        self.array = array
        self.child = child
        c, _, w = array.shape
        self.buf = np.empty((c, band_rows, w), array.dtype)
        self.fill = 0
        self.y = 0

    def add(self, rows: np.ndarray) -> None:
        i, n, band_rows = 0, rows.shape[1], self.buf.shape[1]
        while i < n:
            take = min(band_rows - self.fill, n - i)
            self.buf[:, self.fill : self.fill + take] = rows[:, i : i + take]
            self.fill += take
            i += take
            if self.fill == band_rows:
                self._flush()

    def _flush(self) -> None:
        if not self.fill:
            return
        band = self.buf[:, : self.fill]
        self.array[:, self.y : self.y + self.fill, :] = band
        self.y += self.fill
        if self.child is not None:
            self.child.add(halve(band))
        self.fill = 0

    def finish(self) -> None:
        self._flush()
        if self.child is not None:
            self.child.finish()


class OmeZarrHeatmapWriter(HeatmapRowWriter):
    """Write a C x H x W heatmap, arriving as row bands, to a multiscale OME-Zarr directory.

    The same interface as :class:`wsi_pipeline.io.ome_tiff.OmeTiffHeatmapWriter`:
    call it as ``writer(y0, rows)`` with rows ``C x h x width`` float32
    (probabilities in [0, 1] for the shipped models), top to bottom; then
    ``close()`` (or use it as a context manager: an exception aborts and
    leaves nothing).

    Args:
        path: output directory, conventionally ``*.ome.zarr``.
        width, height: heatmap size in heatmap pixels.
        channels: C; channel_names: C names (default ``channel_0``...).
        physical_size_um: (x, y) µm per heatmap pixel (slide mpp x heatmap
            scale in level-0 pixels), or None when unknown.
        tile: chunk side and pyramid stop size (multiple of 16).
        dtype: stored type, ``"uint8"``, ``"uint16"`` or ``"float32"``.
        value_scale: ``value = stored * value_scale``; default 1/255 for
            uint8, 1/65535 for uint16, 1 for float32.
        levels: ``"auto"`` (halve until one tile) or the number of levels.
        channel_colors: C colours (``"#rrggbb"`` or [r, g, b]) for the viewers.
        ngff_version: ``"0.4"`` (Zarr v2, the default) or ``"0.5"`` (Zarr v3).
        clevel: Blosc-zstd compression level (1-9).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        width: int,
        height: int,
        channels: int,
        channel_names: Sequence[str] | None = None,
        physical_size_um: tuple[float, float] | None = None,
        tile: int = 256,
        dtype: str | np.dtype = "uint8",
        value_scale: float | None = None,
        levels: int | str = "auto",
        channel_colors: Sequence[str | Sequence[int]] | None = None,
        ngff_version: str = DEFAULT_NGFF_VERSION,
        clevel: int = 5,
    ) -> None:
        self._init_heatmap(
            path, width, height, channels, channel_names, physical_size_um, tile, dtype, value_scale, channel_colors
        )
        if ngff_version not in NGFF_VERSIONS:
            raise ValueError(f"{self.path}: ngff_version expected one of {NGFF_VERSIONS}, found {ngff_version!r}")
        self.ngff_version = ngff_version
        self.shapes = pyramid_shapes(self.height, self.width, self.tile, levels)
        self._fmt = FormatV04() if ngff_version == "0.4" else FormatV05()
        self._tmp = partial_name(self.path)
        if self._tmp.exists():
            shutil.rmtree(self._tmp)
        self._group = zarr.open_group(str(self._tmp), mode="w", zarr_format=self._fmt.zarr_format)
        arrays = [self._create_array(k, shape, clevel) for k, shape in enumerate(self.shapes)]
        child: _Level | None = None
        for array in reversed(arrays):
            child = _Level(array, self.tile, child)
        self._level0 = child

    def _create_array(self, k: int, shape: tuple[int, int], clevel: int) -> Any:
        options: dict[str, Any] = {
            "shape": (self.channels, *shape),
            "chunks": (1, min(self.tile, shape[0]), min(self.tile, shape[1])),
            "dtype": self.dtype,
            "fill_value": 0,
        }
        if self._fmt.zarr_format == 2:
            from numcodecs import Blosc

            options["compressors"] = Blosc(cname="zstd", clevel=clevel, shuffle=Blosc.SHUFFLE)
            options["chunk_key_encoding"] = {"name": "v2", "separator": "/"}
        else:
            from zarr.codecs import BloscCodec

            options["compressors"] = BloscCodec(cname="zstd", clevel=clevel, shuffle="shuffle")
            options["dimension_names"] = ("c", "y", "x")
        return self._group.create_array(str(k), **options)

    # -- streaming -------------------------------------------------------
    def write_rows(self, y0_out: int, rows: np.ndarray) -> None:
        """Same as calling the writer."""
        rows, y1 = self._check_rows(y0_out, rows)
        self._level0.add(quantise(rows, self.dtype, self.value_scale))
        self._next_row = y1

    # -- finishing --------------------------------------------------------
    def close(self) -> Path:
        """Write the last bands and the NGFF metadata, move the directory into place; returns its path."""
        if not self._must_finish():
            return self.path
        try:
            self._level0.finish()
            self._write_metadata()
            replace_tree(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._level0 = None  # type: ignore[assignment]
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; no output is made."""
        self._finished = True
        self._level0 = None  # type: ignore[assignment]
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _write_metadata(self) -> None:
        px, py = self.physical_size_um if self.physical_size_um is not None else (1.0, 1.0)
        unit = {"unit": "micrometer"} if self.physical_size_um is not None else {}
        axes = [
            {"name": "c", "type": "channel"},
            {"name": "y", "type": "space", **unit},
            {"name": "x", "type": "space", **unit},
        ]
        datasets = [
            {"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": [1.0, py * 2**k, px * 2**k]}]}
            for k in range(len(self.shapes))
        ]
        # The display window spans the stored range of probabilities 0..1 (the whole range of an integer type).
        stored_max = float(np.iinfo(self.dtype).max if self.dtype.kind == "u" else 1.0 / self.value_scale)
        window = {"min": 0.0, "max": stored_max, "start": 0.0, "end": stored_max}
        omero = {
            "name": self.path.name.split(".")[0],
            "channels": [
                {"label": n, "color": c, "window": dict(window), "active": True}
                for n, c in zip(self.channel_names, self.channel_colors, strict=True)
            ],
            "rdefs": {"model": "color"},
        }
        write_multiscales_metadata(
            self._group,
            datasets,
            fmt=self._fmt,
            axes=axes,
            name=omero["name"],
            metadata={
                "omero": omero,
                "method": "2x2 mean of the stored values, rounded to nearest",
                "description": "each level halves the one before (sizes rounded up, last row/column repeated)",
            },
        )
        self._group.attrs["wsi_pipeline"] = {
            "value_scale": self.value_scale,
            "value_offset": 0.0,
            "value_formula": "value = stored * value_scale",
            "stored_dtype": self.dtype.name,
        }
