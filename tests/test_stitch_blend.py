"""Heatmap blending: weights, streaming band blender, agreement with MONAI."""

from __future__ import annotations

import tracemalloc

import cv2
import numpy as np
import pytest

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.stitch import BlendGeometry, HeatmapBlender, tile_weights


class Collect:
    """A sink that checks the streaming contract and assembles the output."""

    def __init__(self, channels: int, height: int, width: int):
        self.out = np.full((channels, height, width), np.nan, dtype=np.float32)
        self.next_row = 0
        self.calls = 0

    def __call__(self, y0: int, rows: np.ndarray) -> None:
        assert y0 == self.next_row, "rows must come top to bottom without gaps"
        assert rows.dtype == np.float32
        assert rows.shape[0] == self.out.shape[0] and rows.shape[2] == self.out.shape[2]
        self.out[:, y0 : y0 + rows.shape[1]] = rows
        self.next_row = y0 + rows.shape[1]
        self.calls += 1


def naive_blend(geom: BlendGeometry, tiles: dict, skipped: set, weights: np.ndarray, channels: int):
    """Whole-canvas reference: sum(w * p) / sum(w)."""
    num = np.zeros((channels, geom.canvas_height, geom.canvas_width))
    den = np.zeros((geom.canvas_height, geom.canvas_width))
    t = geom.tile_size_out
    for (r, c), p in tiles.items():
        y, x = geom.row_y0(r), geom.col_x0(c)
        num[:, y : y + t, x : x + t] += p * weights
        den[y : y + t, x : x + t] += weights
    for r, c in skipped:
        y, x = geom.row_y0(r), geom.col_x0(c)
        den[y : y + t, x : x + t] += weights
    out = num / den
    return out[:, : geom.out_height, : geom.out_width]


def shuffled_within_window(n_rows: int, n_cols: int, window: int, rng) -> list[tuple[int, int]]:
    """All tiles, each arriving at most ``window - 1`` rows ahead of the first incomplete row."""
    order = []
    pending = [(r, c) for r in range(n_rows) for c in range(n_cols)]
    done = np.zeros((n_rows, n_cols), dtype=bool)
    while pending:
        first_open = int(np.argmin(done.all(1))) if not done.all() else n_rows
        allowed = [k for k, (r, _) in enumerate(pending) if r < first_open + window]
        k = allowed[int(rng.integers(len(allowed)))]
        r, c = pending.pop(k)
        done[r, c] = True
        order.append((r, c))
    return order


@pytest.mark.parametrize("kind", ["gaussian", "hann", "linear", "constant"])
def test_streaming_blend_equals_whole_canvas_blend_out_of_order(kind):
    rng = np.random.default_rng(1)
    geom = BlendGeometry(n_rows=6, n_cols=4, tile_size_out=16, step_out=12, out_height=60, out_width=45)
    channels = 2
    weights = tile_weights(16, kind, overlap_px=4)
    tiles = {
        (r, c): rng.random((channels, 16, 16)).astype(np.float32)
        for r in range(geom.n_rows)
        for c in range(geom.n_cols)
    }
    skipped = {(2, 1), (5, 3)}
    for key in skipped:
        del tiles[key]
    expected = naive_blend(geom, tiles, skipped, weights, channels)

    results = []
    for order in (
        [(r, c) for r in range(geom.n_rows) for c in range(geom.n_cols)],
        shuffled_within_window(geom.n_rows, geom.n_cols, 3, rng),
    ):
        sink = Collect(channels, geom.out_height, geom.out_width)
        blender = HeatmapBlender(geom, channels, weights, sink, window_rows=3)
        for r, c in order:
            if (r, c) in skipped:
                blender.skip(r, c)
            else:
                blender.add(r, c, tiles[(r, c)])
        blender.close()
        assert sink.next_row == geom.out_height
        np.testing.assert_allclose(sink.out, expected, atol=1e-5)
        results.append(sink.out)
    # Out-of-order arrival gives the same result.
    np.testing.assert_allclose(results[0], results[1], atol=1e-6)


