"""Pyramidal OME-TIFF heatmap writer, fed by the heatmap blender."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import tifffile

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter
from wsi_pipeline.stitch import BlendGeometry, HeatmapBlender, tile_weights

OME_NS = {"ome": "http://www.openmicroscopy.org/Schemas/OME/2016-06"}


def blend_random(geom: BlendGeometry, channels: int, sinks, seed=0):
    rng = np.random.default_rng(seed)
    t = geom.tile_size_out

    def fan_out(y0, rows):
        for s in sinks:
            s(y0, rows)

    blender = HeatmapBlender(geom, channels, tile_weights(t, "gaussian"), fan_out)
    for r in range(geom.n_rows):
        for c in range(geom.n_cols):
            blender.add(r, c, rng.random((channels, t, t)).astype(np.float32))
    blender.close()


def test_blended_heatmap_round_trips_as_pyramidal_ome_tiff(tmp_path):
    tiling = TilingGeometry(4000, 3000, 512, 64, heatmap_stride=8)
    geom = BlendGeometry.from_tiling(tiling)
    names = ["tumor", "stroma"]
    path = tmp_path / "heatmap.ome.tif"
    reference = np.zeros((2, geom.out_height, geom.out_width), dtype=np.float32)

    def keep(y0, rows):
        reference[:, y0 : y0 + rows.shape[1]] = rows

    pixel_um = tiling.heatmap_pixel_size_um((0.25, 0.25))
    writer = OmeTiffHeatmapWriter(path, geom.out_width, geom.out_height, 2, names, pixel_um, tile=128)
    blend_random(geom, 2, [keep, writer])
    assert writer.close() == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heatmap.ome.tif"]  # no spool or partial file

    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome
        series = tif.series[0]
        assert series.axes == "CYX"
        assert series.shape == (2, geom.out_height, geom.out_width)
        assert len(series.levels) > 1
        assert series.levels[1].shape == (2, (geom.out_height + 1) // 2, (geom.out_width + 1) // 2)
        page = tif.pages[0]
        assert page.is_tiled and page.compression == tifffile.COMPRESSION.ADOBE_DEFLATE
        stored = series.levels[0].asarray()
        level1 = series.levels[1].asarray()
        root = ET.fromstring(tif.ome_metadata)
    pixels = root.find(".//ome:Pixels", OME_NS)
    assert float(pixels.get("PhysicalSizeX")) == pytest.approx(2.0)
    assert float(pixels.get("PhysicalSizeY")) == pytest.approx(2.0)
    assert pixels.get("PhysicalSizeXUnit") == "µm"
    assert [ch.get("Name") for ch in pixels.findall("ome:Channel", OME_NS)] == names
    annotation = {m.get("K"): m.text for m in root.findall(".//ome:MapAnnotation/ome:Value/ome:M", OME_NS)}
    scale = float(annotation["value_scale"])
    assert scale == pytest.approx(1 / 255)

    assert stored.dtype == np.uint8
    np.testing.assert_allclose(stored * scale, reference, atol=0.5 / 255 + 1e-6)
    # Level 1 is the 2 x 2 mean of level 0.
    h, w = (stored.shape[1] // 2) * 2, (stored.shape[2] // 2) * 2
    mean = stored[:, :h, :w].astype(np.float64).reshape(2, h // 2, 2, w // 2, 2).mean(axis=(2, 4))
    np.testing.assert_allclose(level1[:, : h // 2, : w // 2], mean, atol=0.5 + 1e-9)


@pytest.mark.parametrize("dtype, atol", [("uint16", 0.5 / 65535 + 1e-7), ("float32", 0.0)])
def test_other_stored_types_keep_values(tmp_path, dtype, atol):
    rng = np.random.default_rng(2)
    data = rng.random((1, 300, 200)).astype(np.float32)
    path = tmp_path / "h.ome.tif"
    with OmeTiffHeatmapWriter(path, 200, 300, 1, dtype=dtype, tile=64, levels=2) as writer:
        for y in range(0, 300, 70):
            writer(y, data[:, y : y + 70])
    with tifffile.TiffFile(path) as tif:
        levels = tif.series[0].levels
        assert len(levels) == 2
        stored = levels[0].asarray().reshape(data.shape)  # one channel: tifffile squeezes C
        root = ET.fromstring(tif.ome_metadata)
    scale = float(root.find(".//ome:M[@K='value_scale']", OME_NS).text)
    assert stored.dtype == np.dtype(dtype)
    np.testing.assert_allclose(stored.astype(np.float64) * scale, data, atol=atol)
    # No physical size given: none claimed.
    assert root.find(".//ome:Pixels", OME_NS).get("PhysicalSizeX") is None


def test_failure_leaves_no_file(tmp_path):
    path = tmp_path / "h.ome.tif"
    with pytest.raises(RuntimeError), OmeTiffHeatmapWriter(path, 64, 64, 1) as writer:
        writer(0, np.zeros((1, 10, 64), dtype=np.float32))
        raise RuntimeError("blending failed")
    assert list(tmp_path.iterdir()) == []

    writer = OmeTiffHeatmapWriter(path, 64, 64, 1)
    writer(0, np.zeros((1, 10, 64), dtype=np.float32))
    with pytest.raises(WSIPipelineError, match=r"h\.ome\.tif.*rows from 10"):
        writer(20, np.zeros((1, 10, 64), dtype=np.float32))
    with pytest.raises(WSIPipelineError, match="10 of 64"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_spool_pages_dropped_as_often_as_possible_keep_their_data(tmp_path, monkeypatch):
    """The spool's pages are unmapped after every row band, reduction band and tile row (without
    writing them to the spool file first on Linux): the file holds what a writer that never drops
    them writes, at every level."""
    import wsi_pipeline.io.ome_tiff as ome_tiff

    rng = np.random.default_rng(4)
    heat = rng.random((2, 300, 520), dtype=np.float32)

    def write(path):
        with OmeTiffHeatmapWriter(path, 520, 300, 2, ["a", "b"], tile=64) as w:
            for y in range(0, 300, 25):
                w(y, heat[:, y : y + 25])
        return HeatmapFile(path)

    kept = write(tmp_path / "kept.ome.tif")
    monkeypatch.setattr(ome_tiff, "_RESIDENT_BYTES", 1)
    dropped = write(tmp_path / "dropped.ome.tif")
    assert dropped.level_count == kept.level_count > 3
    for level in range(kept.level_count):
        np.testing.assert_array_equal(dropped.read(level), kept.read(level))
    np.testing.assert_allclose(dropped.read(0), heat, atol=0.5 / 255 + 1e-6)


def test_spooled_heatmap_written_by_another_process_equals_close(tmp_path):
    """A spooled heatmap pickled to a spawned process (as the writer pool does) writes the same
    levels and metadata as ``close()`` in the process that streamed the rows, and removes its spool."""
    import multiprocessing
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    from wsi_pipeline.io.ome_tiff import write_spooled_heatmap

    heat = np.random.default_rng(5).random((2, 300, 520), dtype=np.float32)

    def stream(path):
        w = OmeTiffHeatmapWriter(path, 520, 300, 2, ["a", "b"], (0.5, 0.5), tile=64)
        for y in range(0, 300, 25):
            w(y, heat[:, y : y + 25])
        return w

    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    stream(tmp_path / "here" / "h.ome.tif").close()
    writer = stream(tmp_path / "there" / "h.ome.tif")
    spooled = writer.spooled()
    assert spooled.spool.is_dir()
    with pytest.raises(WSIPipelineError, match="closed"):
        writer(300, heat[:, :1])
    with pytest.raises(WSIPipelineError, match="already closed"):
        writer.spooled()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        path = pool.submit(write_spooled_heatmap, pickle.loads(pickle.dumps(spooled))).result()
    assert path == tmp_path / "there" / "h.ome.tif"
    here, there = HeatmapFile(tmp_path / "here" / "h.ome.tif"), HeatmapFile(path)
    assert there.level_count == here.level_count > 3
    for level in range(here.level_count):
        np.testing.assert_array_equal(there.read(level), here.read(level))

    def xml(p):  # the OME metadata, less the UUID that each file gets
        with tifffile.TiffFile(p) as tif:
            return re.sub(r'UUID="[^"]*"', "", tif.ome_metadata)

    assert xml(path) == xml(tmp_path / "here" / "h.ome.tif")
    assert [p.name for p in (tmp_path / "there").iterdir()] == ["h.ome.tif"]  # the spool removed
    assert writer.close() == path  # already finished: nothing more to do


def test_spooled_heatmap_that_fails_leaves_neither_file_nor_spool(tmp_path):
    writer = OmeTiffHeatmapWriter(tmp_path / "h.ome.tif", 64, 64, 1, tile=16)
    writer(0, np.zeros((1, 64, 64), dtype=np.float32))
    spooled = writer.spooled()
    np.save(spooled.spool / "level0.npy", np.zeros((1, 32, 64), np.uint8))  # not what was streamed
    with pytest.raises(WSIPipelineError, match=r"h\.ome\.tif: the heatmap spool holds uint8 \(1, 32, 64\), expected"):
        spooled.write()
    assert list(tmp_path.iterdir()) == []


_FILL_HEATMAP = """
import sys
import numpy as np
from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter
try:
    writer = OmeTiffHeatmapWriter(sys.argv[1], 1024, 1024, 1)
    for y in range(0, 1024, 64):
        writer.write_rows(y, np.full((1, 64, 1024), 0.5, np.float32))
    writer.close()
except OSError as exc:
    print(f"OSError {exc.errno}: {exc}")
    sys.exit(3)
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A mount point for a tmpfs of a given size (root, where mounts are allowed; skipped elsewhere)."""
    import subprocess

    mounted = []

    def mount(size: str):
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.parametrize("size", ["512k", "1100k"])  # no room for level 0's spool; level 0 fits, the pyramid not
def test_a_full_disk_is_an_oserror_naming_the_folder_not_a_sigbus(small_tmpfs, size):
    import errno
    import subprocess
    import sys

    folder = small_tmpfs(size)
    r = subprocess.run(
        [sys.executable, "-c", _FILL_HEATMAP, str(folder / "heatmap.ome.tif")], capture_output=True, text=True
    )
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)  # SIGBUS: -7
    assert f"OSError {errno.ENOSPC}" in r.stdout and str(folder) in r.stdout, r.stdout
    assert [p.name for p in folder.iterdir()] == []  # neither file nor spool left
