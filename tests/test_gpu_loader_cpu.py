"""The GPU tile loader's assembly run on the CPU device: pixels, stored tiles decoded once, errors, early exit.

On ``device="cpu"`` the loader runs its own code without CUDA streams:
``jpeg_decoder="threads"`` (libjpeg-turbo) gives the CPU reader's pixels
exactly, ``"nvjpeg"`` there is torchvision's CPU decoder.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tifffile
from helpers import smooth_rgb, stored_tiles_per_batch, stored_tiles_under, write_pyramid_tiff

from wsi_pipeline.errors import TileReadError
from wsi_pipeline.slide.base import Slide
from wsi_pipeline.slide.tiff_backend import TiffSlide
from wsi_pipeline.tiling import TileGrid
from wsi_pipeline.tiling.grid import read_tile

pytest.importorskip("torchvision")
from wsi_pipeline.tiling.gpu_loader import GpuTileLoader  # noqa: E402

STORED = 256  # write_pyramid_tiff's stored tile side


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory):
    """2,100 x 1,700 px: a 512 px / 448 px step grid of 5 x 4 tiles whose last row and column pass the edge."""
    path = tmp_path_factory.mktemp("gpu_loader") / "s.tif"
    write_pyramid_tiff(str(path), smooth_rgb(1700, 2100, seed=7), levels=2, tile=STORED)
    return path


def _tissue_with_gaps(grid: TileGrid) -> list:
    return [t for i, t in enumerate(grid) if i % 3 != 1]


def _read_all(loader) -> dict[int, np.ndarray]:
    got = {}
    for b in loader:
        assert b.ready is None  # no CUDA events on the CPU device
        for t, img in zip(b.tiles, b.images.numpy(), strict=True):
            got[t.index] = img
    return got


def _in_thread(fn, timeout: float = 120.0):
    """Run ``fn`` in a thread; fail if it has not ended within ``timeout`` s; return its result or raise its error."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), "the loader hangs"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _decode_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("gpu-decode", "jpeg-decode"))]


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("decode_threads", [1, 2])
@pytest.mark.parametrize("batch_size", [3, 5, 7, 6])
def test_loader_on_cpu_gives_the_cpu_readers_pixels_decoding_each_stored_tile_once(
    slide_path, batch_size, decode_threads, level
):
    slide = TiffSlide(slide_path)
    grid = TileGrid(slide, level=level)
    tiles = _tissue_with_gaps(grid)
    loader = GpuTileLoader(
        slide, tiles, batch_size=batch_size, device="cpu", decode_threads=decode_threads, jpeg_decoder="threads"
    )
    got = _in_thread(lambda: _read_all(loader))
    assert sorted(got) == sorted(t.index for t in tiles)
    for t in tiles:
        np.testing.assert_array_equal(got[t.index], read_tile(slide, t), err_msg=f"tile {t.index}")
    # Each batch decodes what it does not share with the previous one and copies the rest.
    fresh, shared, distinct = stored_tiles_per_batch(slide, tiles, batch_size, STORED)
    dec = loader.decoder
    assert (dec.stored_tiles_decoded, dec.stored_tiles_reused) == (fresh, shared)
    if batch_size > grid.n_cols:
        # Batches longer than a grid row: no stored tile is shared past the next batch, each is decoded once.
        assert dec.stored_tiles_decoded == distinct
    assert dec.cpu_fallback_batches == 0
    assert not _decode_threads_alive()


def test_direct_decode_decodes_every_needed_stored_tile_once(slide_path):
    slide = TiffSlide(slide_path)
    tiles = _tissue_with_gaps(TileGrid(slide))
    loader = GpuTileLoader(slide, tiles, device="cpu", jpeg_decoder="threads")
    try:
        images = loader.decoder.decode(tiles).numpy()
    finally:
        loader.close()
    for t, img in zip(tiles, images, strict=True):
        np.testing.assert_array_equal(img, read_tile(slide, t))
    assert loader.decoder.stored_tiles_decoded == len(stored_tiles_under(slide, tiles, STORED))
    assert loader.decoder.stored_tiles_reused == 0


