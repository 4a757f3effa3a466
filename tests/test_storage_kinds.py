"""The same pixels stored as scanners store them: each kind read by the project's reader as
OpenSlide reads it, its JPEG kind told from the file, its grid assembled by the GPU loader's code
(on the CPU device) as the CPU reader reads it, resampled grids included, and the pipeline's
detections the same whatever the storage."""

from __future__ import annotations

import imagecodecs
import numpy as np
import openslide
import pytest
import tifffile

from wsi_pipeline.slide import detect_backend, open_slide
from wsi_pipeline.slide.jpeg_kind import jpeg_kind
from wsi_pipeline.synthetic.storage import STORAGE_KINDS, split_jpeg_tables
from wsi_pipeline.tiling import TileGrid
from wsi_pipeline.tiling.grid import read_tile

KIND_NAMES = {
    "tiff-ycbcr420": "YCbCr 4:2:0",
    "tiff-ycbcr422": "YCbCr 4:2:2",
    "tiff-ycbcr444": "YCbCr 4:4:4",
    "tiff-rgb": "RGB",
    "svs": "RGB",
    "tiff-subifds-ycbcr444": "YCbCr 4:4:4",
    "tiff-subifds-rgb": "RGB",
    "tiff-one-level": "YCbCr 4:4:4",
    "svs-j2k": None,
}
# Pyramids in page 0's SubIFDs: OpenSlide sees level 0; the project the same level 0 and the SubIFDs.
SUBIFD_KINDS = ("tiff-subifds-ycbcr444", "tiff-subifds-rgb")


def _lattice(slide, step=448, size=512):
    w, h = slide.dimensions
    return [(x, y) for y in range(0, h, step) for x in range(0, w, step)], size


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_each_kind_reads_as_openslide_reads_it(storage_kinds, kind):
    path = storage_kinds[kind]
    assert detect_backend(path) == "tifffile"
    osr = openslide.OpenSlide(path)
    with open_slide(path) as slide:
        assert slide.backend == "tifffile"
        if kind in SUBIFD_KINDS:
            assert osr.level_count == 1 and slide.level_dimensions[0] == tuple(osr.level_dimensions[0])
            assert slide.level_count == 3 and any("SubIFD" in n for n in slide.level_notes)
        else:
            assert slide.level_dimensions == tuple(tuple(d) for d in osr.level_dimensions)
        assert slide.mpp == pytest.approx((0.25, 0.25))
        assert slide.stored_tile_format(0)["jpeg_kind"] == KIND_NAMES[kind]
        if kind == "svs-j2k":
            assert slide.stored_tile_format(0)["compression"] == "APERIO_JP2000_YCBC"
        origins, size = _lattice(slide)
        diffs = []
        for level in range(osr.level_count):
            for x, y in origins[:: 3 if level == 0 else 1]:
                ours = slide.read_region((x, y), level, (size, size)).astype(np.int16)
                rgba = np.asarray(osr.read_region((x, y), level, (size, size)))
                inside = rgba[..., 3] == 255  # OpenSlide leaves what is outside the level transparent
                ref = rgba[..., :3].astype(np.int16)
                diffs.append(np.abs(ours - ref).max(axis=2)[inside])
                assert (ours[~inside] == 255).all()  # the background, white
    within = (np.concatenate(diffs) <= 2).mean()
    assert within >= 0.999, f"{kind}: {within:.5f} of pixels within 2 levels of OpenSlide's"


def test_the_svs_is_aperio_with_shared_tables_and_its_side_images_are_no_levels(storage_kinds):
    path = storage_kinds["svs"]
    osr = openslide.OpenSlide(path)
    assert osr.properties["openslide.vendor"] == "aperio"
    assert set(osr.associated_images) == {"thumbnail", "label", "macro"}
    with tifffile.TiffFile(path) as tif:
        assert tif.is_svs and tif.pages[0].jpegtables is not None
        first = tif.pages[0]
        tif.filehandle.seek(first.dataoffsets[0])
        data = tif.filehandle.read(first.databytecounts[0])
        assert b"\xff\xdb" not in data[:200]  # no quantisation table in the tile: they are shared
    with open_slide(path) as slide:
        assert slide.vendor == "aperio"
        assert slide.level_count == 2  # level 0 and the 4x level; thumbnail, label, macro are not levels
        assert slide.level_downsamples[1] == pytest.approx(4, rel=1e-3)
        assert slide.properties["aperio.MPP"] == "0.25"


