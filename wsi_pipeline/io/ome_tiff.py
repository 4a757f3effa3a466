"""Pyramidal tiled OME-TIFF heatmaps, written as the blender streams rows.

Layout of the file (what QuPath / Bio-Formats read):

- One OME image, axes ``CYX``: one TIFF page per channel (class), each page
  tiled (default 256 x 256), deflate-compressed (``zlib``, TIFF compression 8:
  lossless, read by Bio-Formats, QuPath, OpenSlide's TIFF reader, libtiff).
- The reduced resolutions of each page are in its SubIFDs (2x per level,
  2x2 mean), as the OME-TIFF pyramid convention asks; BigTIFF when the raw
  data could pass 2 GiB.
- OME metadata: channel names, PhysicalSizeX/Y in µm (slide mpp x downsample
  x heatmap stride, see
  :meth:`~wsi_pipeline.geometry.TilingGeometry.heatmap_pixel_size_um`), and a
  MapAnnotation whose ``value_scale`` says how stored values map to the
  model's output: ``value = stored * value_scale`` (uint8 probabilities are
  stored as 0..255 with scale 1/255).

Memory: tifffile must write a page's SubIFDs right after the page, and
every level needs all of level 0, so the file cannot be written while rows
arrive. Rows are spooled instead into an uncompressed ``.npy`` memmap in the
stored dtype (a 100k x 100k slide at stride 8 is 12.5k x 12.5k, 156 MB per
uint8 channel), the reduced levels are computed band by band into further
memmaps (1/3 of level 0 together), and on ``close()`` the pages are written
from tile generators over those memmaps. RAM stays at a few tiles and bands;
the spool needs about 1.4x the raw heatmap on disk, beside the output unless
``spool_dir`` says otherwise, reserved when each spool file is made (a full disk is an
``OSError`` then, not a SIGBUS at a store into the mapping: :mod:`.spool`). The file is written
under a temporary name and moved into place with ``os.replace``, so a reader never sees half a file.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tifffile

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.atomic import partial_name
from wsi_pipeline.io.heatmap_rows import HeatmapRowWriter, halve, pyramid_shapes, quantise
from wsi_pipeline.io.ome_xml import OmePixels, read_ome_pixels
from wsi_pipeline.io.spool import spool_array


def _ome_colors(colors: Sequence[str]) -> dict[str, list[int]]:
    """``{"Color": [...]}`` of the OME-XML channels: RGBA packed in a signed 32-bit int, as OME wants."""
    if not colors:
        return {}
    return {"Color": [int(np.array([(int(c, 16) << 8) | 0xFF], np.uint32).view(np.int32)[0]) for c in colors]}


# Output rows of a reduced level computed at a time when building the pyramid.
_BAND_ROWS = 64
# Spool pages this process may keep mapped before handing them back to the page cache.
_RESIDENT_BYTES = 32 * 1024 * 1024


def _drop_pages(array: np.ndarray) -> None:
    """Unmap a spool memmap's pages from this process, keeping their data.

    The spool is a shared file mapping: pages touched while rows arrive (and
    read back while the file is written) would otherwise count towards the
    process's resident memory until the end, growing with the heatmap.
    On Linux, MADV_DONTNEED on a shared file mapping keeps the data (dirty
    pages stay in the page cache, the next access maps them again), so the
    pages are not written out first: the spool is removed once the file is
    written, and ``mmap.flush`` (msync) holds the interpreter lock while the
    disk writes, stalling every other thread of a run. Elsewhere they are
    written to the file before being dropped.
    """
    mm = getattr(array, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if not sys.platform.startswith("linux"):
        array.flush()
    mm.madvise(mmap.MADV_DONTNEED)


class OmeTiffHeatmapWriter(HeatmapRowWriter):
    """Write a C x H x W heatmap, arriving as row bands, to a pyramidal OME-TIFF.

    Usable as :class:`wsi_pipeline.stitch.HeatmapBlender`'s sink: call it as
    ``writer(y0, rows)`` with rows C x h x width float32, top to bottom; then
    ``close()`` (or use it as a context manager: an exception aborts and
    leaves no file).

    Args:
        path: output file, conventionally ``*.ome.tif``.
        width, height: heatmap size in heatmap pixels.
        channels: C; channel_names: C names (default ``channel_0``...).
        physical_size_um: (x, y) µm per heatmap pixel, or None when unknown
            (industrial images).
        tile: TIFF tile side (multiple of 16).
        dtype: stored type, ``"uint8"``, ``"uint16"`` or ``"float32"``.
        value_scale: ``value = stored * value_scale``; default 1/255 for
            uint8, 1/65535 for uint16 (values in [0, 1] use the full range,
            others are clipped), 1 for float32.
        levels: ``"auto"`` (down to one tile) or the number of levels.
        compression: ``"zlib"`` (deflate, the safest for QuPath/Bio-Formats)
            or ``"zstd"``.
        spool_dir: directory for the temporary spool (default: the output's).
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
        compression: str = "zlib",
        spool_dir: str | os.PathLike[str] | None = None,
        channel_colors: Sequence[str | Sequence[int]] | None = None,
    ) -> None:
        self._init_heatmap(
            path, width, height, channels, channel_names, physical_size_um, tile, dtype, value_scale, channel_colors
        )
        if compression not in ("zlib", "zstd"):
            msg = f"{self.path}: compression expected 'zlib' or 'zstd', found {compression!r}"
            raise ValueError(msg)
        self.compression = compression
        self.shapes = pyramid_shapes(self.height, self.width, self.tile, levels)
        spool_parent = Path(spool_dir) if spool_dir is not None else (self.path.parent or Path("."))
        self._spool = Path(tempfile.mkdtemp(prefix=".heatmap-spool-", dir=spool_parent))
        try:
            self._level0 = spool_array(self._spool / "level0.npy", self.dtype, (self.channels, self.height, self.width))
        except BaseException:
            shutil.rmtree(self._spool, ignore_errors=True)
            raise
        self._next_row = 0
        self._unflushed = 0
        self._finished = False

    # -- streaming -------------------------------------------------------
    def write_rows(self, y0_out: int, rows: np.ndarray) -> None:
        """Same as calling the writer."""
        rows, y1 = self._check_rows(y0_out, rows)
        quantise(rows, self.dtype, self.value_scale, out=self._level0[:, y0_out:y1])
        self._unflushed += self._level0[:, y0_out:y1].nbytes
        if self._unflushed >= _RESIDENT_BYTES:
            _drop_pages(self._level0)
            self._unflushed = 0
        self._next_row = y1

    # -- finishing --------------------------------------------------------
    def spooled(self) -> SpooledHeatmap:
        """End the streaming and return what writes the file from the spool (no rows may follow).

        :meth:`SpooledHeatmap.write` builds the pyramid and writes the file; it
        may run in another process (the spool is a file, the object pickles).
        Whoever takes it writes it or calls :meth:`SpooledHeatmap.discard`.
        """
        if not self._must_finish():
            msg = f"{self.path}: the heatmap was already closed"
            raise WSIPipelineError(msg)
        if not sys.platform.startswith("linux"):
            self._level0.flush()  # Linux shares the page cache between processes: no write-out needed
        self._finished = True
        self._level0 = None  # type: ignore[assignment]  # unmapped here; the spool file keeps the rows
        return SpooledHeatmap(
            path=self.path,
            spool=self._spool,
            shapes=tuple(self.shapes),
            channels=self.channels,
            dtype=self.dtype.name,
            tile=self.tile,
            compression=self.compression,
            channel_names=tuple(self.channel_names),
            physical_size_um=self.physical_size_um,
            value_scale=self.value_scale,
            channel_colors=tuple(self.channel_colors),
        )

    def close(self) -> Path:
        """Build the pyramid, write the file, move it into place; returns its path."""
        if self._finished:
            return self.path
        return self.spooled().write()

    def abort(self) -> None:
        """Drop everything written so far; no output file is made."""
        self._finished = True
        self._level0 = None  # type: ignore[assignment]  # release the memmap before removing it
        shutil.rmtree(self._spool, ignore_errors=True)


