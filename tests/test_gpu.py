"""The CUDA path: torch backend, multi-stream executor, GPU JPEG decoding, TensorRT where installed.

Every test here needs a CUDA GPU and is skipped without one. The reference
is ONNX Runtime on the CPU; tolerances per precision are in ``TOLERANCES``
(fp32 convolutions run in TF32 on the GPU, cuDNN's default).
"""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers import (  # noqa: E402
    CountingLoader,
    assert_same_detections,
    make_tiny_model,
    score_threshold,
    smooth_image,
)

from wsi_pipeline.errors import BackendUnavailableError, InferenceError  # noqa: E402
from wsi_pipeline.inference.backend import create_backend  # noqa: E402
from wsi_pipeline.inference.decoders import decode  # noqa: E402
from wsi_pipeline.inference.executor import Executor  # noqa: E402
from wsi_pipeline.slide.image import ImageSlide  # noqa: E402
from wsi_pipeline.tiling.grid import TileGrid  # noqa: E402
from wsi_pipeline.tiling.loader import TileLoader  # noqa: E402

# precision -> (box px, score, heatmap) absolute tolerances against ORT fp32 on the CPU.
TOLERANCES = {"fp32": (0.5, 3e-3, 3e-3), "fp16": (2.0, 1.5e-2, 1.5e-2), "bf16": (6.0, 5e-2, 5e-2)}


