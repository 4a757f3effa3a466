"""Executor and torch backend on the CPU: same detections as ONNX Runtime, clean failure and shutdown."""

import threading

import numpy as np
import pytest

from wsi_pipeline.errors import ConfigError, ModelError, TileReadError
from wsi_pipeline.inference.backend import create_backend
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.executor import BatchInferenceError, Executor
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.tiling.grid import TileGrid
from wsi_pipeline.tiling.loader import TileLoader

torch = pytest.importorskip("torch")

TILE_PX = 128


def make_tiny_model(out_dir, tile_px: int = TILE_PX, seed: int = 0):
    """A randomly initialised detector of the demo architecture, exported to ONNX + card.

    Its score threshold is set from the model's own scores on smooth test
    images so that at most half of the top-k peaks of any tile pass: results
    stay independent of how the architecture's untrained output happens to be
    distributed, and the top-k cut never lies near the threshold.
    """
    import dataclasses

    from wsi_pipeline.inference.card import load_card, write_card
    from wsi_pipeline.models.export import export_with_card
    from wsi_pipeline.models.net import CenterNetSmall

    torch.manual_seed(seed)
    net = CenterNetSmall(2, 3).eval()
    with torch.no_grad():
        for m in net.modules():  # non-trivial batch norms, so folding them is exercised
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
        net.center_head.weight.mul_(50.0)  # spread the peak scores
    top_k = 48
    card = export_with_card(
        net, out_dir / "tiny.onnx", name="tiny", version="0", class_names=["cell", "debris"],
        class_colors=["#ff0000", "#00ff00"], region_classes=["tumour", "stroma", "other"],
        top_k=top_k, mpp=0.5, score_threshold=0.5, tile_px=tile_px)
    probe = np.stack([smooth_image(tile_px, tile_px, seed=100 + i) for i in range(6)])
    scores = create_backend(card, "ort").infer(probe)["scores"]
    threshold = float(np.sort(scores, axis=1)[:, ::-1][:, top_k // 2].max()) + 1e-3
    params = {**card.decoder.params, "score_threshold": round(threshold, 6)}
    card = dataclasses.replace(card, decoder=dataclasses.replace(card.decoder, params=params))
    return load_card(write_card(card))


def score_threshold(card) -> float:
    return float(card.decoder.params["score_threshold"])


def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    import cv2

    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, h // 16), max(2, w // 16), 3)) * 255).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    return np.clip(img.astype(int) + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)


def _unmatched(a, b, box_tol, score_tol):
    """Indices of ``a``'s detections with no partner in ``b`` (same label, close box and score)."""
    free = list(range(len(b)))
    missing = []
    for i in range(len(a)):
        for j in free:
            if a.labels[i] == b.labels[j] and abs(a.scores[i] - b.scores[j]) <= score_tol \
                    and np.abs(a.boxes[i] - b.boxes[j]).max() <= box_tol:
                free.remove(j)
                break
        else:
            missing.append(i)
    return missing


def assert_same_detections(got, want, threshold=None, box_tol=1e-3, score_tol=1e-4, heat_tol=1e-4):
    """Same detections per tile, up to order among near-equal scores.

    A detection may lack a partner only when its score is within ``score_tol``
    of the decoder's ``threshold`` (it may fall on either side).
    """
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.labels.dtype == np.int64 and g.boxes.dtype == np.float32 and g.scores.dtype == np.float32
        assert np.all(np.diff(g.scores) <= 0), "detections must come sorted by score"
        for a, b in ((g, w), (w, g)):
            for i in _unmatched(a, b, box_tol, score_tol):
                assert threshold is not None and abs(a.scores[i] - threshold) <= score_tol, \
                    f"detection {a.boxes[i]} {a.scores[i]} label {a.labels[i]} has no partner"
        np.testing.assert_allclose(g.heatmap, w.heatmap, atol=heat_tol)


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


class CountingLoader:
    """Wraps a loader's batches, counting releases (the executor must release every batch)."""

    def __init__(self, loader):
        self.loader = loader
        self.given = 0
        self.released = 0
        self._lock = threading.Lock()

    def __iter__(self):
        for batch in self.loader:
            self.given += 1
            inner = batch._release

            def release(inner=inner):
                with self._lock:
                    self.released += 1
                inner()
            batch._release = release
            yield batch


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
    with pytest.raises(BatchInferenceError, match=r"tiles \[8, 9, 10, 11\].*illegal memory") as ei:
        for _ in ex.run(counting):
            pass
    assert 9 in ei.value.tile_indices and ei.value.sequence == 2
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

    from wsi_pipeline.inference.torch_backend import OnnxModule

    node = helper.make_node("Einsum", ["x", "x"], ["y"], equation="ij,ij->ij")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    path = tmp_path / "einsum.onnx"
    onnx.save(helper.make_model(graph), path)
    with pytest.raises(ModelError, match=r"Einsum"):
        OnnxModule(path)
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        create_backend(tiny_card, "torch", device="cpu", precision="fp16")
