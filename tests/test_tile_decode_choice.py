"""Which slides the GPU tile decoder takes, and the run's record of where tiles were decoded."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ConfigError
from wsi_pipeline.slide import open_slide
from wsi_pipeline.tiling import TileGrid

pytest.importorskip("torchvision")
from wsi_pipeline.tiling.gpu_decode import gpu_decode_refusal  # noqa: E402


def _tiff(path, photometric: str, compression: str = "jpeg"):
    rng = np.random.default_rng(0)
    img = np.repeat(np.repeat(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), 16, 0), 16, 1)
    # RGB JPEG (no colour transform), as Aperio stores it, needs the encoder told so.
    extra = {"compressionargs": {"outcolorspace": "RGB"}} if (photometric, compression) == ("rgb", "jpeg") else {}
    tifffile.imwrite(
        path,
        img,
        tile=(256, 256),
        photometric="rgb",
        compression=compression,
        resolution=(1e4 / 0.25, 1e4 / 0.25),
        resolutionunit="CENTIMETER",
        **extra,
    )
    return path


@pytest.mark.parametrize(
    "photometric, compression, refused",
    [
        ("ycbcr", "jpeg", None),  # tifffile's default for RGB pixels in JPEG
        ("rgb", "jpeg", "RGB JPEG tiles decoded by nvImageCodec, which is not installed"),
        ("rgb", "zlib", "ADOBE_DEFLATE, not JPEG"),
    ],
)
def test_gpu_decode_takes_ycbcr_jpeg_and_rgb_jpeg_where_nvimgcodec_is(
    tmp_path, monkeypatch, photometric, compression, refused
):
    from wsi_pipeline.tiling import gpu_decode

    monkeypatch.setattr(gpu_decode, "nvimgcodec_module", lambda: None)
    with open_slide(_tiff(tmp_path / "s.tiff", photometric, compression)) as slide:
        reason = gpu_decode_refusal(slide, list(TileGrid(slide)))
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason


def test_resized_grids_go_to_the_gpu_and_plain_images_stay_on_the_cpu(tmp_path):
    from wsi_pipeline.tiling.gpu_decode import gpu_decode_plan

    with open_slide(_tiff(tmp_path / "s.tiff", "ycbcr")) as slide:
        decoder, why = gpu_decode_plan(slide, list(TileGrid(slide, 512, 64, mpp=0.37)))
        assert decoder == "nvjpeg" and "resampled to 512 px on the device" in why, why
    png = tmp_path / "s.png"
    import cv2

    cv2.imwrite(str(png), np.zeros((600, 600, 3), np.uint8))
    with open_slide(png) as slide:
        assert "reader gives no stored tiles" in gpu_decode_refusal(slide, list(TileGrid(slide)))


def test_summary_records_where_tiles_were_decoded_and_gpu_is_refused_on_the_cpu(tmp_path):
    path = _tiff(tmp_path / "s.tiff", "ycbcr")
    with Pipeline.from_card(backend="ort", tissue="all") as pipe:
        summary = pipe.run(path).summary
        assert summary["tile_decode"]["where"] == "cpu"
        assert "ort backend runs on the CPU" in summary["tile_decode"]["why"]
    with Pipeline.from_card(backend="ort", tissue="all", decode="gpu") as pipe:
        with pytest.raises(ConfigError, match="decode = gpu"):
            pipe.run(path)


def test_failing_on_damaged_tiles_keeps_decoding_on_the_cpu(tmp_path):
    """Only the CPU decoder reports corrupt tiles: on_damaged_tile = fail chooses it, and refuses decode = gpu."""
    path = _tiff(tmp_path / "s.tiff", "ycbcr")
    with Pipeline.from_card(backend="ort", tissue="all", on_damaged_tile="fail") as pipe:
        assert "on_damaged_tile = fail" in pipe.run(path).summary["tile_decode"]["why"]
    with Pipeline.from_card(backend="ort", tissue="all", on_damaged_tile="fail", decode="gpu") as pipe:
        with pytest.raises(ConfigError, match="corrupt tiles"):
            pipe.run(path)


def test_a_batch_nvjpeg_refuses_is_decoded_by_libjpeg_turbo(tmp_path, monkeypatch):
    """The fallback inside the GPU loader (run here on the CPU device): same pixels as the CPU reader."""
    from wsi_pipeline.tiling import stored_tile_decoding
    from wsi_pipeline.tiling.gpu_decode import GpuTileDecoder
    from wsi_pipeline.tiling.grid import read_tile

    def refuse(*args, **kwargs):
        raise RuntimeError("nvjpeg: unsupported stream")

    monkeypatch.setattr(stored_tile_decoding, "nvjpeg_decode", refuse)
    with open_slide(_tiff(tmp_path / "s.tiff", "ycbcr")) as slide:
        tiles = list(TileGrid(slide))
        dec = GpuTileDecoder(slide, device="cpu", jpeg_decoder="nvjpeg", threads=2)
        try:
            got = dec.decode(tiles).numpy()
        finally:
            dec.close()
        assert dec.cpu_fallback_batches == 1
        for t, img in zip(tiles, got, strict=True):
            np.testing.assert_array_equal(img, read_tile(slide, t))


def test_the_gpu_loader_is_imported_ahead_on_a_thread_and_a_failure_is_left_to_the_real_import(monkeypatch):
    import sys

    from wsi_pipeline import tiling
    from wsi_pipeline.tiling import slide_loader

    real_torchvision = sys.modules["torchvision"]
    for name in ("gpu_loader", "gpu_decode", "gpu_codecs"):  # the loader and the modules it imports
        monkeypatch.delitem(sys.modules, f"wsi_pipeline.tiling.{name}", raising=False)
        monkeypatch.delattr(tiling, name, raising=False)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if torchvision were not installed
    slide_loader.import_gpu_loader_ahead().join(60)
    assert "wsi_pipeline.tiling.gpu_loader" not in sys.modules  # failed, quietly
    monkeypatch.setitem(sys.modules, "torchvision", real_torchvision)
    thread = slide_loader.import_gpu_loader_ahead()
    thread.join(120)
    assert not thread.is_alive() and "wsi_pipeline.tiling.gpu_loader" in sys.modules


def test_a_pipeline_imports_the_gpu_loader_ahead_only_where_it_may_decode_on_the_gpu(monkeypatch):
    from wsi_pipeline import pipeline

    started = []
    monkeypatch.setattr(pipeline, "import_gpu_loader_ahead", lambda: started.append(True))
    monkeypatch.setattr(pipeline, "cuda_may_be_present", lambda: True)
    with pipeline.Pipeline(backend="ort", writer_processes=0):
        pass
    with pipeline.Pipeline(backend="auto", decode="cpu", writer_processes=0):
        pass
    assert started == []
    monkeypatch.setattr(pipeline, "make_executor", _fail_after_the_import)
    with pytest.raises(RuntimeError, match="stop here"):
        pipeline.Pipeline(backend="torch", writer_processes=0)
    assert started == [True]


def _fail_after_the_import(*args, **kwargs):
    raise RuntimeError("stop here")