def test_past_the_edge_is_the_image_reflected_as_on_the_cpu(tmp_path):
    path = tmp_path / "small.tif"
    write_pyramid_tiff(str(path), smooth_rgb(300, 200, seed=3), levels=1, tile=STORED)
    slide = TiffSlide(path)
    (tile,) = TileGrid(slide)  # smaller than a tile: one tile, the rest reflected
    got = _in_thread(lambda: _read_all(GpuTileLoader(slide, [tile], device="cpu", jpeg_decoder="threads")))
    np.testing.assert_array_equal(got[tile.index], read_tile(slide, tile))
    assert not (got[tile.index][300:] == 255).all()  # not the background colour


@pytest.mark.parametrize("decode_threads", [1, 2])
def test_nvjpeg_path_on_cpu_matches_the_cpu_reader(slide_path, decode_threads):
    slide = TiffSlide(slide_path)
    grid = TileGrid(slide)
    tiles = _tissue_with_gaps(grid)
    loader = GpuTileLoader(slide, tiles, batch_size=5, device="cpu", decode_threads=decode_threads)
    got = _in_thread(lambda: _read_all(loader))
    ref = np.stack([read_tile(slide, t) for t in tiles]).astype(np.int16)
    diff = np.abs(np.stack([got[t.index] for t in tiles]).astype(np.int16) - ref)
    assert diff.mean() < 2.0 and np.percentile(diff, 99) <= 16, (diff.mean(), np.percentile(diff, 99))
    assert loader.decoder.stored_tiles_decoded + loader.decoder.stored_tiles_reused > 0
    assert loader.decoder.cpu_fallback_batches == 0


@pytest.mark.parametrize("decode_threads", [1, 2])
def test_breaking_out_early_ends_the_loader(slide_path, decode_threads):
    slide = TiffSlide(slide_path)
    tiles = list(TileGrid(slide))
    loader = GpuTileLoader(slide, tiles, batch_size=2, device="cpu", decode_threads=decode_threads, prefetch=4)

    def first_two():
        seen = []
        for b in loader:
            seen.append(b.sequence)
            if len(seen) == 2:
                break
        return seen

    assert _in_thread(first_two) == [0, 1]
    assert not _decode_threads_alive()
    _in_thread(loader.close)


@pytest.mark.parametrize("jpeg_decoder", ["threads", "nvjpeg"])
@pytest.mark.parametrize("decode_threads", [1, 2])
@pytest.mark.parametrize("failure", ["raises", "damaged"])
def test_a_stored_tile_failing_mid_slide_stops_the_loader_with_its_error(
    slide_path, monkeypatch, failure, decode_threads, jpeg_decoder
):
    slide = TiffSlide(slide_path)
    grid = TileGrid(slide)
    tiles = list(grid)
    bad = (3, 3)  # under patches of the grid's 2nd and 3rd rows: batches in the middle
    real = slide.raw_tile_jpeg

    def raw_tile_jpeg(level, tx, ty):
        if (tx, ty) == bad:
            if failure == "raises":
                raise OSError("read failed")
            return real(level, tx, ty)[:200] + b"\x00" * 100  # a cut stream
        return real(level, tx, ty)

    real_raw = slide.raw_tile

    def raw_tile(level, tx, ty):  # what the CPU reader's own decoding reads ("threads")
        if (tx, ty) == bad:
            if failure == "raises":
                raise OSError("read failed")
            return real_raw(level, tx, ty)[:200] + b"\x00" * 100
        return real_raw(level, tx, ty)

    monkeypatch.setattr(slide, "raw_tile_jpeg", raw_tile_jpeg)
    monkeypatch.setattr(slide, "raw_tile", raw_tile)
    # Batched reads through the per-tile reads above (the generic definition).
    monkeypatch.setattr(slide, "raw_tiles_jpeg", lambda level, coords: Slide.raw_tiles_jpeg(slide, level, coords))
    loader = GpuTileLoader(
        slide, tiles, batch_size=3, device="cpu", decode_threads=decode_threads, jpeg_decoder=jpeg_decoder
    )
    seen = []

    def consume():
        for b in loader:
            seen.append(b.sequence)

    with pytest.raises(OSError if failure == "raises" else TileReadError):
        _in_thread(consume)
    assert seen and len(seen) < loader.n_batches  # the batches before the failing one came through
    assert not _decode_threads_alive()