@dataclass(frozen=True)
class SpooledHeatmap:
    """A streamed heatmap's spool (its level 0 as ``level0.npy``) and the settings of its file.

    Made by :meth:`OmeTiffHeatmapWriter.spooled`; :meth:`write` makes the
    file. It pickles, so that a writer process can write the file while the
    process that streamed the rows goes on with the next slide.
    """

    path: Path
    spool: Path
    shapes: tuple[tuple[int, int], ...]
    channels: int
    dtype: str
    tile: int
    compression: str
    channel_names: tuple[str, ...]
    physical_size_um: tuple[float, float] | None
    value_scale: float
    channel_colors: tuple[str, ...] = ()

    def write(self) -> Path:
        """Build the pyramid, write the file under a temporary name, move it into place, remove the
        spool (also on failure); returns the file's path."""
        tmp = partial_name(self.path)
        try:
            # Read back through the page cache: the rows need no flush to the spool file first.
            levels = [np.load(self.spool / "level0.npy", mmap_mode="r")]
            if levels[0].shape != (self.channels, *self.shapes[0]) or levels[0].dtype != np.dtype(self.dtype):
                msg = (
                    f"{self.path}: the heatmap spool holds {levels[0].dtype} {levels[0].shape}, "
                    f"expected {self.dtype} {(self.channels, *self.shapes[0])}"
                )
                raise WSIPipelineError(msg)
            for k, shape in enumerate(self.shapes[1:], start=1):
                levels.append(self._reduce(levels[-1], shape, self.spool / f"level{k}.npy"))
            self._write(tmp, levels)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            levels = []  # the memmaps closed before their files are removed
            self.discard()
        return self.path

    def discard(self) -> None:
        """Remove the spool without writing the file."""
        shutil.rmtree(self.spool, ignore_errors=True)

    def _reduce(self, src: np.ndarray, shape: tuple[int, int], path: Path) -> np.ndarray:
        """2x2 mean of ``src`` (C x H x W) into a new memmap of ``shape``, band by band."""
        h, w = shape
        dst = spool_array(path, self.dtype, (self.channels, h, w))
        src_h = src.shape[1]
        for y in range(0, h, _BAND_ROWS):
            y1 = min(y + _BAND_ROWS, h)
            dst[:, y:y1] = halve(np.asarray(src[:, 2 * y : min(2 * y1, src_h)]))[:, :, :w]
            if (y // _BAND_ROWS) % 64 == 63:
                _drop_pages(src)
                _drop_pages(dst)
        _drop_pages(src)
        _drop_pages(dst)
        return dst

    def _tiles(self, data: np.ndarray) -> Iterator[np.ndarray]:
        t = self.tile
        _, h, w = data.shape
        rows_per_drop = max(1, _RESIDENT_BYTES // (t * w * data.itemsize))
        for c in range(data.shape[0]):
            for k, y in enumerate(range(0, h, t)):
                if k and k % rows_per_drop == 0:
                    _drop_pages(data)
                for x in range(0, w, t):
                    block = np.asarray(data[c, y : y + t, x : x + t])
                    if block.shape != (t, t):
                        full = np.zeros((t, t), dtype=self.dtype)
                        full[: block.shape[0], : block.shape[1]] = block
                        block = full
                    yield block

    def _metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "axes": "CYX",
            "Name": self.path.name.split(".")[0],
            "Channel": {"Name": list(self.channel_names), **_ome_colors(self.channel_colors)},
            "MapAnnotation": {
                "value_scale": repr(self.value_scale),
                "value_offset": "0",
                "value_formula": "value = stored * value_scale",
                "stored_dtype": self.dtype,
            },
        }
        if self.physical_size_um is not None:
            px, py = self.physical_size_um
            meta.update(
                PhysicalSizeX=float(px), PhysicalSizeXUnit="µm", PhysicalSizeY=float(py), PhysicalSizeYUnit="µm"
            )
        return meta

    def _write(self, tmp: Path, levels: list[np.ndarray]) -> None:
        itemsize = np.dtype(self.dtype).itemsize
        raw_bytes = sum(a.size for a in levels) * itemsize
        options: dict[str, Any] = {
            "tile": (self.tile, self.tile),
            "compression": self.compression,
            "photometric": "minisblack",
            "dtype": self.dtype,
        }
        # Tiles are compressed by several threads (zlib and zstd release the GIL).
        options["maxworkers"] = min(8, os.cpu_count() or 1)
        height, width = self.shapes[0]
        with tifffile.TiffWriter(tmp, bigtiff=raw_bytes > 2**31, ome=True) as tif:
            for k, data in enumerate(levels):
                extra: dict[str, Any] = {}
                if self.physical_size_um is not None:
                    scale_x = width / data.shape[2]
                    scale_y = height / data.shape[1]
                    px, py = self.physical_size_um
                    extra["resolution"] = (1e4 / (px * scale_x), 1e4 / (py * scale_y))
                    extra["resolutionunit"] = "CENTIMETER"
                if k == 0:
                    extra["subifds"] = len(levels) - 1
                    extra["metadata"] = self._metadata()
                else:
                    extra["subfiletype"] = 1
                    extra["metadata"] = None
                tif.write(self._tiles(data), shape=data.shape, **options, **extra)


def write_spooled_heatmap(spooled: SpooledHeatmap) -> Path:
    """:meth:`SpooledHeatmap.write` as a module-level function (a writer-pool job)."""
    return spooled.write()


class HeatmapFile:
    """A heatmap OME-TIFF written by :class:`OmeTiffHeatmapWriter`, read lazily.

    ``shape`` is C x H x W of level 0; :meth:`read` returns one pyramid level
    as float32 values (``stored * value_scale``, probabilities for the
    shipped models); ``numpy.asarray(heatmap_file)`` reads level 0.
    Level 0 indexes like the C x H x W float32 array it holds:
    ``h[1]``, ``h[1, y0:y1, x0:x1]``, ``h[[0, 1], ::2]`` (only the channels
    asked for are read from the file); ``shape``, ``dtype``, ``ndim`` and
    ``len`` are the array's.

    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "h.ome.tif")
    >>> with OmeTiffHeatmapWriter(path, 64, 32, 1, ["tumour"], (2.0, 2.0)) as w:
    ...     w(0, np.full((1, 32, 64), 0.5, np.float32))
    >>> h = HeatmapFile(path)
    >>> h.shape, h.channel_names, h.physical_size_um
    ((1, 32, 64), ['tumour'], (2.0, 2.0))
    >>> round(float(h.read().mean()), 2)
    0.5
    >>> h[0, :2, :3].shape, h.dtype
    ((2, 3), dtype('float32'))
    """

    dtype = np.dtype(np.float32)
    ndim = 3

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            with tifffile.TiffFile(self.path) as tif:
                series = tif.series[0]
                self.level_shapes = [tuple(int(v) for v in lv.shape) for lv in series.levels]
                xml = tif.ome_metadata or ""
        except (OSError, tifffile.TiffFileError, IndexError) as exc:
            raise WSIPipelineError(f"{self.path}: not a readable heatmap OME-TIFF: {exc}") from exc
        try:
            ome = read_ome_pixels(xml) if xml else OmePixels()
            self.physical_size_um = ome.physical_size_um()
            self.value_scale = float(ome.annotations.get("value_scale", 1.0))
        except ValueError as exc:
            raise WSIPipelineError(f"{self.path}: not a readable heatmap OME-TIFF: {exc}") from exc
        self.channel_names = ome.channel_names
        # A one-channel file reads as YX: keep the documented C x H x W.
        c = max(1, len(self.channel_names))
        self.level_shapes = [s if len(s) == 3 else (c, *s[-2:]) for s in self.level_shapes]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.level_shapes[0]

    @property
    def level_count(self) -> int:
        return len(self.level_shapes)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, level: int = 0, channels: Sequence[int] | None = None) -> np.ndarray:
        """Level ``level`` (0 = full size) as C x h x w float32 values; ``channels``: only those, in that order."""
        if not 0 <= level < len(self.level_shapes):
            raise WSIPipelineError(f"{self.path}: level {level} does not exist ({len(self.level_shapes)} levels)")
        c, h, w = self.level_shapes[level]
        wanted = range(c) if channels is None else [int(i) for i in channels]
        with tifffile.TiffFile(self.path) as tif:
            level_series = tif.series[0].levels[level]
            if channels is None:
                data = level_series.asarray().reshape(c, h, w)
            else:  # one page per channel: read only the pages asked for
                data = (
                    np.stack([level_series.pages[i].asarray().reshape(h, w) for i in wanted])
                    if len(wanted)
                    else np.zeros((0, h, w), level_series.dtype)
                )
        return data.astype(np.float32) * np.float32(self.value_scale)

    def __getitem__(self, key: Any) -> np.ndarray:
        """numpy indexing of level 0, reading only the channels the first index selects."""
        key = key if isinstance(key, tuple) else (key,)
        first, rest = (key[0], key[1:]) if key else (slice(None), ())
        if first is Ellipsis or first is None:
            return self.read(0)[key]
        try:
            selected = np.arange(self.shape[0])[first]  # raises IndexError as an array would
        except IndexError as exc:
            raise IndexError(f"{self.path}: {exc}") from None
        if isinstance(first, slice):  # basic indexing: keep it basic on the channels read
            return self.read(0, np.atleast_1d(selected))[(slice(None), *rest)]
        wanted = np.unique(selected)
        positions = np.searchsorted(wanted, selected)  # same shape as ``selected``: int or array
        return self.read(0, wanted)[(positions, *rest)]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.read(0)
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"HeatmapFile({str(self.path)!r}, shape={self.shape}, levels={self.level_count})"
