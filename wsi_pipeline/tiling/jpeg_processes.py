"""Helper processes that decode stored JPEG tiles with libjpeg-turbo while nvJPEG decodes the rest.

torchvision runs one nvJPEG call at a time, and in a run on the GPU the loader's calls follow each
other without a gap: nvJPEG is what bounds the run (benchmarks/HISTORY.md). These processes decode a fixed
share of each batch's stored tiles (:func:`cpu_share_tile`) at the same time, straight into a
host buffer the GPU copies from (:class:`SharedStaging`: a file in ``/dev/shm`` mapped here and
in each helper, page-locked for CUDA), so the loader adds one asynchronous copy per batch.

Processes, not threads: threads doing the same share ran slower than none at every share tried,
because each tile's Python work (the read, the call) waited for the interpreter lock that the
stitching thread holds (benchmarks/HISTORY.md, "Tried and not kept"). Here a batch costs the loader one
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
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from ..child_process import child_connections, start_child
from ..errors import TileReadError

# A stored tile (tx, ty) goes to the helpers when (tx + 3 * ty) % SHARE_PERIOD < the share's
# numerator: along any row of stored tiles, and so in every batch, the helpers get that fraction.
SHARE_PERIOD = 16
# The default share splits the work in the ratio of the helpers' rate to nvJPEG's. The rates are
# fitted to `benchmarks/probes/sweep_gpu_decode.py --helpers` on the 16-core GPU machine (benchmarks/HISTORY.md,
# 2026-12-03 17:0x-17:5x): `Pipeline.run` was fastest with 8 helpers at 10/16 of the stored tiles
# (median 5,941 tiles/s, against 4,752 for 6 at 8/16 and 4,835-5,560 at 12/16; in a second sweep
# 8 at 9/16 led, within the runs' spread). There libjpeg-turbo on one thread decoded 2,831 stored
# tiles/s alone (bench_product_gpu.py's ceiling), and nvJPEG 15,200 during a run where it had half
# the tiles (trace_gpu_run.py: stored tiles it decoded / its busy time). nvJPEG keeps at least
# 4/16: the share also sizes the helpers' staging buffers.
_HELPER_TILES_PER_S = 2_830
_NVJPEG_TILES_PER_S = 15_200
_MAX_SHARE = 12
# Seconds a helper may take over one batch's share before it counts as hung.
DECODE_TIMEOUT_S = 120.0
# Staging buffers kept between batches (one per loader thread).
KEPT_STAGING = 2


def default_helpers(cpu_count: int | None) -> int:
    """Helper processes a GPU run starts on a machine with ``cpu_count`` cores: none below 12 cores
    (the loader, executor and stitching threads, the box-merging process and a batch's writers
    need the rest), then one per 2 cores, at most 8 (8 on the 16-core GPU machine)."""
    cores = cpu_count or 1
    return 0 if cores < 12 else min(8, cores // 2)


def default_share(helpers: int) -> int:
    """The share (out of :data:`SHARE_PERIOD`) of stored tiles ``helpers`` processes decode."""
    if helpers <= 0:
        return 0
    cpu = helpers * _HELPER_TILES_PER_S
    return max(1, min(_MAX_SHARE, round(SHARE_PERIOD * cpu / (cpu + _NVJPEG_TILES_PER_S))))


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

    The file behind it is removed once every helper has mapped it (with the first batch
    :meth:`JpegHelpers.start` sends for it), so
    a process killed after that leaves nothing behind. With ``cuda`` the buffer is page-locked
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
        self.generation: int | None = None  # of the helpers that mapped it (JpegHelpers.start)

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


class _Request:
    """One request sent to some helpers: a reply expected from each (helpers answer in order)."""

    def __init__(self, count: int):
        self.remaining = count
        self.replies: list[tuple] = []
        self.failure: str | None = None
        self.done = threading.Event()
        if count == 0:
            self.done.set()

    def reply(self, msg: tuple) -> None:
        self.replies.append(msg)
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()

    def fail(self, why: str) -> None:
        if not self.done.is_set():
            self.failure = why
            self.done.set()


class _Generation:
    """Helper processes started together, and the thread that reads their replies.

    Each helper answers its requests in order; the reader hands each reply to the request it
    answers. A helper that ends fails every request still waiting, and the generation with it.
    """

    def __init__(self, count: int, number: int):
        self.number = number
        self.procs: list[subprocess.Popen] = []
        self.sends: list[Connection] = []
        self.recvs: list[Connection] = []
        for _ in range(count):
            proc, send, recv = start_child("wsi_pipeline.tiling.jpeg_processes")
            self.procs.append(proc)
            self.sends.append(send)
            self.recvs.append(recv)
        self.queues: list[deque[_Request]] = [deque() for _ in range(count)]
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.reader = threading.Thread(target=self._read, name="jpeg-helpers-replies", daemon=True)
        self.reader.start()

    def alive(self) -> bool:
        return self.broken is None and all(p.poll() is None for p in self.procs)

    def send(self, k: int, request: _Request, msg: tuple) -> None:
        """Send ``msg`` to helper ``k``; its reply goes to ``request`` (sends come from one thread at a
        time: the owner's lock)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self.queues[k].append(request)
        try:
            self.sends[k].send(msg)
        except OSError:
            self.queues[k].pop()
            raise RuntimeError(f"a JPEG decoding process ended (exit code {self.procs[k].poll()})") from None

    def _read(self) -> None:
        index = {id(c): k for k, c in enumerate(self.recvs)}
        open_conns = list(self.recvs)
        while open_conns:
            try:
                ready = wait(open_conns, timeout=1.0)
            except OSError:
                break
            for conn in ready:
                k = index[id(conn)]
                try:
                    msg = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    self.fail(f"a JPEG decoding process ended (exit code {self.procs[k].wait()})")
                    continue
                with self.lock:
                    request = self.queues[k].popleft() if self.queues[k] else None
                if request is not None:
                    request.reply(msg)
        self.fail("the JPEG decoding processes were stopped")

    def fail(self, why: str) -> None:
        with self.lock:
            if self.broken is None:
                self.broken = why
            waiting = [r for q in self.queues for r in q]
            for q in self.queues:
                q.clear()
        for r in waiting:
            r.fail(why)

    def stop(self) -> None:
        self.fail("the JPEG decoding processes were stopped")
        for send in self.sends:
            with contextlib.suppress(OSError):
                send.send(("close",))
        for conn in (*self.sends, *self.recvs):
            with contextlib.suppress(OSError):
                conn.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


class PendingShare:
    """One batch's share under way in the helpers: :meth:`wait` for it."""

    def __init__(
        self,
        owner: JpegHelpers,
        request: _Request,
        slide_path: str,
        level: int,
        on_damage: Callable[[int, int, int, tuple[int, int], str], None] | None = None,
    ):
        self.owner, self.request, self.slide_path, self.level = owner, request, slide_path, level
        self.on_damage = on_damage

    def wait(self) -> None:
        """Wait for every helper's reply; raises :class:`TileReadError` for a tile that could not be
        read or decoded, or where a helper died or hung (the helpers are then started again by
        the next batch). Tiles a helper decoded with a corrupt-data warning are handed to
        ``on_damage`` (the slide's own damage record, which applies its policy)."""
        r = self.request
        if not r.done.wait(self.owner.timeout_s):
            self.owner._restart_after(f"did not finish decoding stored tiles within {self.owner.timeout_s:.0f} s")
            raise TileReadError(
                self.slide_path,
                f"a JPEG decoding process did not finish decoding stored tiles within {self.owner.timeout_s:.0f} s",
                None,
                self.level,
            )
        if r.failure is not None:
            raise TileReadError(self.slide_path, f"{r.failure} while decoding stored tiles", None, self.level)
        for reply in r.replies:
            if reply[0] == "error":
                _, where, message = reply
                raise TileReadError(self.slide_path, f"{where}: {message}", None, self.level)
        for reply in r.replies:
            for level, col, row, x0, y0, message in reply[1] if len(reply) > 1 else ():
                if self.on_damage is not None:
                    self.on_damage(level, col, row, (x0, y0), message)


class JpegHelpers:
    """``count`` helper processes (started on first use) decoding stored JPEG tiles into a
    :class:`SharedStaging`. Thread-safe: requests from several threads queue in the helpers, each
    answered in turn.

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
        self._gen: _Generation | None = None
        self._generations = itertools.count(1)
        self._lock = threading.Lock()  # starting and stopping helpers; sending
        self._pool_lock = threading.Lock()
        self._free: list[SharedStaging] = []
        self._closed = False

    # -- helpers' life --------------------------------------------------------------------------
    def _ensure(self) -> _Generation:
        """The running helpers, started afresh where one has ended (call with ``_lock`` held)."""
        if self._closed:
            raise RuntimeError("the JPEG helper processes are closed")
        if self._gen is None or not self._gen.alive():
            if self._gen is not None:
                self._gen.stop()
            self._gen = _Generation(self.count, next(self._generations))
        return self._gen

    def _restart_after(self, why: str) -> None:
        """Stop the helpers (they hang or failed): the next request starts new ones."""
        with self._lock:
            if self._gen is not None:
                self._gen.fail(why)
                self._gen.stop()
                self._gen = None

    def start_processes(self) -> None:
        """Start the helpers now (they import their modules while the caller goes on)."""
        with self._lock:
            self._ensure()

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The running helper processes (none before the first use)."""
        return list(self._gen.procs) if self._gen is not None else []

    def _map(self, gen: _Generation, staging: SharedStaging) -> None:
        """Have every helper of ``gen`` map ``staging``, then remove its file (``_lock`` held)."""
        if staging.generation == gen.number:
            return
        if staging.path is None:
            raise RuntimeError("the JPEG decoding processes were started again while this batch was read")
        request = _Request(self.count)
        for k in range(self.count):
            gen.send(k, request, ("map", staging.id, staging.path, staging.shape))
        if not request.done.wait(self.timeout_s):
            raise RuntimeError(f"a JPEG decoding process did not map a buffer within {self.timeout_s:.0f} s")
        if request.failure is not None:
            raise RuntimeError(request.failure)
        staging.generation = gen.number
        staging.unlink()

    # -- decoding -------------------------------------------------------------------------------
    def start(
        self,
        slide_path: str,
        level: int,
        items: Sequence[tuple[int, int, int]],
        staging: SharedStaging,
        reader: str = "tifffile",
        on_damage: Callable[[int, int, int, tuple[int, int], str], None] | None = None,
    ) -> PendingShare:
        """Start decoding stored tiles ``items`` (``(i, tx, ty)``) of ``level`` into ``staging.array[i]``;
        returns at once: ``wait()`` on the result before reading ``staging``. ``on_damage(level,
        col, row, origin_level0, message)`` is called from ``wait()`` for each tile decoded with a
        corrupt-data warning (the helpers record damage; the caller's slide applies its policy)."""
        try:
            with self._lock:
                gen = self._ensure()
                self._map(gen, staging)
                n = min(self.count, len(items))
                request = _Request(n)
                for k in range(n):
                    gen.send(k, request, ("decode", staging.id, str(slide_path), reader, int(level), list(items[k::n])))
        except RuntimeError as exc:
            self._restart_after(str(exc))
            raise TileReadError(slide_path, str(exc), None, level) from None
        return PendingShare(self, request, str(slide_path), int(level), on_damage)

    def acquire_staging(self, slots: int, th: int, tw: int, cuda: bool) -> SharedStaging:
        """A staging buffer of at least ``slots`` stored tiles, free to write (its last copy done).

        Buffers are kept for the next batches and runs (:meth:`release_staging`): registering
        memory with CUDA and mapping it in every helper are done once per buffer.
        """
        gen = self._gen
        if gen is None or not gen.alive():
            with self._lock:  # helpers that ended are replaced now: a buffer they mapped is of no use
                gen = self._ensure()
        with self._pool_lock:
            stale = [b for b in self._free if b.path is None and b.generation != gen.number]
            for b in stale:
                self._free.remove(b)
            fits = [b for b in self._free if b.shape[0] >= slots and b.shape[1:3] == (th, tw)]
            staging = min(fits, key=lambda b: b.shape[0]) if fits else None
            if staging is not None:
                self._free.remove(staging)
        for b in stale:
            b.close()
        if staging is None:
            staging = SharedStaging(-(-max(slots, 1) // 16) * 16, th, tw, cuda)
        if staging.event is not None:
            staging.event.synchronize()
            staging.event = None
        return staging

    def release_staging(self, staging: SharedStaging) -> None:
        """Give back a buffer :meth:`acquire_staging` gave (its copy's ``event`` recorded)."""
        with self._pool_lock:
            self._free.append(staging)
            extra = sorted(self._free, key=lambda b: b.shape[0])[: max(0, len(self._free) - KEPT_STAGING)]
            for b in extra:
                self._free.remove(b)
        for b in extra:
            self.forget(b)
            b.close()

    def forget(self, staging: SharedStaging) -> None:
        """The helpers unmap ``staging`` (before it is closed)."""
        with self._lock:
            gen = self._gen
            if gen is None or staging.generation != gen.number:
                return
            staging.generation = None
            for send in gen.sends:  # no reply comes
                with contextlib.suppress(OSError):
                    send.send(("unmap", staging.id))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._gen is not None:
                self._gen.stop()
                self._gen = None
        with self._pool_lock:
            free, self._free = self._free, []
        for b in free:
            b.close()


# -- a helper process ---------------------------------------------------------------------------
def _serve(recv: Connection, send: Connection) -> None:
    from ..slide import Slide, open_slide

    # Damage is logged by the caller's slide, once, from the records sent back.
    logging.getLogger("wsi_pipeline.slide.damage").setLevel(logging.ERROR)

    buffers: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    slides: dict[tuple[str, str], Slide] = {}
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
            _, sid, path, reader, level, items = msg
            out = buffers[sid][1]
            where = "cannot open the slide"
            try:
                slide = slides.get((path, reader))
                if slide is None:
                    for old in slides.values():
                        old.close()
                    slides.clear()
                    slide = slides[(path, reader)] = open_slide(path, reader)
                seen = {(t.level, t.col, t.row) for t in slide.damaged_tiles}
                for i, tx, ty in items:
                    where = f"cannot decode stored tile ({tx}, {ty}) of level {level}"
                    # The CPU reader's own decoding: the colour space its tags give, damage recorded
                    # here and handed back, where the caller's slide applies its policy.
                    slide.decode_stored_tile(level, tx, ty, out[i])
                damaged = [
                    (t.level, t.col, t.row, t.x0_level0, t.y0_level0, t.message)
                    for t in slide.damaged_tiles
                    if (t.level, t.col, t.row) not in seen
                ]
                send.send(("done", damaged))
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