def test_skipping_a_run_of_tiles_equals_skipping_each():
    rng = np.random.default_rng(2)
    geom = BlendGeometry(n_rows=4, n_cols=7, tile_size_out=16, step_out=12, out_height=50, out_width=80)
    weights = tile_weights(16, "gaussian")
    skipped = {(0, c) for c in range(7)} | {(1, c) for c in range(2, 6)} | {(3, 6)}
    tiles = {
        (r, c): rng.random((1, 16, 16)).astype(np.float32) for r in range(4) for c in range(7) if (r, c) not in skipped
    }
    sink = Collect(1, geom.out_height, geom.out_width)
    blender = HeatmapBlender(geom, 1, weights, sink, window_rows=2)
    blender.skip(0, 0, 7)
    for r in range(1, 4):
        c = 0
        while c < 7:
            if (r, c) in skipped:
                stop = c
                while stop < 7 and (r, stop) in skipped:
                    stop += 1
                blender.skip(r, c, stop)
                c = stop
            else:
                blender.add(r, c, tiles[(r, c)])
                c += 1
    blender.close()
    np.testing.assert_allclose(sink.out, naive_blend(geom, tiles, skipped, weights, 1), atol=1e-5)
    with pytest.raises(WSIPipelineError, match=r"row 3, col 6\) arrived after the blender was closed"):
        blender.skip(3, 6, 7)