def _touched_pixel_by_pixel(xs0, ys0, size, tw, th, lw, lh) -> list:
    """Slow reference: every in-level pixel of every patch, mapped to its stored tile."""
    cells = set()
    for x0, y0 in zip(xs0, ys0, strict=True):
        for y in range(max(y0, 0), min(y0 + size, lh)):
            for x in range(max(x0, 0), min(x0 + size, lw), 1):
                cells.add((x // tw, y // th))
    return sorted(cells, key=lambda c: (c[1], c[0]))


@pytest.mark.parametrize("seed", range(4))
def test_stored_tiles_touched_equals_a_pixel_by_pixel_reference(seed):
    from wsi_pipeline.tiling.mosaic import stored_tiles_touched

    rng = np.random.default_rng(seed)
    size, tw, th = int(rng.integers(5, 40)), int(rng.integers(3, 17)), int(rng.integers(3, 17))
    lw, lh = int(rng.integers(20, 120)), int(rng.integers(20, 120))
    n = int(rng.integers(1, 12))
    xs0 = rng.integers(-size - 5, lw + 5, n).tolist()
    ys0 = rng.integers(-size - 5, lh + 5, n).tolist()
    want = _touched_pixel_by_pixel(xs0, ys0, size, tw, th, lw, lh)
    assert stored_tiles_touched(xs0, ys0, size, tw, th, lw, lh) == want
    assert stored_tiles_touched([], [], size, tw, th, lw, lh) == []


@pytest.mark.parametrize("other_size", [(STORED, STORED // 2), (STORED // 2, STORED // 2)])
def test_a_stored_tile_of_another_size_is_named(slide_path, monkeypatch, other_size):
    """One stored tile of a different size (the others stack), or all of one wrong size: a TileReadError."""
    import cv2

    slide = TiffSlide(slide_path)
    tiles = list(TileGrid(slide))[:2]
    h, w = other_size
    ok, small = cv2.imencode(".jpg", np.zeros((h, w, 3), np.uint8))
    real = slide.raw_tile_jpeg

    def raw_tile_jpeg(level, tx, ty):
        return small.tobytes() if (tx, ty) == (1, 0) or h == w else real(level, tx, ty)

    monkeypatch.setattr(slide, "raw_tile_jpeg", raw_tile_jpeg)
    monkeypatch.setattr(slide, "raw_tiles_jpeg", lambda level, coords: Slide.raw_tiles_jpeg(slide, level, coords))
    loader = GpuTileLoader(slide, tiles, batch_size=2, device="cpu", jpeg_decoder="nvjpeg")
    with pytest.raises(TileReadError, match=rf"decoded to \[{h}, {w}, 3\], expected \[{STORED}, {STORED}, 3\]"):
        _in_thread(lambda: list(loader))


JPEG_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif("not __import__('torch').cuda.is_available()")]),
]


@pytest.mark.parametrize("device", JPEG_DEVICES)
def test_the_loaders_jpeg_decode_is_torchvisions(slide_path, device):
    """``nvjpeg_decode`` calls torchvision's ops directly: the same pixels as ``torchvision.io.decode_jpeg``."""
    import torch
    import torchvision.io

    from wsi_pipeline.tiling import gpu_codecs

    assert gpu_codecs.READ_MODE_RGB == torchvision.io.ImageReadMode.RGB.value
    with TiffSlide(str(slide_path)) as slide:
        raw = [slide.raw_tile_jpeg(0, tx, ty) for ty in range(2) for tx in range(3)]
    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    got = gpu_codecs.nvjpeg_decode(data, torch.device(device))
    want = torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device=device)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        assert g.device.type == device and g.shape == (3, STORED, STORED)
        assert torch.equal(g, w)


def test_the_gpu_loader_loads_the_jpeg_ops_without_importing_torchvision():
    """Importing torchvision costs seconds (its models, torch._dynamo); the loader needs one extension of it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from wsi_pipeline.tiling import gpu_codecs, gpu_loader\n"
        "assert gpu_codecs.image_ops_loaded()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_torchvisions_jpeg_ops_the_slide_is_decoded_on_the_cpu(slide_path, monkeypatch):
    """A torchvision whose image extension is missing or differs: GPU decoding is refused, with the reason."""
    from wsi_pipeline.errors import ConfigError
    from wsi_pipeline.tiling import gpu_decode
    from wsi_pipeline.tiling.slide_loader import choose_tile_decode

    monkeypatch.setattr(gpu_decode, "image_ops_loaded", lambda: False)
    with TiffSlide(str(slide_path)) as slide:
        tiles = list(TileGrid(slide))
        assert "no JPEG decoding ops" in gpu_decode.gpu_decode_refusal(slide, tiles)
        where, why, _ = choose_tile_decode(slide, tiles, "auto", "warn", "torch", on_cuda=True)
        assert (where, "no JPEG decoding ops" in why) == ("cpu", True)
        with pytest.raises(ConfigError, match="no JPEG decoding ops"):
            gpu_decode.GpuTileDecoder(slide, device="cpu", jpeg_decoder="nvjpeg")


# -- helper processes decoding a share of the stored tiles ------------------------------------


@pytest.fixture(scope="module")
def jpeg_helpers():
    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers

    helpers = JpegHelpers(2, 16, timeout_s=60)  # every stored tile by the helpers
    yield helpers
    helpers.close()


def _stored_tile_of_each_pixel(slide, tiles) -> tuple[np.ndarray, np.ndarray]:
    """For each patch pixel, its stored tile's (tx, ty) (level 0; -1 past the level's edge)."""
    w, h = slide.dimensions
    ar = np.arange(tiles[0].size)
    xs = np.array([t.x0_level0 for t in tiles])[:, None] + ar[None, :]
    ys = np.array([t.y0_level0 for t in tiles])[:, None] + ar[None, :]
    tx = np.where(xs < w, xs // STORED, -1)[:, None, :].repeat(len(ar), 1)
    ty = np.where(ys < h, ys // STORED, -1)[:, :, None].repeat(len(ar), 2)
    return tx, ty


def _read_with_and_without_helpers(slide, tiles, helpers):
    """(the loader run with ``helpers``, its pixels by tile index, the pixels without helpers);
    ``helpers`` are closed after their run."""
    try:
        loader = GpuTileLoader(slide, tiles, batch_size=5, device="cpu", helpers=helpers)
        got = _in_thread(lambda: _read_all(loader))
    finally:
        helpers.close()
    nvjpeg = _in_thread(lambda: _read_all(GpuTileLoader(slide, tiles, batch_size=5, device="cpu")))
    return loader, got, nvjpeg


@pytest.mark.parametrize("share", [5, 16])
def test_helper_processes_decode_their_share_with_the_cpu_readers_pixels(slide_path, share):
    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers, cpu_share_tile

    slide = TiffSlide(slide_path)
    tiles = _tissue_with_gaps(TileGrid(slide))
    loader, got, nvjpeg = _read_with_and_without_helpers(slide, tiles, JpegHelpers(2, share, timeout_s=60))
    got, nvjpeg = (np.stack([d[t.index] for t in tiles]) for d in (got, nvjpeg))
    cpu = np.stack([read_tile(slide, t) for t in tiles])
    tx, ty = _stored_tile_of_each_pixel(slide, tiles)
    by_helpers = (tx >= 0) & (ty >= 0) & cpu_share_tile(tx, ty, share)
    assert by_helpers.any() and (share == 16 or not by_helpers.all())
    np.testing.assert_array_equal(got[by_helpers], cpu[by_helpers])
    np.testing.assert_array_equal(got[~by_helpers], nvjpeg[~by_helpers])
    dec = loader.decoder
    decoded = {c for b in range(0, len(tiles), 5) for c in dec.stored_tiles(tiles[b : b + 5])}
    assert 0 < dec.stored_tiles_by_helpers <= dec.stored_tiles_decoded
    assert dec.stored_tiles_by_helpers >= sum(cpu_share_tile(x, y, share) for x, y in decoded) // 2


def test_share_of_the_stored_tiles_is_the_same_along_every_row():
    from wsi_pipeline.tiling.jpeg_processes import SHARE_PERIOD, cpu_share_tile, default_helpers, default_share

    for share in range(SHARE_PERIOD + 1):
        for ty in range(5):
            assert sum(cpu_share_tile(tx, ty, share) for tx in range(SHARE_PERIOD)) == share
    assert (
        default_helpers(8) == 0 and default_helpers(12) == 6 and default_helpers(16) == 8 and default_helpers(128) == 8
    )
    assert default_share(0) == 0
    shares = [default_share(h) for h in range(1, 65)]
    assert all(0 < s <= SHARE_PERIOD - 4 for s in shares) and shares == sorted(shares)  # nvJPEG keeps some


def test_a_damaged_tile_in_the_helpers_share_is_named(tmp_path, slide_path, jpeg_helpers):
    import shutil

    from helpers import corrupt_stored_tile

    broken = tmp_path / "broken.tif"
    shutil.copy(slide_path, broken)
    with TiffSlide(broken) as s:
        across = s.tile_grid_shape(0)[2]
    i = corrupt_stored_tile(broken, index=across + 1)  # stored tile (1, 1): the helpers' at share 16
    slide = TiffSlide(broken)
    loader = GpuTileLoader(slide, list(TileGrid(slide)), batch_size=3, device="cpu", helpers=jpeg_helpers)
    with pytest.raises(TileReadError, match=rf"broken.tif: cannot decode stored tile \({i % across}, {i // across}\)"):
        _in_thread(lambda: _read_all(loader))


def test_helpers_that_hang_fail_the_batch_and_ended_ones_are_replaced(slide_path):
    import os
    import signal

    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers

    slide = TiffSlide(slide_path)
    tiles = list(TileGrid(slide))
    # Healthy helpers get all the time a loaded machine needs (starting, mapping, decoding); only
    # the stopped ones meet a short limit, which they miss whatever the load: they never answer.
    patient_s = 600
    helpers = JpegHelpers(2, 16, timeout_s=patient_s)

    def run_all() -> dict:
        loader = GpuTileLoader(slide, tiles, batch_size=3, device="cpu", helpers=helpers)
        return _in_thread(lambda: _read_all(loader))

    try:
        run_all()
        stopped = helpers.processes
        for proc in stopped:
            os.kill(proc.pid, signal.SIGSTOP)  # alive, never answering
        helpers.timeout_s = 2
        with pytest.raises(TileReadError, match="did not (finish decoding stored tiles|map a buffer) within 2 s"):
            run_all()
        helpers.timeout_s = patient_s
        assert all(proc.poll() is not None for proc in stopped)  # the hung ones were killed
        helpers.start_processes()
        ended = helpers.processes
        assert len(ended) == 2
        for proc in ended:
            proc.kill()  # between runs: the next run starts new ones
            proc.wait()
        got = run_all()
        for t in tiles:
            np.testing.assert_array_equal(got[t.index], read_tile(slide, t))
        last = helpers.processes
        assert len(last) == 2 and not set(last) & set(ended)
    finally:
        helpers.close()
    assert all(proc.poll() is not None for proc in last)


def test_without_room_for_the_shared_buffer_nvjpeg_decodes_everything(slide_path, monkeypatch, caplog):
    from wsi_pipeline.tiling import jpeg_processes
    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers

    def no_room(nbytes):
        raise OSError(f"no room for a shared buffer of {nbytes} bytes")

    monkeypatch.setattr(jpeg_processes, "_shared_file", no_room)
    slide = TiffSlide(slide_path)
    tiles = _tissue_with_gaps(TileGrid(slide))
    loader, got, nvjpeg = _read_with_and_without_helpers(slide, tiles, JpegHelpers(1, 8))
    for t in tiles:
        np.testing.assert_array_equal(got[t.index], nvjpeg[t.index])
    assert loader.decoder.stored_tiles_by_helpers == 0
    warned = [r.message for r in caplog.records if "helper processes are not used" in r.message]
    assert len(warned) == 1 and warned[0].startswith(f"{slide.path}: ") and "no room" in warned[0]


def test_requests_from_several_threads_queue_in_the_helpers(slide_path, jpeg_helpers):
    """Two threads' shares in flight at once: each gets its own tiles."""
    import imagecodecs

    slide = TiffSlide(slide_path)
    across, down = slide.tile_grid_shape(0)[2:]
    coords = [(tx, ty) for ty in range(down) for tx in range(across)]
    bufs = [jpeg_helpers.acquire_staging(len(coords), STORED, STORED, False) for _ in range(2)]
    try:
        items = [
            [(i, tx, ty) for i, (tx, ty) in enumerate(coords)],
            [(i, tx, ty) for i, (tx, ty) in enumerate(coords[::-1])],
        ]
        pending = [jpeg_helpers.start(slide.path, 0, it, b) for it, b in zip(items, bufs, strict=True)]
        for p in pending[::-1]:
            _in_thread(p.wait, 60)
        for it, b in zip(items, bufs, strict=True):
            for i, tx, ty in it:
                np.testing.assert_array_equal(b.array[i], imagecodecs.jpeg8_decode(slide.raw_tile_jpeg(0, tx, ty)))
    finally:
        for b in bufs:
            jpeg_helpers.release_staging(b)