@pytest.mark.parametrize(
    "encode, photometric, expected",
    [
        (dict(outcolorspace="YCBCR", subsampling=(2, 2)), None, "YCbCr 4:2:0"),
        (dict(outcolorspace="YCBCR", subsampling=(2, 1)), None, "YCbCr 4:2:2"),
        (dict(outcolorspace="YCBCR", subsampling=(1, 1)), None, "YCbCr 4:4:4"),
        (dict(outcolorspace="RGB"), None, "RGB"),  # the Adobe marker says: no transform
        (dict(outcolorspace="RGB"), "YCBCR", "YCbCr 4:4:4"),  # the container's tag wins, as readers apply it
        (dict(outcolorspace="YCBCR", subsampling=(1, 1)), "RGB", "RGB"),
    ],
)
def test_jpeg_kind_from_markers_and_tags(encode, photometric, expected):
    image = np.random.default_rng(0).integers(0, 256, (32, 48, 3), np.uint8)
    stream = imagecodecs.jpeg8_encode(image, level=90, colorspace="RGB", **encode)
    assert jpeg_kind(stream, photometric).name == expected
    tables, abbreviated = split_jpeg_tables(stream)
    assert abbreviated.startswith(b"\xff\xd8") and b"\xff\xdb" in tables


def test_jpeg_kind_refuses_what_is_not_a_jpeg_header():
    for junk in (b"", b"\xff\xd8", b"\x00" * 40, b"\xff\xd8\xff\xdb\xff\xff" + b"\x00" * 10):
        with pytest.raises(ValueError):
            jpeg_kind(junk)


@pytest.mark.parametrize("mpp", [None, 0.5, 0.37])
@pytest.mark.parametrize("kind", ["tiff-ycbcr444", "svs"])
def test_the_gpu_loaders_assembly_equals_the_cpu_reader(storage_kinds, kind, mpp):
    """Same tiles through the GPU loader's assembly and resampling (CPU device, libjpeg-turbo
    decoding) and through the CPU reader (``read_tile``: region then ``cv2.INTER_AREA``)."""
    pytest.importorskip("torch")
    from wsi_pipeline.tiling.gpu_decode import GpuTileDecoder

    with open_slide(storage_kinds[kind]) as slide:
        grid = TileGrid(slide, 512, 64, mpp=mpp) if mpp else TileGrid(slide)
        tiles = list(grid)
        got = GpuTileDecoder(slide, device="cpu", jpeg_decoder="threads").decode(tiles).numpy()
        for i, t in enumerate(tiles):
            ref = read_tile(slide, t)
            diff = np.abs(got[i].astype(np.int16) - ref)
            # integer factors are exact; others within one level (float32 weights vs OpenCV's sums)
            assert diff.max() <= (0 if mpp in (None, 0.5) else 1), (kind, mpp, t, diff.max())


def test_pipeline_detections_agree_across_storage_kinds(storage_kinds):
    from wsi_pipeline import Pipeline

    pipe = Pipeline.from_card(backend="ort")
    try:
        runs = {k: pipe.run(storage_kinds[k]) for k in ("synth", "tiff-ycbcr444", "svs")}
    finally:
        pipe.close()
    base = runs["synth"]
    assert len(base.detections) > 20
    for kind, r in runs.items():
        assert r.summary["slide_reader"]["name"] == "tifffile"
        assert r.summary["tile_decode"]["decoder"] == "reader"
        assert abs(len(r.detections) - len(base.detections)) <= max(2, 0.03 * len(base.detections)), kind
    assert runs["svs"].summary["slide_reader"]["vendor"] == "aperio"
    assert runs["svs"].summary["slide_reader"]["storage"]["jpeg_kind"] == "RGB"


def test_info_tells_the_jpeg_kind_and_the_decoder_a_cuda_run_would_use(storage_kinds):
    from wsi_pipeline.commands.info import describe

    svs = describe(storage_kinds["svs"])
    assert (svs["backend"], svs["format"], svs["storage"]["jpeg_kind"]) == ("tifffile", "aperio", "RGB")
    assert svs["gpu_decode"]["decoder"] == "nvimgcodec"
    ycc = describe(storage_kinds["tiff-ycbcr444"])
    assert (ycc["storage"]["jpeg_kind"], ycc["gpu_decode"]["decoder"]) == ("YCbCr 4:4:4", "nvjpeg")
    j2k = describe(storage_kinds["svs-j2k"])
    assert j2k["gpu_decode"]["decoder"] is None and "not JPEG" in j2k["gpu_decode"]["why"]
