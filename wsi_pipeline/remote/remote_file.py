"""A remote slide as a file read at positions: what the TIFF reader reads through.

Opening fetches a generous head block (:data:`HEAD_BYTES`) in one request: the header and, in the
slides scanners and tifffile write, the IFDs of the whole pyramid or most of it; the rest of what
tifffile asks while it opens the file comes in aligned blocks (:data:`BLOCK_BYTES`, kept in a
bounded cache). Stored tiles are fetched by :meth:`RemoteFile.fetch_ahead` before they are read:
the ranges of a batch merged where they lie within :data:`MERGE_GAP_BYTES` of each other (a row of
stored tiles is one request), each merged span fetched on a thread of the file's pool, so that a
batch costs about one round trip whatever the number of its tiles; the bytes wait in a bounded
cache (:data:`RANGE_CACHE_BYTES`) for the reader that decodes them. A range read without a fetch
ahead costs a request of its own.

Each request is tried again after a transient failure (a 5xx or 429 answer, a timeout, a broken
connection, a short body) up to :data:`RETRIES` times with a doubling backoff; every attempt is
counted in :meth:`RemoteFile.stats`. A failure that lasts is a :class:`~..errors.RemoteReadError`
naming the address without credentials, the bytes asked for and what went wrong.
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import RemoteReadError
from .address import address_parts, shown_address
from .credentials import redact
from .transport import MAX_CONCURRENT, Problem, Reply, make_transport

# The first request: 1 MiB holds a TIFF's header and the IFDs that follow it (tifffile writes each
# page's IFD before its data; an SVS of a few pages keeps its small levels' IFDs in reach) at the
# cost of a few milliseconds more than a small request.
HEAD_BYTES = 1 << 20
# What tifffile reads past the head comes in blocks of this size, aligned, kept in a cache of
# METADATA_CACHE_BYTES: a large level's tile tables are one request, the next IFD often in it.
BLOCK_BYTES = 256 << 10
METADATA_CACHE_BYTES = 32 << 20
# Stored tiles fetched ahead wait here for their reader (a few batches' worth of compressed tiles).
RANGE_CACHE_BYTES = 128 << 20
# Ranges this close are fetched as one: at 20 ms a round trip, 256 KiB more of an answer costs
# less than another request would.
MERGE_GAP_BYTES = 256 << 10
# A merged span is cut at this size, so that a large batch is fetched by several requests at once.
MAX_SPAN_BYTES = 4 << 20
RETRIES = 3
BACKOFF_S = 0.2


def merged_spans(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(start, end, members)`` spans covering ``ranges`` (``(offset, count)``, sorted by offset):
    ranges within :data:`MERGE_GAP_BYTES` of each other share a span of at most
    :data:`MAX_SPAN_BYTES` (a single larger range is a span of its own)."""
    spans: list[tuple[int, int, list[tuple[int, int]]]] = []
    for offset, count in ranges:
        end = offset + count
        if spans:
            lo, hi, members = spans[-1]
            if offset <= hi + MERGE_GAP_BYTES and max(hi, end) - lo <= MAX_SPAN_BYTES:
                spans[-1] = (lo, max(hi, end), [*members, (offset, count)])
                continue
        spans.append((offset, end, [(offset, count)]))
    return spans


class RangeClient:
    """Range requests to the object at ``address``, each tried again after a transient failure,
    every attempt counted. ``name``: the address without credentials."""

    def __init__(self, address: str):
        parts = address_parts(address)
        self.name = shown_address(address)
        self._host = parts.host.rpartition(":")[0] or parts.host
        self._transport = make_transport(address, parts)
        self._lock = threading.Lock()
        self.requests = self.bytes = 0

    def fetch(self, start: int, end: int, what: str) -> Reply:
        """Bytes ``[start, end)`` in one request, tried again after a transient failure;
        :class:`RemoteReadError` saying ``what`` they were where it lasts."""
        for attempt in range(RETRIES + 1):
            with self._lock:
                self.requests += 1
            try:
                reply = self._transport.get(start, end)
            except Problem as problem:
                if not problem.transient or attempt == RETRIES:
                    tries = f" ({attempt + 1} tries)" if problem.transient else ""
                    message = f"{what} (bytes {start}-{end - 1}): {problem.reason}{tries}"
                    raise RemoteReadError(self.name, redact(message, self._host)) from None
                time.sleep(BACKOFF_S * 2**attempt)
                continue
            with self._lock:
                self.bytes += len(reply.data)
            return reply
        raise AssertionError("unreachable")