@pytest.mark.parametrize("device", JPEG_DEVICES)
def test_the_warm_up_decodes_its_tiles_and_the_loader_then_decodes_as_before(slide_path, device):
    """``warm_up_nvjpeg`` decodes its batch (its own check: every tile, at its size) and leaves the
    decoder as it found it: a slide's stored tiles decode afterwards to torchvision's pixels."""
    import torch
    import torchvision.io

    from wsi_pipeline.tiling import gpu_codecs

    assert gpu_codecs.warm_up_nvjpeg(device, tiles=8, tile_px=64) > 0
    with TiffSlide(str(slide_path)) as slide:
        raw = [slide.raw_tile_jpeg(0, tx, 0) for tx in range(3)]
    data = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    got = gpu_codecs.nvjpeg_decode(data, torch.device(device))
    want = torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device=device)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_pipeline_warms_nvjpeg_up_on_its_import_thread_only_where_cuda_is(monkeypatch):
    import torch

    from wsi_pipeline.tiling import gpu_codecs, slide_loader

    calls = []
    monkeypatch.setattr(gpu_codecs, "warm_up_nvjpeg", lambda: calls.append(True) or 0.0)
    for available, warm_up in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda a=available: a)
        slide_loader.import_gpu_loader_ahead(warm_up=warm_up).join(60)
    assert calls == [True]


