"""Stored JPEG tiles as a stored-tile reader hands them out: checked, told the container's colour
space, decoded with damage reported, and as self-contained streams for the GPU decoders.

:class:`StoredJpegTiles` is the part of :class:`~.stored_tiles.StoredTileSlide` that knows JPEG;
the stream rules themselves (markers, telling, tables) are in :mod:`.jpeg_kind`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import simplejpeg

from ..errors import SlideError, TileReadError
from .base import Slide
from .jpeg_kind import (
    JpegKind,
    ends_with_eoi,
    jpeg_kind,
    read_header,
    same_headers,
    stream_parts,
    told_stream,
    with_tables,
)


class StoredJpegTiles(Slide):
    """The JPEG side of a stored-tile reader. Subclasses give ``_levels`` (each with ``offsets``,
    ``bytecounts``, ``tiles_across`` and ``jpegtables``), :meth:`_level_fd`, :meth:`_jpeg_level`,
    :meth:`raw_tile`, :meth:`_tile_origin_level0` and, where the container names one,
    :meth:`_stored_colour`."""

    _levels: Sequence[Any]

    def _level_fd(self, level: int) -> int:
        raise NotImplementedError

    def _jpeg_level(self, level: int) -> Any:
        raise NotImplementedError

    def raw_tile(self, level: int, tx: int, ty: int) -> bytes:
        raise NotImplementedError

    def _tile_origin_level0(self, level: int, tx: int, ty: int) -> tuple[int, int]:
        raise NotImplementedError

    def raw_tiles_jpeg(self, level: int, tiles: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`raw_tile_jpeg` of many stored tiles, back to back (see :meth:`Slide.raw_tiles_jpeg`).

        Stored tiles usually lie in the file in row order: the byte span of
        the ones asked for is read with one ``pread`` when it is at most
        four times their bytes or 16 MiB (and at most 256 MiB), else each
        tile on its own; the streams are then assembled from slices of that
        read in one concatenation. (Bytes read past what is asked cost a
        copy from the page cache; a read per tile costs a call and Python
        work per tile: 5,183 such reads took 0.12 s of a GPU run whose JPEG
        helpers had every other few tiles of each row, benchmarks/HISTORY.md.)
        A stream whose headers are those of the level's first stored tile
        is used as it is; any other is checked and told the container's
        colour space one by one (:meth:`_told_jpeg`); one without its
        end-of-image marker is reported as damaged, as the CPU decoder
        reports it.
        """
        lv = self._jpeg_level(level)
        if not tiles:
            return np.zeros(0, np.uint8), np.zeros(0, np.int64)
        idx = np.array([ty * lv.tiles_across + tx for tx, ty in tiles], np.int64)
        offsets = lv.offsets[idx].astype(np.int64)
        counts = lv.bytecounts[idx].astype(np.int64)
        has = counts > 0
        if not has.any():
            return np.zeros(0, np.uint8), np.zeros(len(tiles), np.int64)
        start = int(offsets[has].min())
        span = int((offsets + counts)[has].max()) - start
        if span > max(4 * int(counts.sum()), 1 << 24) or span > 1 << 28:
            return super().raw_tiles_jpeg(level, tiles)
        buf = np.frombuffer(os.pread(self._level_fd(level), span, start), np.uint8)
        if len(buf) < span:
            raise SlideError(self.path, f"level {level}: the file ends inside its stored tiles")
        rel = np.where(has, offsets - start, 0)
        for k in np.flatnonzero(has & ~ends_with_eoi(buf, rel, counts)):
            self._report_truncated(level, *tiles[k])
        same = same_headers(buf, rel, counts, self._jpeg_reference(level))
        tables = None if lv.jpegtables is None else np.frombuffer(lv.jpegtables, np.uint8)
        parts: list = []
        lengths = np.zeros(len(tiles), np.int64)
        for k, (o, n) in enumerate(zip(rel.tolist(), counts.tolist(), strict=True)):
            if not n:
                continue
            if same[k]:
                pieces = stream_parts(tables, buf[o : o + n])
            else:
                tx, ty = tiles[k]
                whole = with_tables(lv.jpegtables, buf[o : o + n].tobytes())
                pieces = (np.frombuffer(self._told_jpeg(level, tx, ty, whole), np.uint8),)
            parts.extend(pieces)
            lengths[k] = sum(len(p) for p in pieces)
        return np.concatenate(parts), lengths

    def raw_tile_jpeg(self, level: int, tx: int, ty: int) -> bytes:
        """Tile (tx, ty) as a self-contained JPEG stream (JPEGTables spliced in), told the
        container's colour space (:meth:`_told_jpeg`); a stream without its end-of-image marker is
        reported as damaged.

        TIFF JPEG tiles usually share their tables in the JPEGTables tag;
        a standalone decoder (such as a GPU one) needs them inside the stream.
        """
        data = self.raw_tile(level, tx, ty)
        if not data:
            return data
        if not data.endswith((b"\xff\xd9", b"\xff\xd9\x00")):  # EOI, or EOI and DICOM's pad byte
            self._report_truncated(level, tx, ty)
        return self._told_jpeg(level, tx, ty, with_tables(self._jpeg_level(level).jpegtables, data))

    def _tile_error(self, level: int, tx: int, ty: int, message: str) -> TileReadError:
        """A :class:`TileReadError` naming this slide, ``message`` and where stored tile (tx, ty) of
        ``level`` lies."""
        return TileReadError(self.path, message, self._tile_origin_level0(level, tx, ty), level)

    def _report_truncated(self, level: int, tx: int, ty: int) -> None:
        origin = self._tile_origin_level0(level, tx, ty)
        self._damage.report(level, tx, ty, origin, "the JPEG stream ends without its end-of-image marker (truncated)")

    def _jpeg_reference(self, level: int) -> np.ndarray | None:
        """The header bytes (up to the first scan) of ``level``'s first stored tile where that tile
        needs no telling (:meth:`_told_jpeg` leaves it as it is); None otherwise. Tiles with the same
        header bytes are used as they are. Cached per level."""
        refs = self.__dict__.setdefault("_jpeg_references", {})
        if level not in refs:  # threads arriving together each work it out; the result is the same
            found = None
            lv = self._levels[level]
            nonempty = np.flatnonzero(lv.bytecounts)
            if len(nonempty):
                i = int(nonempty[0])
                data = os.pread(self._level_fd(level), min(int(lv.bytecounts[i]), 1 << 16), int(lv.offsets[i]))
                with contextlib.suppress(ValueError):
                    header = read_header(data)
                    whole = with_tables(lv.jpegtables, data)
                    colour = self._stored_colour(level)
                    if colour is None or told_stream(whole, colour) is whole:
                        found = np.frombuffer(data[: header.scan_at], np.uint8).copy()
            refs[level] = found
        return refs[level]

    def _stored_jpeg_kind(self, level: int, photometric: str) -> JpegKind | None:
        """The kind of JPEG ``level``'s first stored tile holds, told by the container's
        ``photometric`` (what libtiff, OpenSlide and tifffile decode by) and the stream's markers;
        None where no tile is stored or its headers are unreadable."""
        lv = self._levels[level]
        nonempty = np.flatnonzero(lv.bytecounts)
        if not len(nonempty):
            return None
        i = int(nonempty[0])
        # The headers before the first scan: the shared tables (spliced in) and a tile's own segments.
        data = os.pread(self._level_fd(level), min(int(lv.bytecounts[i]), 1 << 16), int(lv.offsets[i]))
        try:
            return jpeg_kind(with_tables(lv.jpegtables, data), photometric)
        except ValueError:
            return None

    def _stored_colour(self, level: int) -> str | None:
        """The colour space the container gives ``level``'s JPEG tiles (``"rgb"``, ``"ycbcr"``), which
        decides it whatever a stream's markers say (:func:`~.jpeg_kind.told_stream`); None where
        the container does not say."""
        return None

    def _tile_name(self, level: int, tx: int, ty: int) -> str:
        """How stored tile (tx, ty) of ``level`` is named in messages."""
        return f"stored tile ({tx}, {ty}) of level {level}"

    def _told_jpeg(self, level: int, tx: int, ty: int, jpeg: bytes) -> bytes:
        """A stored tile's self-contained stream, checked (8-bit samples, readable headers) and told
        the container's colour space (:func:`~.jpeg_kind.told_stream`); TileReadError where it
        cannot be decoded as the level's pixels."""
        where = f"cannot decode {self._tile_name(level, tx, ty)}"
        try:
            header = read_header(jpeg)
        except ValueError as exc:
            raise self._tile_error(level, tx, ty, f"{where}: unreadable JPEG headers ({exc})") from exc
        if header.precision != 8:
            raise self._tile_error(
                level,
                tx,
                ty,
                f"{where}: a {header.precision}-bit JPEG stream; expected 8-bit samples as the container says",
            )
        colour = self._stored_colour(level)
        return jpeg if colour is None else told_stream(jpeg, colour, header)

    def _decode_jpeg_checked(self, level: int, tx: int, ty: int, data: bytes, out: np.ndarray) -> np.ndarray:
        """Decode a JPEG tile into ``out`` with simplejpeg (libjpeg-turbo) in the container's colour
        space, reporting corrupt data as damage (:mod:`.damage`).

        Raises TileReadError where the stream is not an 8-bit JPEG of the tile's size or does not
        decode at all.
        """
        lv = self._levels[level]
        refs = self.__dict__.setdefault("_jpeg_reference_bytes", {})
        ref = refs.get(level)
        if ref is None:
            array = self._jpeg_reference(level)
            ref = refs[level] = b"" if array is None else array.tobytes()
        if ref and data[: len(ref)] == ref:
            # The headers of the level's first tile, already checked and in the container's colour space.
            jpeg = with_tables(lv.jpegtables, data)
        else:
            jpeg = self._told_jpeg(level, tx, ty, with_tables(lv.jpegtables, data))
        # An ``out`` smaller than the tile asks for a reduced decode (DCT scaling to its size).
        reduce = (
            {} if out.shape[:2] == (lv.tile_h, lv.tile_w) else {"min_height": out.shape[0], "min_width": out.shape[1]}
        )
        damage = None
        try:
            img = simplejpeg.decode_jpeg(jpeg, buffer=out, strict=True, **reduce)
        except ValueError as exc:  # corrupt data: decode again, ignoring what can be ignored
            damage = str(exc)
            try:
                img = simplejpeg.decode_jpeg(jpeg, buffer=out, strict=False, **reduce)
            except ValueError as exc2:
                raise self._tile_error(
                    level, tx, ty, f"cannot decode {self._tile_name(level, tx, ty)}: {exc2}"
                ) from exc2
        if img.shape != out.shape:
            raise self._tile_error(
                level,
                tx,
                ty,
                f"{self._tile_name(level, tx, ty)} is a {img.shape[1]}x{img.shape[0]} JPEG; "
                f"expected {out.shape[1]}x{out.shape[0]} ({lv.tile_w}x{lv.tile_h} as the level's tiles)",
            )
        if damage is not None:
            self._damage.report(level, tx, ty, self._tile_origin_level0(level, tx, ty), damage)
        return out