def tile_prediction(image: np.ndarray, stride: int) -> np.ndarray:
    """A translation-equivariant 'model': 2-channel sigmoid of s x s block means."""
    h, w = image.shape
    pooled = image.reshape(h // stride, stride, w // stride, stride).mean(axis=(1, 3))
    return np.stack([1 / (1 + np.exp(-(pooled - 0.5) * 6)), pooled**2]).astype(np.float32)


def run_tiled(image, tile, overlap, stride, kind, geom=None, window_rows=2):
    """Tile ``image`` as the grid places tiles, padding the rest, blend the tiles' predictions."""
    h, w = image.shape
    if geom is None:
        geom = BlendGeometry.from_tiling(TilingGeometry(w, h, tile, overlap, heatmap_stride=stride))
    padded = np.zeros((geom.canvas_height * stride, geom.canvas_width * stride), dtype=image.dtype)
    padded[:h, :w] = image
    sink = Collect(2, geom.out_height, geom.out_width)
    blender = HeatmapBlender(
        geom, 2, tile_weights(tile // stride, kind, overlap_px=overlap // stride), sink, window_rows=window_rows
    )
    for r in range(geom.n_rows):
        for c in range(geom.n_cols):
            y0, x0 = geom.row_y0(r) * stride, geom.col_x0(c) * stride  # the last ones end at the border
            patch = padded[y0 : y0 + tile, x0 : x0 + tile]
            blender.add(r, c, tile_prediction(patch, stride))
    blender.close()
    return sink.out


@pytest.mark.parametrize("kind", ["gaussian", "hann", "linear"])
def test_blend_of_equivariant_predictor_equals_untiled_prediction(kind):
    rng = np.random.default_rng(5)
    # A smooth random field, 300 x 236 px (not a multiple of the step: the last
    # tiles are moved back to end at the image's border, off the lattice).
    coarse = rng.random((12, 10))
    image = cv2.resize(coarse, (236, 300), interpolation=cv2.INTER_CUBIC).astype(np.float64)
    stride = 4
    got = run_tiled(image, tile=64, overlap=16, stride=stride, kind=kind)
    assert got.shape == (2, 75, 59)
    whole = tile_prediction(image, stride)
    np.testing.assert_allclose(got, whole, atol=1e-5)


def test_blend_matches_monai_sliding_window_inference():
    torch = pytest.importorskip("torch")
    monai_inferers = pytest.importorskip("monai.inferers")
    rng = np.random.default_rng(9)
    # roi 64, overlap 0.25 -> MONAI's interval int(64 * 0.75) = 48; an image of
    # 64 + 48 k pixels puts MONAI's windows exactly on our step lattice.
    h, w = 64 + 48 * 4, 64 + 48 * 2
    image = rng.random((h, w)).astype(np.float32)

    def predictor(x):  # N x 1 x H x W -> N x 2 x H x W, position-dependent per window
        return torch.cat([torch.sigmoid(x * 3 - 1.5), x**2 + x.mean(dim=(2, 3), keepdim=True)], dim=1)

    expected = monai_inferers.sliding_window_inference(
        torch.from_numpy(image)[None, None],
        roi_size=(64, 64),
        sw_batch_size=4,
        predictor=predictor,
        overlap=0.25,
        mode="gaussian",
        sigma_scale=0.125,
        padding_mode="constant",
    )[0].numpy()

    geom = BlendGeometry(n_rows=5, n_cols=3, tile_size_out=64, step_out=48, out_height=h, out_width=w)
    sink = Collect(2, h, w)
    blender = HeatmapBlender(geom, 2, tile_weights(64, "gaussian", sigma_scale=0.125), sink)
    for r in range(geom.n_rows):
        for c in range(geom.n_cols):
            patch = torch.from_numpy(image[r * 48 : r * 48 + 64, c * 48 : c * 48 + 64])[None, None]
            blender.add(r, c, predictor(patch)[0].numpy())
    blender.close()
    np.testing.assert_allclose(sink.out, expected, atol=1e-4)


def test_gaussian_weights_equal_monai_importance_map():
    pytest.importorskip("torch")
    monai_utils = pytest.importorskip("monai.data.utils")
    for size, sigma_scale in ((64, 0.125), (56, 0.25), (7, 0.05)):
        expected = monai_utils.compute_importance_map((size, size), mode="gaussian", sigma_scale=sigma_scale).numpy()
        np.testing.assert_allclose(tile_weights(size, "gaussian", sigma_scale=sigma_scale), expected, rtol=1e-6)


def test_weight_shapes_and_properties():
    for kind in ("gaussian", "hann", "linear", "constant"):
        wgt = tile_weights(32, kind, overlap_px=8)
        assert wgt.shape == (32, 32) and wgt.dtype == np.float32
        assert (wgt > 0).all()
        np.testing.assert_allclose(wgt, wgt[::-1, ::-1], atol=1e-7)
    linear = tile_weights(32, "linear", overlap_px=8)
    assert (linear[8:24, 8:24] == 1).all()
    # Ramps of two tiles overlapping by 8 add up to one.
    np.testing.assert_allclose(linear[16, 24:] + linear[16, :8], 1.0, atol=1e-6)


def test_skipped_tiles_give_background():
    geom = BlendGeometry(n_rows=2, n_cols=2, tile_size_out=8, step_out=6, out_height=14, out_width=14)
    ones = np.ones((1, 8, 8), dtype=np.float32)
    weights = tile_weights(8, "constant")
    sink = Collect(1, 14, 14)
    blender = HeatmapBlender(geom, 1, weights, sink)
    blender.add(0, 0, ones)
    blender.skip(0, 1)
    blender.skip(1, 0)
    blender.skip(1, 1)
    blender.close()
    out = sink.out[0]
    assert (out[:6, :6] == 1).all()  # only tile (0, 0)
    assert (out[8:, :] == 0).all() and (out[:, 8:] == 0).all()  # only skipped tiles
    np.testing.assert_allclose(out[:6, 6:8], 0.5)  # (0, 0) blended with a skipped tile
    np.testing.assert_allclose(out[6:8, 6:8], 0.25)


def test_band_memory_does_not_grow_with_height():
    weights = tile_weights(32, "gaussian")

    def run(n_rows: int) -> tuple[tuple, int]:
        geom = BlendGeometry(
            n_rows=n_rows, n_cols=8, tile_size_out=32, step_out=28, out_height=(n_rows - 1) * 28 + 32, out_width=200
        )
        tile = np.full((3, 32, 32), 0.5, dtype=np.float32)
        tracemalloc.start()
        blender = HeatmapBlender(geom, 3, weights, lambda y0, rows: None, window_rows=2)
        for r in range(n_rows):
            for c in range(8):
                blender.add(r, c, tile)
        blender.close()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return blender.buffer_shapes, peak

    shapes_short, peak_short = run(4)
    shapes_tall, peak_tall = run(60)
    assert shapes_short == shapes_tall == ((3, 120, 228), (32, 228))  # twice the 60-row band; one row of weights
    assert peak_tall < peak_short * 1.2 + 50_000


def test_arrival_errors_name_the_tile():
    geom = BlendGeometry(n_rows=5, n_cols=2, tile_size_out=8, step_out=6, out_height=32, out_width=14)
    blender = HeatmapBlender(geom, 1, tile_weights(8, "constant"), lambda y0, rows: None, window_rows=2)
    tile = np.zeros((1, 8, 8), dtype=np.float32)
    blender.add(0, 0, tile)
    with pytest.raises(WSIPipelineError, match=r"row 2, col 0.*window"):
        blender.add(2, 0, tile)
    with pytest.raises(WSIPipelineError, match=r"row 0, col 0.*twice"):
        blender.add(0, 0, tile)
    with pytest.raises(WSIPipelineError, match=r"row 1, col 1.*shape"):
        blender.add(1, 1, np.zeros((2, 8, 8), dtype=np.float32))
    blender.add(0, 1, tile)  # row 0 complete: its rows are flushed
    with pytest.raises(WSIPipelineError, match=r"row 0, col 1"):
        blender.skip(0, 1)
    with pytest.raises(WSIPipelineError, match=r"row 1, col 0"):
        blender.close()


def test_background_sink_keeps_order_and_raises_the_sinks_failure():
    from wsi_pipeline.errors import ClosedError
    from wsi_pipeline.stitch.sinks import BackgroundSink

    seen = []
    bg = BackgroundSink(lambda y0, rows: seen.append((y0, rows.shape[1])), max_pending=2)
    for y0 in range(0, 50, 5):
        bg(y0, np.zeros((1, 5, 3), np.float32))
    bg.close()
    bg.close()
    assert seen == [(y0, 5) for y0 in range(0, 50, 5)]
    with pytest.raises(ClosedError):
        bg(50, np.zeros((1, 5, 3), np.float32))

    def failing(y0, rows):
        if y0 >= 10:
            raise OSError("disk full")

    bg = BackgroundSink(failing, max_pending=1)
    with pytest.raises(OSError, match="disk full"):
        for y0 in range(0, 1000, 5):  # the failure reaches the caller while it still hands rows over
            bg(y0, np.zeros((1, 5, 3), np.float32))
    with pytest.raises(OSError, match="disk full"):
        bg.close()

    # Two sinks on two threads: each gets every band in order; a failure of either reaches the caller.
    first, second = [], []
    bg = BackgroundSink(lambda y0, rows: first.append(y0), lambda y0, rows: second.append(y0), max_pending=2)
    for y0 in range(0, 50, 5):
        bg(y0, np.zeros((1, 5, 3), np.float32))
    bg.close()
    assert first == second == list(range(0, 50, 5))
    bg = BackgroundSink(lambda y0, rows: None, failing, max_pending=1)
    with pytest.raises(OSError, match="disk full"):
        for y0 in range(0, 1000, 5):
            bg(y0, np.zeros((1, 5, 3), np.float32))
    with pytest.raises(OSError, match="disk full"):
        bg.close()
    with pytest.raises(ValueError, match="at least one sink"):
        BackgroundSink()


def test_background_sink_reads_copied_rows_only_after_their_copy():
    """``put_copy``: each sink's thread waits for the copy's event before the sink sees the rows."""
    import threading

    from wsi_pipeline.stitch.blend import HostCopy
    from wsi_pipeline.stitch.sinks import BackgroundSink

    class Copying:  # stands in for a CUDA event: the rows are written when it completes
        def __init__(self, rows: np.ndarray, value: float):
            self.rows, self.value, self.lock = rows, value, threading.Lock()

        def synchronize(self) -> None:
            with self.lock:
                self.rows[...] = self.value

    seen: dict[str, list[float]] = {"a": [], "b": []}
    bg = BackgroundSink(
        lambda y0, rows: seen["a"].append(float(rows.min())),
        lambda y0, rows: seen["b"].append(float(rows.max())),
        max_pending=2,
    )
    for k in range(20):
        rows = np.full((1, 3, 4), -1.0, np.float32)  # not yet copied
        bg.put_copy(3 * k, HostCopy(rows, Copying(rows, float(k))))
    bg.close()
    assert seen["a"] == seen["b"] == [float(k) for k in range(20)]


# 7: tiles two columns apart overlap, one add per tile; shift 5: the last row and column end at the border
@pytest.mark.parametrize("step,shift", [(12, 0), (7, 0), (12, 5)])
def test_adding_a_run_of_tiles_equals_the_whole_canvas_blend(step, shift):
    rng = np.random.default_rng(3)
    n_cols = 11
    geom = BlendGeometry(
        n_rows=3,
        n_cols=n_cols,
        tile_size_out=16,
        step_out=step,
        out_height=2 * step + 16 - shift,
        out_width=(n_cols - 1) * step + 16 - shift,
        last_row_shift_out=shift,
        last_col_shift_out=shift,
    )
    weights = tile_weights(16, "gaussian")
    present = {0: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1: [1, 2, 4, 5, 6, 9], 2: [3, 7]}
    tiles = {(r, c): rng.random((2, 16, 16)).astype(np.float32) for r, cs in present.items() for c in cs}
    skipped = {(r, c) for r in range(3) for c in range(n_cols) if (r, c) not in tiles}
    sink = Collect(2, geom.out_height, geom.out_width)
    blender = HeatmapBlender(geom, 2, weights, sink, window_rows=2)
    for r, cs in present.items():
        for c in range(n_cols):
            if (r, c) in skipped:
                blender.skip(r, c)
        blender.add_run(r, np.array(cs), np.stack([tiles[(r, c)] for c in cs]))
    blender.close()
    np.testing.assert_allclose(sink.out, naive_blend(geom, tiles, skipped, weights, 2), atol=1e-5)
    with pytest.raises(WSIPipelineError, match="expected heatmaps of shape"):
        HeatmapBlender(geom, 2, weights, sink).add_run(0, np.array([0, 1]), np.zeros((2, 1, 16, 16), np.float32))


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _has_cuda() -> bool:
    if not _has_torch():
        return False
    import torch

    return torch.cuda.is_available()


BLEND_DEVICES = [
    None,
    pytest.param("cpu", marks=pytest.mark.skipif(not _has_torch(), reason="needs torch")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device", BLEND_DEVICES)
@pytest.mark.parametrize("step", [12, 7])
@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("shift", [0, 5])  # 5: the last row and column moved back to end at the border
def test_blending_on_a_device_equals_the_whole_canvas_blend(device, step, background, shift):
    """Numpy on the host, torch on the CPU and on CUDA: runs with gaps, single tiles, skips, all alike.

    ``background``: the rows go through a :class:`BackgroundSink` (two sinks on two threads), which
    takes them while their copy from the device is under way (``put_copy``).
    """
    from wsi_pipeline.stitch.sinks import BackgroundSink

    rng = np.random.default_rng(5)
    n_rows, n_cols = 5, 13
    geom = BlendGeometry(
        n_rows=n_rows,
        n_cols=n_cols,
        tile_size_out=16,
        step_out=step,
        out_height=(n_rows - 1) * step + 11 - shift,
        out_width=(n_cols - 1) * step + 9 - shift,
        last_row_shift_out=shift,
        last_col_shift_out=shift,
    )
    weights = tile_weights(16, "hann")
    present = {
        0: list(range(n_cols)),
        1: [0, 1, 2, 4, 5, 6, 7, 9, 12],
        2: [5],
        3: [1, 2, 3, 4, 8, 9, 10, 11],
        4: [],
    }
    tiles = {(r, c): rng.random((3, 16, 16)).astype(np.float32) for r, cs in present.items() for c in cs}
    skipped = {(r, c) for r in range(n_rows) for c in range(n_cols) if (r, c) not in tiles}
    sink = Collect(3, geom.out_height, geom.out_width)
    other = Collect(3, geom.out_height, geom.out_width)
    given = BackgroundSink(sink, other, max_pending=2) if background else sink
    blender = HeatmapBlender(geom, 3, weights, given, window_rows=2, device=device)
    for r, cs in present.items():
        for c in range(n_cols):
            if (r, c) in skipped:
                blender.skip(r, c)
        hm = np.stack([tiles[(r, c)] for c in cs]) if cs else np.zeros((0, 3, 16, 16), np.float32)
        if device is not None:
            import torch

            hm = torch.from_numpy(hm).to(device)
        if r == 2:
            blender.add(r, cs[0], hm[0])
        else:
            blender.add_run(r, np.array(cs, np.int64), hm)
    blender.close()
    if background:
        given.close()
        np.testing.assert_array_equal(other.out, sink.out)
    assert sink.next_row == geom.out_height
    np.testing.assert_allclose(sink.out, naive_blend(geom, tiles, skipped, weights, 3), atol=1e-5)
