"""OME-Zarr heatmaps: NGFF metadata, values, pyramid and atomic output, read back with ome-zarr-py and zarr."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.heatmap_rows import pyramid_shapes
from wsi_pipeline.io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter

_WHY = "the OME-Zarr validators come with the dev extra"
zarr = pytest.importorskip("zarr", reason=_WHY)
parse_url = pytest.importorskip("ome_zarr.io", reason=_WHY).parse_url
Reader = pytest.importorskip("ome_zarr.reader", reason=_WHY).Reader
NgffImage04 = pytest.importorskip("ome_zarr_models.v04.image", reason=_WHY).Image
NgffImage05 = pytest.importorskip("ome_zarr_models.v05.image", reason=_WHY).Image
OmeZarrHeatmapWriter = pytest.importorskip("wsi_pipeline.io.ome_zarr", reason=_WHY).OmeZarrHeatmapWriter


def _heatmap(c: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.random((c, h, w)).astype(np.float32)


def _stream(writer, data: np.ndarray, bands=(5, 70, 100, 3, 1)) -> None:
    """Feed ``data`` to ``writer`` in bands of uneven heights, as the blender does."""
    y, k = 0, 0
    while y < data.shape[1]:
        h = bands[k % len(bands)]
        writer(y, data[:, y : y + h])
        y += min(h, data.shape[1] - y)
        k += 1


def _read(path):
    nodes = list(Reader(parse_url(str(path)))())
    assert nodes, f"{path} is not an OME-Zarr image"
    return nodes[0]


@pytest.mark.parametrize("ngff_version, zarr_format", [("0.4", 2), ("0.5", 3)])
def test_round_trip_values_names_scales_and_pyramid(tmp_path, ngff_version, zarr_format):
    data = _heatmap(2, 301, 517)
    path = tmp_path / "heatmap.ome.zarr"
    with OmeZarrHeatmapWriter(
        path, 517, 301, 2, ["tumour", "stroma"], (2.0, 2.5), tile=64, ngff_version=ngff_version
    ) as w:
        _stream(w, data)
    node = _read(path)
    shapes = [(2, h, w) for h, w in pyramid_shapes(301, 517, 64)]
    assert [tuple(a.shape) for a in node.data] == shapes
    assert len(shapes) == 5 and max(shapes[-1][1:]) <= 64
    assert node.metadata["channel_names"] == ["tumour", "stroma"]
    assert node.metadata["axes"] == [
        {"name": "c", "type": "channel"},
        {"name": "y", "type": "space", "unit": "micrometer"},
        {"name": "x", "type": "space", "unit": "micrometer"},
    ]
    scales = [t[0]["scale"] for t in node.metadata["coordinateTransformations"]]
    assert scales == [[1.0, 2.5 * 2**k, 2.0 * 2**k] for k in range(5)]
    level0 = np.asarray(node.data[0])
    assert level0.dtype == np.uint8
    np.testing.assert_array_equal(level0, np.rint(data * 255).astype(np.uint8))
    group = zarr.open_group(str(path), mode="r")
    assert group.metadata.zarr_format == zarr_format
    # The NGFF schema of that version (pydantic models of the spec) accepts the metadata.
    (NgffImage04 if ngff_version == "0.4" else NgffImage05).from_zarr(group)
    assert group.attrs["wsi_pipeline"]["value_scale"] == pytest.approx(1 / 255)
    array = zarr.open_array(str(path / "0"), mode="r")
    assert array.chunks == (1, 64, 64)
    assert "blosc" in repr(array.compressors).lower()


def test_pyramid_levels_equal_the_ome_tiff_pyramid(tmp_path):
    """Every reduced level is the OME-TIFF writer's 2x2 mean of the stored values, to the last bit."""
    data = _heatmap(3, 203, 333, seed=1)
    with OmeZarrHeatmapWriter(tmp_path / "h.ome.zarr", 333, 203, 3, tile=32) as w:
        _stream(w, data)
    with OmeTiffHeatmapWriter(tmp_path / "h.ome.tif", 333, 203, 3, tile=32) as w:
        _stream(w, data)
    node, tiff = _read(tmp_path / "h.ome.zarr"), HeatmapFile(tmp_path / "h.ome.tif")
    assert len(node.data) == tiff.level_count
    for k, level in enumerate(node.data):
        np.testing.assert_allclose(np.asarray(level) / 255, tiff.read(k), atol=1e-6)


def test_float32_and_unknown_physical_size(tmp_path):
    data = _heatmap(1, 40, 50)
    path = tmp_path / "f.ome.zarr"
    with OmeZarrHeatmapWriter(path, 50, 40, 1, dtype="float32", tile=16) as w:
        w(0, data)
    node = _read(path)
    np.testing.assert_array_equal(np.asarray(node.data[0]), data)
    assert node.metadata["channel_names"] == ["channel_0"]
    assert all("unit" not in a for a in node.metadata["axes"])
    assert node.metadata["coordinateTransformations"][1][0]["scale"] == [1.0, 2.0, 2.0]


def test_an_exception_inside_the_writer_leaves_nothing(tmp_path):
    path = tmp_path / "h.ome.zarr"
    with pytest.raises(RuntimeError), OmeZarrHeatmapWriter(path, 64, 64, 1, tile=16) as w:
        w(0, _heatmap(1, 32, 64))
        assert any(p.name.startswith(".h.ome.zarr.partial-") for p in tmp_path.iterdir())
        raise RuntimeError("model failed")
    assert list(tmp_path.iterdir()) == []


