"""``result.heatmap`` indexes the same way whether it is held in memory or read from the run's OME-TIFF."""

from __future__ import annotations

import numpy as np
import pytest

from wsi_pipeline import Pipeline
from wsi_pipeline.io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The pathology model on one image: heatmap in memory, and written to a folder."""
    from wsi_pipeline.synthetic import SyntheticScene

    image = SyntheticScene(900, 700, seed=5, kind="pathology").render(0, 0, 900, 700)
    with Pipeline.from_card(backend="ort", mpp=None, level=0) as pipe:
        held = pipe.run(image)
        written = pipe.run(image, out_dir=tmp_path_factory.mktemp("hm"))
    return held.heatmap, written.heatmap


def test_in_memory_and_file_heatmaps_index_alike(both):
    held, on_disk = both
    assert isinstance(held, np.ndarray) and isinstance(on_disk, HeatmapFile)
    assert on_disk.shape == held.shape and on_disk.dtype == held.dtype and on_disk.ndim == held.ndim == 3
    assert len(on_disk) == len(held) == 2
    assert held.min() < 0.1 and held.max() > 0.9  # a heatmap with content, not a constant
    tol = 1 / 255 + 1e-6  # the file stores uint8 probabilities
    c, h, w = held.shape
    for key in (
        1,
        -1,
        (1, slice(2, h - 3), slice(5, w)),
        (slice(None), 4),
        ([1, 0], slice(0, 8)),
        (0, 3, 7),
        (slice(None, None, -1),),
        (Ellipsis, 2),
        np.array([True, False]),
    ):
        got, want = on_disk[key], held[key]
        assert np.shape(got) == np.shape(want), key
        np.testing.assert_allclose(got, want, atol=tol, err_msg=str(key))
    np.testing.assert_allclose(np.asarray(on_disk), held, atol=tol)
    with pytest.raises(IndexError):
        on_disk[2]


def test_indexing_a_channel_reads_only_that_page(tmp_path, monkeypatch):
    path = tmp_path / "h.ome.tif"
    with OmeTiffHeatmapWriter(path, 40, 30, 3, ["a", "b", "c"], (1.0, 1.0)) as w:
        w(0, np.stack([np.full((30, 40), v, np.float32) for v in (0.2, 0.4, 0.6)]))
    h = HeatmapFile(path)
    asked = []
    real_read = HeatmapFile.read

    def spy(self, level=0, channels=None):
        asked.append(None if channels is None else [int(i) for i in channels])
        return real_read(self, level, channels)

    monkeypatch.setattr(HeatmapFile, "read", spy)
    plane = h[2]
    assert plane.shape == (30, 40) and abs(float(plane.mean()) - 0.6) < 0.01
    assert asked == [[2]]
