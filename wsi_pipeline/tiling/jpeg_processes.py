"""Helper processes that decode stored JPEG tiles with libjpeg-turbo while nvJPEG decodes the rest.

torchvision runs one nvJPEG call at a time, and in a run on the GPU the loader's calls follow each
other without a gap: nvJPEG is what bounds the run (BENCHMARKS.md). These processes decode a fixed
share of each batch's stored tiles (:func:`cpu_share_tile`) at the same time, straight into a
host buffer the GPU copies from (:class:`SharedStaging`: a file in ``/dev/shm`` mapped here and
in each helper, page-locked for CUDA), so the loader adds one asynchronous copy per batch.

Processes, not threads: threads doing the same share ran slower than none at every share tried,
because each tile's Python work (the read, the call) waited for the interpreter lock that the
stitching thread holds (BENCHMARKS.md, "Tried and not kept"). Here a batch costs the loader one
message per helper and one reply.

Which tiles the helpers decode depends only on the stored tile's position and the share, never on
timing or on the batch, so a run's pixels are the same every time; libjpeg-turbo's pixels are the
CPU reader's.

Each helper starts as ``python -m wsi_pipeline.tiling.jpeg_processes`` and ends with its parent
(:mod:`..child_process`). A helper that dies or stops answering fails the batch it was decoding
with :class:`~..errors.TileReadError`; the next batch starts new helpers.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from ..child_process import child_connections, start_child
from ..errors import TileReadError

# A stored tile (tx, ty) goes to the helpers when (tx + 3 * ty) % SHARE_PERIOD < the share's
# numerator: along any row of stored tiles, and so in every batch, the helpers get that fraction.
SHARE_PERIOD = 16
# One helper decodes about 2,750-4,250 stored tiles/s of the synthetic 32k slide on the GPU
# machine's cores (libjpeg-turbo, one thread), and nvJPEG about 19,900 during a run
# (BENCHMARKS.md); the default share splits the work in that ratio.
_HELPER_TILES_PER_S = 3_500
_NVJPEG_TILES_PER_S = 19_900
# Seconds a helper may take over one batch's share before it counts as hung.
DECODE_TIMEOUT_S = 120.0
# Staging buffers kept between batches (one per loader thread).
_KEPT_STAGING = 2


def default_helpers(cpu_count: int | None) -> int:
    """Helper processes a GPU run starts on a machine with ``cpu_count`` cores: none below 12 cores
    (the loader, executor and stitching threads and the box-merging process need about 8), then
    one per 2 cores beyond 8, at most 6."""
    cores = cpu_count or 1
    return 0 if cores < 12 else min(6, (cores - 8) // 2)


def default_share(helpers: int) -> int:
    """The share (out of :data:`SHARE_PERIOD`) of stored tiles ``helpers`` processes decode."""
    if helpers <= 0:
        return 0
    cpu = helpers * _HELPER_TILES_PER_S
    return max(1, min(SHARE_PERIOD // 2, round(SHARE_PERIOD * cpu / (cpu + _NVJPEG_TILES_PER_S))))


def cpu_share_tile(tx: int, ty: int, share: int) -> bool:
    """Whether stored tile ``(tx, ty)`` is decoded by the helpers at ``share`` / :data:`SHARE_PERIOD`."""
    return (tx + 3 * ty) % SHARE_PERIOD < share


def _shared_file(nbytes: int) -> tuple[str, mmap.mmap]:
    """A new file of ``nbytes`` mapped shared: in ``/dev/shm`` where it has the room, else in the
    temporary folder. Its space is allocated now (``posix_fallocate``), so that a full ``/dev/shm``
    (small in many containers) is an OSError here, not a bus error when the pages are written."""
    folders = [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d) and os.access(d, os.W_OK)]
    error: OSError | None = None
    for folder in dict.fromkeys(folders):
        fd, path = tempfile.mkstemp(prefix="wsi-pipeline-tiles-", dir=folder)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return path, mmap.mmap(fd, nbytes)
        except OSError as exc:
            error = exc
            with contextlib.suppress(OSError):
                os.unlink(path)
        finally:
            os.close(fd)
    raise OSError(f"no room for a shared buffer of {nbytes / 2**20:.0f} MiB in {' or '.join(folders)}: {error}")


class SharedStaging:
    """A host buffer of ``slots`` stored tiles (``slots x th x tw x 3`` uint8) shared with the helpers.

    The file behind it is removed once every helper has mapped it (:meth:`JpegHelpers.map_buffer`), so
    nothing is left behind when a process is killed. With ``cuda`` the buffer is page-locked
    (``cudaHostRegister``), so a copy to the device from it is asynchronous. ``event``: the CUDA
    event after the last copy out of it (None: none pending).
    """

    _ids = itertools.count(1)

    def __init__(self, slots: int, th: int, tw: int, cuda: bool = False):
        import torch

        self.id = next(self._ids)
        self.shape = (int(slots), int(th), int(tw), 3)
        self.nbytes = int(np.prod(self.shape))
        self.path, self._mm = _shared_file(self.nbytes)
        self.array = np.ndarray(self.shape, np.uint8, self._mm)
        self.tensor = torch.from_numpy(self.array)
        self._registered = False
        if cuda:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self._registered = int(err) == 0  # else the copies are synchronous: slower, still right
        self.event: Any = None
        self.generation: int | None = None  # of the helpers that mapped it (JpegHelpers.map_buffer)

    def unlink(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None

    def close(self) -> None:
        self.unlink()
        if self._registered:
            import torch

            if self.event is not None:
                self.event.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._mm.close()


class _Helper:
    def __init__(self) -> None:
        self.proc, self.send, self.recv = start_child("wsi_pipeline.tiling.jpeg_processes")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> int | None:
        for conn in (self.send, self.recv):
            with contextlib.suppress(OSError):
                conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


class _Pending:
    """One batch's share under way in the helpers: :meth:`wait` for it (once)."""

    def __init__(self, owner: JpegHelpers, helpers: list[_Helper], slide_path: str, level: int):
        self.owner, self.helpers, self.slide_path, self.level = owner, helpers, slide_path, level
        self._waited = False

    def wait(self) -> None:
        """Wait for every helper's reply; raises :class:`TileReadError` for a tile that could not be
        read or decoded, or where a helper died or hung."""
        if self._waited:
            return
        self._waited = True
        try:
            replies = self.owner._replies(self.helpers, "decoding stored tiles")
        except RuntimeError as exc:
            raise TileReadError(self.slide_path, str(exc), None, self.level) from None
        finally:
            self.owner._lock.release()
        for reply in replies:
            if reply[0] == "error":
                _, where, message = reply
                raise TileReadError(self.slide_path, f"{where}: {message}", None, self.level)


