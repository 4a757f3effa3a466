"""Stored JPEG tiles as a stored-tile reader hands them out: checked, told the container's colour
space, decoded with damage reported, and as self-contained streams for the GPU decoders.

:class:`StoredJpegTiles` is the part of :class:`~.stored_tiles.StoredTileSlide` that knows JPEG;
the stream rules themselves (markers, telling, tables) are in :mod:`.jpeg_kind`.
"""

from __future__ import annotations

import contextlib
import os
import threading
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
    stream_ends_with_eoi,
    stream_parts,
    told_stream,
    with_tables,
)

# Stored tiles at most this many bytes apart in the file are read with one call, the bytes between
# them with it. Chosen, not tuned: 128 KiB copied from the page cache takes tens of microseconds, about
# what a further read call costs a loader thread that shares the interpreter lock; the runs of tiles
# a GPU decoder takes along a row lie some 10 stored tiles (150-400 KiB) apart, and are read apart.
READ_GAP_BYTES = 1 << 17
# A thread's read buffer is kept between batches up to this size (a larger batch's is made anew):
# a fresh buffer of tens of MiB costs a page fault per 4 KiB on its first use.
_READ_BUFFER_KEPT_BYTES = 1 << 26


class ReadBuffer:
    """A growing byte buffer that one thread reuses for its reads."""

    def __init__(self) -> None:
        self.buf = np.zeros(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of buffer (its contents undefined until written)."""
        if nbytes > _READ_BUFFER_KEPT_BYTES:
            return np.empty(nbytes, np.uint8)
        if len(self.buf) < nbytes:
            self.buf = np.empty(min(max(nbytes * 5 // 4, 1 << 20), _READ_BUFFER_KEPT_BYTES), np.uint8)
        return self.buf[:nbytes]


def read_spans(
    fd: int, offsets: np.ndarray, counts: np.ndarray, reuse: ReadBuffer | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes ``[offsets[k], offsets[k] + counts[k])`` of file ``fd`` for each k with
    ``counts[k] > 0``, read as a few spans: ``(buf, starts)``, where the bytes of k are
    ``buf[starts[k] : starts[k] + counts[k]]`` (``starts[k]`` is 0 where ``counts[k]`` is 0).

    Byte ranges that overlap or lie within :data:`READ_GAP_BYTES` of each other are read as one
    span with one ``preadv``, so the buffer holds the union of the ranges and the short gaps
    between them (never more than the file). ``buf`` is ``reuse``'s (valid until its next use)
    where one is given. Raises EOFError where the file ends inside a range.
    """
    has = np.flatnonzero(counts > 0)
    starts = np.zeros(len(offsets), np.int64)
    if not len(has):
        return np.zeros(0, np.uint8), starts
    order = has[np.argsort(offsets[has], kind="stable")]
    lo, hi = offsets[order], offsets[order] + counts[order]
    reach = np.maximum.accumulate(hi)
    first = np.ones(len(order), bool)
    first[1:] = lo[1:] > reach[:-1] + READ_GAP_BYTES
    span_of = np.cumsum(first) - 1
    span_lo = lo[first]
    last = np.append(np.flatnonzero(first)[1:], len(order)) - 1
    span_len = reach[last] - span_lo
    span_at = np.concatenate(([0], np.cumsum(span_len)[:-1]))
    starts[order] = span_at[span_of] + lo - span_lo[span_of]
    total = int(span_len.sum())
    buf = reuse.take(total) if reuse is not None else np.empty(total, np.uint8)
    view = memoryview(buf)
    for at, n, where in zip(span_at.tolist(), span_len.tolist(), span_lo.tolist(), strict=True):
        if os.preadv(fd, [view[at : at + n]], where) < n:
            raise EOFError(f"the file ends before byte {where + n}")
    return buf, starts


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

    def _pread(self, level: int, n: int, offset: int) -> bytes:
        """The ``n`` bytes at ``offset`` of ``level``'s file (a reader of a remote file reads otherwise)."""
        return os.pread(self._level_fd(level), n, offset)

    def _read_level_spans(
        self, level: int, offsets: np.ndarray, counts: np.ndarray, reuse: ReadBuffer
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`read_spans` of ``level``'s file."""
        return read_spans(self._level_fd(level), offsets, counts, reuse)

    def raw_tile(self, level: int, tx: int, ty: int) -> bytes:
        raise NotImplementedError

    def _tile_origin_level0(self, level: int, tx: int, ty: int) -> tuple[int, int]:
        raise NotImplementedError

    def raw_tiles_jpeg(self, level: int, tiles: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`raw_tile_jpeg` of many stored tiles, back to back (see :meth:`Slide.raw_tiles_jpeg`).

        The stored bytes are read in spans (:func:`read_spans`): tiles that lie within
        :data:`READ_GAP_BYTES` of each other in the file are read with one call, the bytes between
        them too, so that a batch whose tiles lie in runs along its rows (a GPU decoder's share
        of them, the helpers taking the others) costs a read per run, not one per tile nor one over
        every byte between its first and last tile; the streams are then assembled from slices of
        those reads in one concatenation. A stream whose headers are those of the level's first
        stored tile is used as it is; any other is checked and told the container's colour space
        one by one (:meth:`_told_jpeg`); one without its end-of-image marker is reported as
        damaged, as the CPU decoder reports it.
        """
        if not tiles:
            return np.zeros(0, np.uint8), np.zeros(0, np.int64)
        offsets, counts = self._stored_ranges(level, tiles)
        if not counts.any():
            return np.zeros(0, np.uint8), np.zeros(len(tiles), np.int64)
        try:
            buf, rel = self._read_level_spans(level, offsets, counts, self._read_buffer())
        except EOFError as exc:
            raise SlideError(self.path, f"level {level}: the file ends inside its stored tiles") from exc
        return self._streams_from(level, tiles, buf, rel, counts)

    def _stored_ranges(self, level: int, tiles: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The file offsets and byte counts (int64; 0: no data) of stored tiles ``tiles`` of ``level``."""
        lv = self._jpeg_level(level)
        idx = np.array([ty * lv.tiles_across + tx for tx, ty in tiles], np.int64)
        return lv.offsets[idx].astype(np.int64), lv.bytecounts[idx].astype(np.int64)

    def _streams_from(
        self, level: int, tiles: Sequence[tuple[int, int]], buf: np.ndarray, rel: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The self-contained streams of ``tiles`` of ``level``, back to back, and their lengths,
        from their stored bytes ``buf[rel[k] : rel[k] + counts[k]]`` (:meth:`raw_tiles_jpeg`)."""
        lv = self._jpeg_level(level)
        has = counts > 0
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

    def _read_buffer(self) -> ReadBuffer:
        """This thread's buffer for :func:`read_spans` on this slide (kept between batches)."""
        local = self.__dict__.get("_read_local")
        if local is None:  # threads arriving together may each make one; one is kept
            local = self.__dict__.setdefault("_read_local", threading.local())
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = ReadBuffer()
        return buffer

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
        if not stream_ends_with_eoi(data):
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
                data = self._pread(level, min(int(lv.bytecounts[i]), 1 << 16), int(lv.offsets[i]))
                with contextlib.suppress(ValueError):
                    header = read_header(data)
                    whole = with_tables(lv.jpegtables, data)
                    colour = self._stored_colour(level)
                    if len(header.components) != 4 and (colour is None or told_stream(whole, colour) is whole):
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
        data = self._pread(level, min(int(lv.bytecounts[i]), 1 << 16), int(lv.offsets[i]))
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
        if len(header.components) == 4:
            # A 4-component stream (CMYK, or YCCK: Adobe transform 2) in a page of 3 samples:
            # decoded as RGB its every pixel would be wrong. OpenSlide refuses it the same way.
            transform = "" if header.adobe_transform is None else f", Adobe transform {header.adobe_transform}"
            raise self._tile_error(
                level,
                tx,
                ty,
                f"{where}: Bogus JPEG colorspace: a 4-component stream (CMYK or YCCK{transform}); "
                "expected 3 components as the container's 3 samples say",
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
