"""Executor and torch backend on the CPU: same detections as ONNX Runtime, clean failure and shutdown."""

import threading

import numpy as np
import pytest

from wsi_pipeline.errors import ConfigError, InferenceError, ModelError, TileReadError
from wsi_pipeline.inference.backend import create_backend
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.executor import Executor
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.tiling.grid import TileGrid
from wsi_pipeline.tiling.loader import TileLoader

torch = pytest.importorskip("torch")

from helpers import (  # noqa: E402
    TILE_PX,
    CountingLoader,
    assert_same_detections,
    make_tiny_model,
    score_threshold,
    smooth_image,
)


@pytest.fixture(scope="module")
def tiny_card(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def slide():
    return ImageSlide.from_array(smooth_image(500, 620, seed=3))


def _executor_threads():
    return [t for t in threading.enumerate() if t.name.startswith("executor-") and t.is_alive()]


def _reference(card, grid):
    ort = create_backend(card, "ort")
    return {t.index: decode(ort.infer(grid.read(t)[None]), card)[0] for t in grid}


@pytest.mark.parametrize("ordered", [False, True])
def test_executor_over_loader_matches_direct_ort(tiny_card, slide, ordered):
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)
    want = _reference(tiny_card, grid)
    loader = TileLoader(slide, grid, batch_size=4, workers=2, auto_release=False, max_held=3)
    counting = CountingLoader(loader)
    with Executor.from_card(tiny_card, "ort", streams=2, max_batch=4) as ex:
        results = list(ex.run(counting, ordered=ordered))
    seen = [t.index for r in results for t in r.tiles]
    assert sorted(seen) == list(range(len(grid)))
    if ordered:
        assert [r.sequence for r in results] == list(range(len(results)))
        assert seen == list(range(len(grid)))
    for r in results:
        assert len(r.detections) == len(r.tiles)
        assert_same_detections(r.detections, [want[t.index] for t in r.tiles])
    assert counting.given == counting.released == loader.n_batches
    assert not _executor_threads()


def test_torch_cpu_backend_equals_ort(tiny_card, slide):
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)
    tiles = np.stack([grid.read(t) for t in grid])
    ort = create_backend(tiny_card, "ort")
    tb = create_backend(tiny_card, "torch", device="cpu", precision="fp32", max_batch=5)
    a, b = ort.infer(tiles), tb.infer(tiles)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
    want, got = decode(a, tiny_card), decode(b, tiny_card)
    assert sum(len(d) for d in want) > 0
    assert_same_detections(got, want, threshold=score_threshold(tiny_card))
    with Executor(tb, streams=2) as ex:
        assert_same_detections(ex.infer_tiles(tiles), want)


def test_infer_tiles_validates_input_and_keeps_order(tiny_card, slide):
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)
    tiles = np.stack([grid.read(t) for t in grid])
    ort = create_backend(tiny_card, "ort", max_batch=3)
    with Executor(ort) as ex:
        assert_same_detections(ex.infer_tiles(tiles), decode(ort.infer(tiles), tiny_card))
        assert ex.infer_tiles(tiles[:0]) == []
        with pytest.raises(ConfigError, match="uint8"):
            ex.infer_tiles(tiles.astype(np.float32))


class FailingBackend:
    """ORT, except that a batch containing tile pixels tagged 255 in the corner raises."""

    def __init__(self, card):
        self.inner = create_backend(card, "ort")
        self.card = card
        self.max_batch = 4

    def infer(self, batch):
        if (batch[:, 0, 0, 0] == 255).any():
            raise RuntimeError("CUDA error: an illegal memory access")
        return self.inner.infer(batch)

    def close(self):
        pass


def test_error_names_tiles_and_stops_cleanly(tiny_card):
    img = smooth_image(600, 900, seed=5)
    img[:, :, 0] = np.minimum(img[:, :, 0], 200)
    slide = ImageSlide.from_array(img)
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)
    bad = grid[9]
    img[bad.y0_level0, bad.x0_level0, 0] = 255
    loader = TileLoader(slide, grid, batch_size=4, workers=2, auto_release=False, max_held=2)
    counting = CountingLoader(loader)
    ex = Executor(FailingBackend(tiny_card), streams=2)
    with pytest.raises(InferenceError, match=r"tiles \[8, 9, 10, 11\].*illegal memory") as ei:
        for _ in ex.run(counting):
            pass
    assert 9 in ei.value.tile_ids and ei.value.sequence == 2
    assert not _executor_threads()
    assert counting.released == counting.given
    # The executor stays usable after a failed run.
    assert len(ex.infer_tiles(np.stack([grid.read(grid[0])]))) == 1


def test_loader_error_passes_through_and_break_stops(tiny_card, slide):
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)

    def read(s, tile, out):
        if tile.index == 6:
            raise ValueError("bad JPEG data")
        out[...] = 7

    ex = Executor(create_backend(tiny_card, "ort", max_batch=2), streams=2)
    loader = TileLoader(slide, grid, batch_size=2, workers=2, auto_release=False, read=read)
    with pytest.raises(TileReadError, match="tile 6"):
        list(ex.run(loader))
    assert not _executor_threads()
    loader = TileLoader(slide, grid, batch_size=2, workers=2, auto_release=False, max_held=2)
    counting = CountingLoader(loader)
    gen = ex.run(counting)
    next(gen)
    gen.close()
    assert not _executor_threads()
    assert counting.released == counting.given


def test_unsupported_op_is_refused_by_name(tmp_path, tiny_card):
    import onnx
    from onnx import TensorProto, helper

    from wsi_pipeline.inference.onnx_torch.module import OnnxModule

    node = helper.make_node("Einsum", ["x", "x"], ["y"], equation="ij,ij->ij")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
    )
    path = tmp_path / "einsum.onnx"
    onnx.save(helper.make_model(graph), path)
    with pytest.raises(ModelError, match=r"Einsum"):
        OnnxModule(path)
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        create_backend(tiny_card, "torch", device="cpu", precision="fp16")


def test_the_workers_end_when_the_input_ends_not_at_their_next_poll(tiny_card, slide, monkeypatch):
    """After the last batch each worker takes an end mark: a run's end does not wait for a poll timeout."""
    from wsi_pipeline.inference import executor

    monkeypatch.setattr(executor, "_POLL_S", 600.0)  # a worker left polling would hold the run for minutes
    grid = TileGrid(slide, tile_size=TILE_PX, overlap=16)
    loader = TileLoader(slide, grid, batch_size=4, workers=2, auto_release=False, max_held=3)
    got: list = []
    with Executor.from_card(tiny_card, "ort", streams=3, max_batch=4) as ex:
        run = threading.Thread(target=lambda: got.extend(ex.run(loader, ordered=True)), daemon=True)
        run.start()
        run.join(120)
        assert not run.is_alive(), "the run did not end after its last batch"
    assert sum(len(r.tiles) for r in got) == len(grid)
    assert not _executor_threads()