class JpegHelpers:
    """``count`` helper processes (started on first use) decoding stored JPEG tiles into a
    :class:`SharedStaging`. Thread-safe: one batch's share is decoded at a time.

    ``tile_share``: the share of a GPU run's stored tiles they decode, out of
    :data:`SHARE_PERIOD` (None: :func:`default_share` of ``count``).
    """

    def __init__(self, count: int, tile_share: int | None = None, timeout_s: float = DECODE_TIMEOUT_S):
        if count < 1:
            raise ValueError(f"count: expected >= 1, found {count}")
        share = default_share(count) if tile_share is None else int(tile_share)
        if not 0 <= share <= SHARE_PERIOD:
            raise ValueError(f"tile_share: expected 0..{SHARE_PERIOD}, found {share}")
        self.count = int(count)
        self.tile_share = share
        self.timeout_s = float(timeout_s)
        self._helpers: list[_Helper] = []
        self._generation = 0  # counts the starts of helpers: a buffer is mapped by one generation
        self._lock = threading.Lock()  # one batch's share at a time (start ... wait)
        self._pool_lock = threading.Lock()
        self._free: list[SharedStaging] = []
        self._closed = False

    # -- helpers' life --------------------------------------------------------------------------
    def _ensure(self) -> list[_Helper]:
        if self._closed:
            raise RuntimeError("the JPEG helper processes are closed")
        if len(self._helpers) != self.count or not all(h.alive() for h in self._helpers):
            self._stop()
            self._helpers = [_Helper() for _ in range(self.count)]
        return self._helpers

    def _stop(self) -> None:
        for h in self._helpers:
            with contextlib.suppress(OSError):
                h.send.send(("close",))
            h.kill()
        self._helpers = []
        self._generation += 1  # what they mapped is gone with them

    def _replies(self, helpers: Sequence[_Helper], what: str) -> list[tuple]:
        """One reply from each of ``helpers``; raises RuntimeError naming the one that died or hung."""
        pending = {h.recv: h for h in helpers}
        replies: dict[Connection, tuple] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._stop()
                raise RuntimeError(f"a JPEG decoding process did not finish {what} within {self.timeout_s:.0f} s")
            for conn in ready:
                helper = pending.pop(conn)  # type: ignore[index]
                try:
                    replies[conn] = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    code = helper.kill()
                    self._stop()
                    raise RuntimeError(f"a JPEG decoding process ended while {what} (exit code {code})") from None
        return [replies[h.recv] for h in helpers]

    def map_buffer(self, staging: SharedStaging) -> None:
        """Have every helper map ``staging`` (then its file is removed)."""
        helpers = self._ensure()
        if staging.generation == self._generation:
            return
        if staging.path is None:
            raise RuntimeError("the JPEG decoding processes were started again while this batch was read")
        for h in helpers:
            h.send.send(("map", staging.id, staging.path, staging.shape))
        self._replies(helpers, "mapping a buffer")
        staging.generation = self._generation
        staging.unlink()

    # -- decoding -------------------------------------------------------------------------------
    def start(
        self, slide_path: str, level: int, items: Sequence[tuple[int, int, int]], staging: SharedStaging
    ) -> _Pending:
        """Start decoding stored tiles ``items`` (``(i, tx, ty)``) of ``level`` into ``staging.array[i]``.

        Returns at once; the caller must call the result's ``wait()`` (one batch's share is under
        way at a time: another thread's ``start`` waits for that).
        """
        self._lock.acquire()
        try:
            self.map_buffer(staging)
            helpers = self._helpers
            n = min(len(helpers), len(items))
            for k in range(n):
                helpers[k].send.send(("decode", staging.id, str(slide_path), int(level), list(items[k::n])))
        except RuntimeError as exc:
            self._lock.release()
            raise TileReadError(slide_path, str(exc), None, level) from None
        except BaseException:
            self._stop()  # the helpers may have a request they will answer: start afresh
            self._lock.release()
            raise
        return _Pending(self, helpers[:n], str(slide_path), int(level))

    def decode(
        self, slide_path: str, level: int, items: Sequence[tuple[int, int, int]], staging: SharedStaging
    ) -> None:
        """:meth:`start`, then wait. Raises :class:`TileReadError` for a tile that cannot be read or
        decoded, or where a helper dies or hangs (the next call then starts new helpers)."""
        if items:
            self.start(slide_path, level, items, staging).wait()

    def acquire_staging(self, slots: int, th: int, tw: int, cuda: bool) -> SharedStaging:
        """A staging buffer of at least ``slots`` stored tiles, free to write (its last copy done).

        Buffers are kept for the next batches and runs (:meth:`release_staging`): registering
        memory with CUDA and mapping it in every helper are done once per buffer.
        """
        with self._lock:
            self._ensure()  # helpers that ended are replaced now, so a buffer they mapped is not handed out
        with self._pool_lock:
            stale = [b for b in self._free if b.path is None and b.generation != self._generation]
            for b in stale:  # mapped by helpers that ended: of no use to the new ones
                self._free.remove(b)
                b.close()
            fits = [b for b in self._free if b.shape[0] >= slots and b.shape[1:3] == (th, tw)]
            staging = min(fits, key=lambda b: b.shape[0]) if fits else None
            if staging is not None:
                self._free.remove(staging)
        if staging is None:
            staging = SharedStaging(-(-max(slots, 1) // 64) * 64, th, tw, cuda)
        if staging.event is not None:
            staging.event.synchronize()
            staging.event = None
        return staging

    def release_staging(self, staging: SharedStaging) -> None:
        """Give back a buffer :meth:`acquire_staging` gave (its copy's ``event`` recorded)."""
        with self._pool_lock:
            self._free.append(staging)
            extra = sorted(self._free, key=lambda b: b.shape[0])[: max(0, len(self._free) - _KEPT_STAGING)]
            for b in extra:
                self._free.remove(b)
        for b in extra:
            self.forget(b)
            b.close()

    def forget(self, staging: SharedStaging) -> None:
        """The helpers unmap ``staging`` (before it is closed)."""
        with self._lock:
            if staging.generation != self._generation:
                return
            staging.generation = None
            for h in self._helpers:
                with contextlib.suppress(OSError):
                    h.send.send(("unmap", staging.id))

    def start_processes(self) -> None:
        """Start the helpers now (they import their modules while the caller goes on)."""
        with self._lock:
            self._ensure()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()
        with self._pool_lock:
            free, self._free = self._free, []
        for b in free:
            b.close()


# -- a helper process ---------------------------------------------------------------------------
def _serve(recv: Connection, send: Connection) -> None:
    import imagecodecs

    from ..slide.tiff_backend import TiffSlide

    buffers: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    slides: dict[str, TiffSlide] = {}
    while True:
        try:
            msg = recv.recv()
        except (EOFError, OSError):
            return
        op = msg[0]
        if op == "close":
            return
        if op == "map":
            _, sid, path, shape = msg
            with open(path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), int(np.prod(shape)))
            buffers[sid] = (mm, np.ndarray(shape, np.uint8, mm))
            send.send(("mapped",))
        elif op == "unmap":
            buffers.pop(msg[1], None)
        elif op == "decode":
            _, sid, path, level, items = msg
            out = buffers[sid][1]
            where = "cannot open the slide"
            try:
                slide = slides.get(path)
                if slide is None:
                    for old in slides.values():
                        old.close()
                    slides.clear()
                    slide = slides[path] = TiffSlide(path)
                background = tuple(slide.background_rgb)
                for i, tx, ty in items:
                    where = f"cannot decode stored tile ({tx}, {ty}) of level {level}"
                    raw = slide.raw_tile_jpeg(level, tx, ty)
                    if raw:
                        imagecodecs.jpeg8_decode(raw, out=out[i])
                    else:
                        out[i] = background
                send.send(("done",))
            except Exception as exc:  # imagecodecs and tifffile raise their own types
                send.send(("error", where, str(exc) or type(exc).__name__))


if __name__ == "__main__":
    _serve(*child_connections(sys.argv[1:]))


__all__ = [
    "SHARE_PERIOD",
    "JpegHelpers",
    "SharedStaging",
    "cpu_share_tile",
    "default_helpers",
    "default_share",
]