def test_the_temporary_directory_is_not_an_image_before_close(tmp_path):
    w = OmeZarrHeatmapWriter(tmp_path / "h.ome.zarr", 64, 64, 1, tile=16)
    w(0, _heatmap(1, 64, 64))
    (partial,) = tmp_path.iterdir()
    assert not (tmp_path / "h.ome.zarr").exists()
    assert list(Reader(parse_url(str(partial)))()) == []  # no multiscales metadata until close
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["h.ome.zarr"]


def test_a_failing_close_leaves_nothing_and_keeps_an_old_output(tmp_path, monkeypatch):
    path = tmp_path / "h.ome.zarr"
    with OmeZarrHeatmapWriter(path, 32, 32, 1, tile=16) as w:
        w(0, np.zeros((1, 32, 32), np.float32))
    w = OmeZarrHeatmapWriter(path, 32, 32, 1, tile=16)
    w(0, np.ones((1, 32, 32), np.float32))

    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(w, "_write_metadata", broken)
    with pytest.raises(OSError, match="disk full"):
        w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["h.ome.zarr"]
    assert np.asarray(_read(path).data[0]).max() == 0  # the old output, whole


def test_a_new_output_replaces_an_old_one(tmp_path):
    path = tmp_path / "h.ome.zarr"
    for value in (0.0, 1.0):
        with OmeZarrHeatmapWriter(path, 40, 40, 1, tile=16) as w:
            w(0, np.full((1, 40, 40), value, np.float32))
    assert np.asarray(_read(path).data[0]).min() == 255
    assert [p.name for p in tmp_path.iterdir()] == ["h.ome.zarr"]


def test_rows_out_of_order_or_missing_are_errors(tmp_path):
    path = tmp_path / "h.ome.zarr"
    w = OmeZarrHeatmapWriter(path, 32, 32, 2, tile=16)
    with pytest.raises(WSIPipelineError, match="expected rows from 0"):
        w(4, np.zeros((2, 4, 32), np.float32))
    with pytest.raises(WSIPipelineError, match=r"expected rows of shape \(2, h, 32\)"):
        w(0, np.zeros((1, 4, 32), np.float32))
    w(0, np.zeros((2, 8, 32), np.float32))
    with pytest.raises(WSIPipelineError, match="closed after 8 of 32"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(WSIPipelineError, match="after the heatmap was closed"):
        w(8, np.zeros((2, 8, 32), np.float32))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tile": 100}, "multiple of 16"),
        ({"dtype": "int8"}, "dtype expected"),
        ({"channel_names": ["a"]}, "expected 2 channel names"),
        ({"ngff_version": "0.3"}, "ngff_version expected"),
        ({"physical_size_um": (0.0, 1.0)}, "physical_size_um expected"),
    ],
)
def test_bad_settings_are_value_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        OmeZarrHeatmapWriter(tmp_path / "h.ome.zarr", 32, 32, 2, **kwargs)
    assert list(tmp_path.iterdir()) == []


def _peak_bytes(path, c: int, h: int, w: int) -> int:
    rows = np.random.default_rng(0).random((c, 64, w)).astype(np.float32)
    writer = OmeZarrHeatmapWriter(path, w, h, c, tile=256)
    tracemalloc.start()
    try:
        for y in range(0, h, 64):
            writer(y, rows)
        writer.close()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_heatmap_height(tmp_path):
    """Peak Python/numpy allocations are a few bands: the same for a heatmap 4x taller."""
    c, w = 2, 3000
    small = _peak_bytes(tmp_path / "small.ome.zarr", c, 1024, w)
    large = _peak_bytes(tmp_path / "large.ome.zarr", c, 4096, w)
    stored_large = c * 4096 * w  # uint8
    assert large < 1.25 * small + 1e6, f"peak {small / 1e6:.1f} MB at 1024 rows, {large / 1e6:.1f} MB at 4096"
    assert large < stored_large / 2


def test_written_and_read_without_deprecations_or_version_warnings(tmp_path):
    """Importing the writer, writing a heatmap and reading it as the docs say (ome-zarr-py's reader
    told the version written) raise no deprecation and log no version mismatch; the version
    written is NGFF 0.4 on Zarr v2, stated in the multiscales metadata."""
    path = tmp_path / "heatmap.ome.zarr"
    script = f"""
import logging, sys, warnings
warnings.simplefilter("error")
seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append(record.getMessage())
logging.getLogger("ome_zarr").addHandler(handler)
import numpy as np
from wsi_pipeline.io.ome_zarr import DEFAULT_NGFF_VERSION, OmeZarrHeatmapWriter
with OmeZarrHeatmapWriter({str(path)!r}, 300, 200, 2, ["a", "b"], (1.0, 1.0), tile=64) as w:
    w(0, np.random.default_rng(0).random((2, 200, 300)).astype(np.float32))
from ome_zarr.format import FormatV04
from ome_zarr.io import parse_url
from ome_zarr.reader import Reader
node = list(Reader(parse_url({str(path)!r}, fmt=FormatV04()))())[0]
assert node.metadata["channel_names"] == ["a", "b"], node.metadata
assert DEFAULT_NGFF_VERSION == "0.4"
assert not seen, seen
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    group = zarr.open_group(str(path), mode="r")
    assert group.metadata.zarr_format == 2 and group.attrs["multiscales"][0]["version"] == "0.4"