def test_the_interpreter_waits_at_exit_for_the_warm_up_under_way(tmp_path):
    """A script that exits while the import thread is still warming nvJPEG up waits for it: the
    thread is not stopped inside its call (here a stand-in that sleeps, then leaves a mark)."""
    import subprocess
    import sys

    mark = tmp_path / "warmed"
    script = (
        "import threading, time, torch\n"
        "from wsi_pipeline.tiling import gpu_codecs, slide_loader\n"
        "torch.cuda.is_available = lambda: True\n"
        "started = threading.Event()\n"
        f"def slow():\n    started.set()\n    time.sleep(1.5)\n    open({str(mark)!r}, 'w').close()\n    return 1.5\n"
        "gpu_codecs.warm_up_nvjpeg = slow\n"
        "slide_loader.import_gpu_loader_ahead()\n"
        "assert started.wait(60)\n"  # the script ends while the warm-up is under way
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert mark.exists()


@pytest.mark.parametrize("policy", ["warn", "fail"])
def test_damage_the_helpers_see_is_the_slides_and_follows_its_policy(tmp_path, slide_path, jpeg_helpers, policy):
    """A stored tile decoded by a helper process with a corrupt-data warning is recorded by the
    run's own slide (counted, or failing the slide under the fail policy), not left in the helper."""
    import shutil

    broken = tmp_path / "damaged.tif"
    shutil.copy(slide_path, broken)
    with tifffile.TiffFile(broken) as tif:
        page = tif.pages[0]
        across = -(-page.imagewidth // page.tilewidth)
        off, n = page.dataoffsets[across + 1], page.databytecounts[across + 1]  # stored tile (1, 1)
    with open(broken, "r+b") as f:
        f.seek(off + n // 2)
        f.write(b"\0" * (n - n // 2))  # truncated: decodes, with "Premature end of JPEG file"
    slide = TiffSlide(broken)
    slide.on_damaged_tile = policy
    loader = GpuTileLoader(slide, list(TileGrid(slide)), batch_size=3, device="cpu", helpers=jpeg_helpers)
    if policy == "fail":
        with pytest.raises(TileReadError, match=r"damaged.tif: stored tile \(1, 1\) of level 0 is damaged"):
            _in_thread(lambda: _read_all(loader))
    else:
        _in_thread(lambda: _read_all(loader))
        assert [(t.col, t.row) for t in slide.damaged_tiles] == [(1, 1)]
        assert loader.decoder.stored_tiles_by_helpers > 0