class RemoteFile:
    """The object at a remote ``address`` read at positions, thread-safe (see the module's text).

    ``name``: the address without credentials; ``size``, ``etag`` and ``last_modified`` as the
    server gave them with the head block.
    """

    def __init__(self, address: str):
        self._client = RangeClient(address)
        self.name = self._client.name
        self._lock = threading.Lock()
        self._open_requests = self._open_bytes = 0
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT, thread_name_prefix="remote-fetch")
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._ranges: OrderedDict[tuple[int, int], bytes | Future] = OrderedDict()
        self._ranges_bytes = 0
        try:
            head = self.fetch(0, HEAD_BYTES, "its first bytes")
            if head.size is None:
                raise RemoteReadError(self.name, "the server gave no size (expected Content-Range: bytes a-b/size)")
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        self.size, self.etag, self.last_modified = head.size, head.etag, head.last_modified
        self._head = head.data

    def fetch(self, start: int, end: int, what: str) -> Reply:
        """:meth:`RangeClient.fetch` of this file."""
        return self._client.fetch(start, end, what)

    def stats(self) -> dict[str, Any]:
        """What reading it has cost: ``requests`` and ``bytes`` so far, and the same up to
        :meth:`mark_opened` (``open_requests``, ``open_bytes``)."""
        with self._lock:
            return {
                "requests": self._client.requests,
                "bytes": self._client.bytes,
                "open_requests": self._open_requests,
                "open_bytes": self._open_bytes,
            }

    def mark_opened(self) -> None:
        """Take the requests so far as those of opening it (the header and IFDs read)."""
        with self._lock:
            self._open_requests, self._open_bytes = self._client.requests, self._client.bytes

    # -- metadata: the head and blocks ----------------------------------------
    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset`` (fewer at the end), from the head or the block cache."""
        end = min(offset + max(0, n), self.size)
        if offset >= end:
            return b""
        if end <= len(self._head):
            return self._head[offset:end]
        first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        with self._lock:
            have = {i: self._blocks.get(i) for i in range(first, last + 1)}
        missing = [i for i, b in have.items() if b is None]
        if missing:
            lo, hi = missing[0] * BLOCK_BYTES, min((missing[-1] + 1) * BLOCK_BYTES, self.size)
            data = self.fetch(lo, hi, "its header").data
            for i in range(missing[0], missing[-1] + 1):
                have[i] = data[(i - missing[0]) * BLOCK_BYTES : (i - missing[0] + 1) * BLOCK_BYTES]
            self._keep_blocks({i: have[i] for i in range(missing[0], missing[-1] + 1)})
        whole = b"".join(have[i] for i in range(first, last + 1))
        return whole[offset - first * BLOCK_BYTES : end - first * BLOCK_BYTES]

    def _keep_blocks(self, blocks: dict[int, bytes]) -> None:
        with self._lock:
            self._blocks.update(blocks)
            while len(self._blocks) * BLOCK_BYTES > METADATA_CACHE_BYTES:
                self._blocks.popitem(last=False)

    def stream(self) -> RemoteStream:
        """A seekable binary stream over it (what tifffile opens)."""
        return RemoteStream(self)

    # -- stored tiles: fetched ahead, then read --------------------------------
    def fetch_ahead(self, offsets: Sequence[int], counts: Sequence[int]) -> None:
        """Start fetching the ranges ``(offsets[k], counts[k])`` (count 0: none) not already held or
        on their way, merged (:func:`merged_spans`), each span on a thread; returns at once."""
        with self._lock:
            wanted = sorted({(int(o), int(n)) for o, n in zip(offsets, counts, strict=True) if n} - set(self._ranges))
            wanted = [r for r in wanted if r[0] + r[1] > len(self._head)]
            spans = merged_spans(wanted)
            for lo, hi, members in spans:
                future: Future = Future()
                for key in members:
                    self._ranges[key] = future
                    self._ranges_bytes += key[1]
                self._pool.submit(self._fetch_span, lo, hi, members, future)
            self._evict()

    def _fetch_span(self, lo: int, hi: int, members: list[tuple[int, int]], future: Future) -> None:
        try:
            data = self.fetch(lo, hi, f"{len(members)} stored tile(s)").data
        except BaseException as exc:  # the reader that waits for one of them raises it
            future.set_exception(exc)
            return
        future.set_result((lo, data))
        with self._lock:
            for offset, count in members:
                if self._ranges.get((offset, count)) is future:
                    self._ranges[(offset, count)] = data[offset - lo : offset - lo + count]

    def _evict(self) -> None:
        """Drop the oldest ranges held while over :data:`RANGE_CACHE_BYTES` (lock held by the caller)."""
        while self._ranges_bytes > RANGE_CACHE_BYTES and self._ranges:
            (_, count), _ = self._ranges.popitem(last=False)
            self._ranges_bytes -= count

    def pread(self, n: int, offset: int) -> bytes:
        """The ``n`` bytes at ``offset``: fetched ahead (waited for where still on their way), in the
        head, or fetched now."""
        key = (int(offset), int(n))
        with self._lock:
            held = self._ranges.get(key)
            if held is not None:
                self._ranges.move_to_end(key)
        if isinstance(held, Future):
            lo, data = held.result()
            return data[key[0] - lo : key[0] - lo + key[1]]
        if held is not None:
            return held
        if key[0] + key[1] <= len(self._head):
            return self._head[key[0] : key[0] + key[1]]
        return self.fetch(key[0], key[0] + key[1], "a stored tile").data

    def read_spans(self, offsets: np.ndarray, counts: np.ndarray, reuse: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """:func:`~wsi_pipeline.slide.stored_jpeg.read_spans` of this file: the ranges with
        ``counts[k] > 0`` back to back in ``buf`` (``reuse.take``'s where given) at ``starts[k]``,
        fetched together (:meth:`fetch_ahead`)."""
        self.fetch_ahead(offsets.tolist(), counts.tolist())
        starts = np.zeros(len(offsets), np.int64)
        starts[1:] = np.cumsum(counts)[:-1]
        total = int(counts.sum())
        buf = reuse.take(total) if reuse is not None else np.empty(total, np.uint8)
        for k in np.flatnonzero(counts > 0).tolist():
            at, n = int(starts[k]), int(counts[k])
            buf[at : at + n] = np.frombuffer(self.pread(n, int(offsets[k])), np.uint8)
        return buf, starts

    def close(self) -> None:
        """Stop its fetches (those under way end within their timeout) and free its caches."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for held in self._ranges.values():
                if isinstance(held, Future) and not held.done():  # its span was never fetched: no reader waits for ever
                    held.set_exception(RemoteReadError(self.name, "closed before its stored tiles came"))
            self._ranges.clear()
            self._blocks.clear()
            self._ranges_bytes = 0


class RemoteStream(io.RawIOBase):
    """A seekable, read-only binary stream over a :class:`RemoteFile`."""

    def __init__(self, remote: RemoteFile):
        super().__init__()
        self._remote = remote
        self._pos = 0
        self.name = remote.name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._remote.size}[whence]
        self._pos = max(0, base + int(offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._remote.read_at(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)