@pytest.fixture(scope="module")
def card512(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model512"), tile_px=512)


@pytest.fixture(scope="module")
def slide_and_grid():
    slide = ImageSlide.from_array(smooth_image(1700, 2300, seed=11))
    return slide, TileGrid(slide)  # 512 px tiles, 64 px overlap: 4 x 5 tiles


@pytest.fixture(scope="module")
def reference(card512, slide_and_grid):
    _, grid = slide_and_grid
    ort = create_backend(card512, "ort", max_batch=8)
    tiles = np.stack([grid.read(t) for t in grid])
    return decode(ort.infer(tiles), card512)


def _executor_threads():
    return [t for t in threading.enumerate() if t.name.startswith("executor-") and t.is_alive()]


def _check(got, want, precision, card):
    box, score, heat = TOLERANCES[precision]
    assert_same_detections(got, want, threshold=score_threshold(card), box_tol=box, score_tol=score, heat_tol=heat)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_torch_cuda_equals_ort(card512, slide_and_grid, reference, precision):
    _, grid = slide_and_grid
    tiles = np.stack([grid.read(t) for t in grid])
    tb = create_backend(card512, "torch", device="cuda", precision=precision, max_batch=8)
    raw = tb.infer(tiles)
    assert {k: v.dtype.name for k, v in raw.items()} == {o.name: o.dtype for o in card512.outputs}
    assert sum(len(d) for d in reference) > 0
    _check(decode(raw, card512), reference, precision, card512)
    with Executor(tb, streams=1) as ex:
        _check(ex.infer_tiles(tiles), reference, precision, card512)
        _check(ex.infer_tiles(tiles[:3]), reference[:3], precision, card512)  # a smaller graph bucket


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_executor_streams_over_loader(card512, slide_and_grid, reference, streams, cuda_graphs):
    slide, grid = slide_and_grid
    tb = create_backend(card512, "torch", device="cuda", precision="fp16", max_batch=8, cuda_graphs=cuda_graphs)
    # batch 6 on max_batch 8: partial buckets; 20 tiles: a short last batch.
    loader = TileLoader(slide, grid, batch_size=6, workers=4, auto_release=False, max_held=2)
    counting = CountingLoader(loader)
    # streams=2 copies through the workers' own pinned buffers; the others DMA from the loader's.
    with Executor(tb, streams=streams, register_host=streams != 2) as ex:
        results = list(ex.run(counting))
    assert sorted(t.index for r in results for t in r.tiles) == list(range(len(grid)))
    for r in results:
        _check(r.detections, [reference[t.index] for t in r.tiles], "fp16", card512)
    assert counting.released == counting.given == loader.n_batches
    assert not _executor_threads()


class _FailingRunner:
    def __init__(self, inner, fail_on_call):
        self.inner, self.calls, self.fail_on_call = inner, 0, fail_on_call
        self.max_batch, self.input = inner.max_batch, inner.input

    def prepare(self):
        self.inner.prepare()

    def run(self, n):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("CUDA error: out of memory")
        return self.inner.run(n)


def test_gpu_error_names_tiles_and_stops(card512, slide_and_grid):
    slide, grid = slide_and_grid
    tb = create_backend(card512, "torch", device="cuda", precision="fp16", max_batch=4)
    make = tb.create_runner
    tb.create_runner = lambda stream: _FailingRunner(make(stream), fail_on_call=2)
    loader = TileLoader(slide, grid, batch_size=4, workers=2, auto_release=False, max_held=2)
    counting = CountingLoader(loader)
    ex = Executor(tb, streams=2)
    with pytest.raises(InferenceError, match=r"tiles \[\d+, \d+, \d+, \d+\].*out of memory"):
        for _ in ex.run(counting):
            pass
    assert not _executor_threads()
    assert counting.released == counting.given
    ex.close()


def test_gpu_jpeg_decode_matches_cpu_reader(tmp_path, card512):
    from helpers import smooth_rgb, stored_tiles_per_batch, write_pyramid_tiff

    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader

    path = tmp_path / "s.tif"
    write_pyramid_tiff(str(path), smooth_rgb(1500, 2000, seed=4), levels=2)
    slide = TiffSlide(path)
    grid = TileGrid(slide)
    ref = np.stack([grid.read(t) for t in grid])
    gpu = {}
    for decoder in ("threads", "nvjpeg"):
        for batch_size in (3, 5, 7):
            got = {}
            loader = GpuTileLoader(slide, list(grid), batch_size=batch_size, jpeg_decoder=decoder)
            for b in loader:
                b.ready.synchronize()
                for t, img in zip(b.tiles, b.images.cpu().numpy(), strict=True):
                    got[t.index] = img
            # Stored tiles shared with the previous batch are copied on the device, the others decoded.
            fresh, shared, _ = stored_tiles_per_batch(slide, list(grid), batch_size)
            dec = loader.decoder
            assert (dec.stored_tiles_decoded, dec.stored_tiles_reused) == (fresh, shared), (decoder, batch_size)
            images = np.stack([got[t.index] for t in grid])
            if decoder in gpu:  # any batch size: the same pixels
                np.testing.assert_array_equal(images, gpu[decoder])
            gpu[decoder] = images
    # libjpeg-turbo in threads: the CPU reader's pixels exactly.
    np.testing.assert_array_equal(gpu["threads"], ref)
    diff = np.abs(gpu["nvjpeg"].astype(np.int16) - ref.astype(np.int16))
    print(
        f"nvjpeg vs libjpeg-turbo: mean {diff.mean():.3f}, p99 {np.percentile(diff, 99):.0f}, "
        f"p99.99 {np.percentile(diff, 99.99):.0f}, max {diff.max()}, >32: {(diff > 32).mean():.2e}"
    )
    # nvJPEG and libjpeg-turbo differ in IDCT/chroma upsampling rounding.
    assert diff.mean() < 2.0 and np.percentile(diff, 99) <= 16
    gpu = gpu["threads"]
    # Padding past the slide edge is the background, exactly.
    last = grid[len(grid) - 1]
    w, h = slide.dimensions
    assert (gpu[-1][h - last.y0_level0 :, :] == 255).all() and (gpu[-1][:, w - last.x0_level0 :] == 255).all()

    # The executor takes device batches directly: same result as ORT on those pixels.
    tb = create_backend(card512, "torch", device="cuda", precision="fp32", max_batch=8)
    ort = create_backend(card512, "ort", max_batch=8)
    with Executor(tb, streams=2) as ex:
        results = list(ex.run(GpuTileLoader(slide, list(grid), batch_size=8, jpeg_decoder="threads"), ordered=True))
    dets = [d for r in results for d in r.detections]
    _check(dets, decode(ort.infer(gpu), card512), "fp32", card512)


@pytest.mark.parametrize("share", [7, 16])
def test_jpeg_helper_processes_share_of_a_gpu_run(tmp_path, share):
    """Helpers decode their share into page-locked shared memory, copied to the device: the CPU
    reader's pixels there, nvJPEG's elsewhere, for any batch size."""
    from helpers import smooth_rgb, write_pyramid_tiff

    from wsi_pipeline.slide.tiff_backend import TiffSlide
    from wsi_pipeline.tiling.gpu_loader import GpuTileLoader
    from wsi_pipeline.tiling.jpeg_processes import JpegHelpers, cpu_share_tile

    path = tmp_path / "s.tif"
    write_pyramid_tiff(str(path), smooth_rgb(1500, 2000, seed=4), levels=2)
    slide = TiffSlide(path)
    grid = TileGrid(slide)
    tiles = list(grid)
    ref = np.stack([grid.read(t) for t in tiles])

    def read(batch_size, helpers=None):
        got = {}
        loader = GpuTileLoader(slide, tiles, batch_size=batch_size, helpers=helpers)
        for b in loader:
            b.ready.synchronize()
            for t, img in zip(b.tiles, b.images.cpu().numpy(), strict=True):
                got[t.index] = img
        return np.stack([got[t.index] for t in tiles]), loader.decoder

    nvjpeg, _ = read(5)
    helpers = JpegHelpers(2, share)
    try:
        runs = [read(bs, helpers) for bs in (3, 5, 7)]
    finally:
        helpers.close()
    for images, dec in runs:
        np.testing.assert_array_equal(images, runs[0][0])
        assert 0 < dec.stored_tiles_by_helpers <= dec.stored_tiles_decoded
    w, h = slide.dimensions
    ar = np.arange(tiles[0].size)
    xs = np.array([t.x0_level0 for t in tiles])[:, None] + ar
    ys = np.array([t.y0_level0 for t in tiles])[:, None] + ar
    tx, ty = np.where(xs < w, xs // 256, -1)[:, None, :], np.where(ys < h, ys // 256, -1)[:, :, None]
    mine = (tx >= 0) & (ty >= 0) & cpu_share_tile(tx, ty, share)
    images = runs[0][0]
    np.testing.assert_array_equal(images[mine], ref[mine])
    np.testing.assert_array_equal(images[~mine], nvjpeg[~mine])


def test_tensorrt_backend_when_installed(tmp_path, card512, slide_and_grid, reference):
    try:
        tr = create_backend(card512, "tensorrt", max_batch=8)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    _, grid = slide_and_grid
    tiles = np.stack([grid.read(t) for t in grid])
    with Executor(tr, streams=2) as ex:
        _check(ex.infer_tiles(tiles), reference, "fp32", card512)


@pytest.fixture(scope="module")
def pathology_slide(tmp_path_factory):
    from wsi_pipeline.synthetic import write_synthetic_slide

    path = tmp_path_factory.mktemp("gpu_pipe") / "slide.tiff"
    write_synthetic_slide(path, 4096, 3072, seed=77, kind="pathology")
    return path


def test_pipeline_auto_uses_the_gpu_and_matches_the_cpu_run(pathology_slide, tmp_path):
    from wsi_pipeline import Pipeline
    from wsi_pipeline.io.detections import detection_boxes
    from wsi_pipeline.models.evaluate import detection_counts
    from wsi_pipeline.synthetic import load_truth

    with Pipeline.from_card(backend="ort") as cpu:
        ref = cpu.run(pathology_slide)
    with Pipeline.from_card(backend="auto") as gpu:
        assert gpu.backend_name in ("torch", "tensorrt")
        assert gpu.batch_size >= 8  # from the device's memory
        res = gpu.run(pathology_slide, out_dir=tmp_path / "out")
    assert res.summary["tile_decode"]["where"] == "gpu", res.summary["tile_decode"]
    assert res.summary["tile_decode"]["stored_tiles_decoded"] > 0, res.summary["tile_decode"]
    assert res.summary["tile_decode"]["stored_tiles_reused"] >= 0
    assert ref.summary["tile_decode"]["where"] == "cpu"
    truth = load_truth(str(pathology_slide).replace(".tiff", ".truth.geojson"))
    for dets in (ref.detections, res.detections):
        c = detection_counts(
            [detection_boxes(dets)],
            [dets["score"]],
            [np.zeros(len(dets), int)],
            [truth.boxes],
            [np.zeros(len(truth.boxes), int)],
        )
        assert c.precision >= 0.98 and c.recall >= 0.98, c
    assert abs(len(res.detections) - len(ref.detections)) <= 0.01 * len(ref.detections)
    tumour_cpu = ref.summary["heatmap_scores"]["tumour"]["fraction_of_tissue_above_0.5"]
    tumour_gpu = res.summary["heatmap_scores"]["tumour"]["fraction_of_tissue_above_0.5"]
    assert tumour_gpu == pytest.approx(tumour_cpu, abs=0.01)
    # The heatmap blended on the device equals the one blended on the host, within fp16 and decoder rounding.
    assert res.summary["heatmap_blended_on"].startswith("cuda"), res.summary["heatmap_blended_on"]
    assert ref.summary["heatmap_blended_on"] == "host"
    diff = np.abs(np.asarray(res.heatmap) - np.asarray(ref.heatmap))
    assert diff.mean() < 5e-3 and np.percentile(diff, 99.9) < 0.1, (diff.mean(), np.percentile(diff, 99.9))
    assert res.summary["peak_gpu_memory_mb"] > 0


def test_gpu_decoded_run_equals_cpu_decoded_run(pathology_slide):
    """The same backend fed by nvJPEG on the device and by the CPU reader: the same answers."""
    from wsi_pipeline import Pipeline
    from wsi_pipeline.io.detections import detection_boxes

    runs = {}
    for where in ("gpu", "cpu"):
        with Pipeline.from_card(backend="torch", decode=where) as pipe:
            runs[where] = pipe.run(pathology_slide)
        assert runs[where].summary["tile_decode"]["where"] == where
    g, c = runs["gpu"], runs["cpu"]
    from torchvision.ops import box_iou

    gb, cb = detection_boxes(g.detections), detection_boxes(c.detections)
    best = box_iou(torch.from_numpy(cb).cuda(), torch.from_numpy(gb).cuda()).max(dim=1).values.cpu().numpy()
    diff = np.abs(np.asarray(g.heatmap) - np.asarray(c.heatmap))
    figures = (
        f"detections gpu {len(gb)} cpu {len(cb)}; matched at IoU 0.5: {(best >= 0.5).mean():.4f}; "
        f"heatmap |diff| mean {diff.mean():.2e} p99.9 {np.percentile(diff, 99.9):.3f} max {diff.max():.3f}; "
        f"GPU decoding {g.summary['tile_decode']}"
    )
    print(figures)
    # nvJPEG and libjpeg-turbo differ by decoder rounding (a few grey levels); fp16 both ways.
    assert abs(len(gb) - len(cb)) <= 0.01 * len(cb), figures
    assert (best >= 0.5).mean() >= 0.98, figures
    assert diff.mean() < 5e-3 and np.percentile(diff, 99.9) < 0.1, figures


def test_dask_gpu_worker_matches_local_run(pathology_slide, tmp_path):
    pytest.importorskip("dask.distributed")
    from wsi_pipeline.batch import run_batch, run_key
    from wsi_pipeline.config import RunConfig
    from wsi_pipeline.inference.card import load_card
    from wsi_pipeline.pipeline import DEFAULT_MODEL, Pipeline

    config = RunConfig(model=str(DEFAULT_MODEL))
    key = run_key(config, load_card(DEFAULT_MODEL))
    local = run_batch(
        [pathology_slide], tmp_path / "local", lambda: Pipeline(config=config), config, key, progress=False
    )
    dist = run_batch([pathology_slide], tmp_path / "dask", None, config, key, progress=False, dask="local:1")
    assert local.exit_code == dist.exit_code == 0
    assert dist.outcomes[0].worker
    a = (tmp_path / "local" / "slide" / "detections.csv").read_text().splitlines()
    b = (tmp_path / "dask" / "slide" / "detections.csv").read_text().splitlines()
    assert abs(len(a) - len(b)) <= 0.002 * len(a)  # fp16 kernels may differ by a box or two between processes


@pytest.mark.parametrize("mpp", [None, 0.5])
@pytest.mark.parametrize("kind", ["synth", "tiff-ycbcr420", "tiff-ycbcr422", "tiff-ycbcr444", "tiff-rgb", "svs"])
def test_gpu_decoding_of_each_storage_kind_equals_the_cpu_reader(storage_kinds, kind, mpp):
    """Each JPEG kind on the decoder the run would choose (nvJPEG for YCbCr, nvImageCodec for RGB),
    read as stored and resampled on the device, against the CPU reader's tiles."""
    from wsi_pipeline.slide import open_slide
    from wsi_pipeline.tiling.gpu_decode import GpuTileDecoder, gpu_decode_plan
    from wsi_pipeline.tiling.grid import read_tile

    with open_slide(storage_kinds[kind]) as slide:
        grid = TileGrid(slide, 512, 64, mpp=mpp) if mpp else TileGrid(slide)
        tiles = list(grid)
        decoder, why = gpu_decode_plan(slide, tiles)
        if decoder is None and "not installed" in why:
            pytest.skip(why)
        assert decoder == ("nvimgcodec" if kind in ("tiff-rgb", "svs") else "nvjpeg"), why
        got = GpuTileDecoder(slide, device="cuda", jpeg_decoder=decoder).decode(tiles).cpu().numpy()
        diffs = np.concatenate(
            [np.abs(got[i].astype(np.int16) - read_tile(slide, t)).ravel() for i, t in enumerate(tiles)]
        )
    within = (diffs <= 2).mean()
    print(f"{kind} mpp={mpp} {decoder}: mean {diffs.mean():.3f}, within 2 levels {within:.5f}, max {diffs.max()}")
    # Chroma-subsampled JPEG: nvJPEG upsamples the chroma planes otherwise than libjpeg-turbo's
    # "fancy" (triangular) upsampling, so colour edges differ by more than rounding: measured on the
    # H200, 98.2 % of pixels within 2 levels read as stored and 96.4 % resampled (BENCHMARKS.md,
    # "Storage kinds"). 4:4:4 and RGB JPEG are exact.
    subsampled = kind in ("synth", "tiff-ycbcr420", "tiff-ycbcr422")
    assert diffs.mean() < 0.5 and within >= (0.95 if subsampled else 0.999), (kind, mpp, diffs.mean(), within)


def test_a_20x_model_on_an_aperio_40x_scan_runs_on_the_gpu_and_agrees_with_the_cpu(storage_kinds):
    from wsi_pipeline import Pipeline
    from wsi_pipeline.tiling.gpu_codecs import nvimgcodec_module

    if nvimgcodec_module() is None:
        pytest.skip("RGB JPEG on the GPU needs nvImageCodec")
    runs = {}
    for where in ("gpu", "cpu"):
        pipe = Pipeline.from_card(backend="torch", mpp=0.5, decode=where)
        try:
            runs[where] = pipe.run(storage_kinds["svs"])
        finally:
            pipe.close()
    g, c = runs["gpu"], runs["cpu"]
    assert g.summary["tile_decode"]["decoder"] == "nvimgcodec", g.summary["tile_decode"]
    assert "resampled" in g.summary["tile_decode"]["why"]
    assert c.summary["tile_decode"]["where"] == "cpu"
    assert abs(len(g.detections) - len(c.detections)) <= max(2, 0.02 * len(c.detections))
