"""Grids between stored levels read from JPEG tiles decoded reduced (``resample = reduced``).

libjpeg-turbo decodes a tile at 1/2, 1/4 or 1/8 of its size in the DCT domain, which stands for
decoding it whole and shrinking it with ``cv2.INTER_AREA`` (``resample = area``, the default and
the GPU's): the same pixels within a few grey levels inside the slide.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.slide_corpus import aperio_layouts, generic_layouts, write_layout

from wsi_pipeline.config import RunConfig
from wsi_pipeline.errors import ConfigError
from wsi_pipeline.slide import open_slide
from wsi_pipeline.tiling.grid import Tile, read_tile, reduced_factor
from wsi_pipeline.tiling.slide_loader import choose_tile_decode


@pytest.fixture(scope="module", params=["rgb-012+tables", "ycbcr-jfif"])
def svs(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("reduced") / "s.svs"
    layout = next(lay for lay in aperio_layouts(request.param, 2000, 1500) if lay.name == "aperio-reduced-flagged")
    write_layout(path, layout)
    return str(path)


def _tile(x: int, y: int, k: int) -> Tile:
    return Tile(0, 0, 0, x, y, 256, float(k), 0, 256 * k)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_reduced_reads_are_the_area_shrink_within_a_few_levels(svs, k):
    with open_slide(svs, "tifffile") as s:
        assert s.reduced_scales(0) == (2, 4, 8)
        for t in (_tile(0, 0, k), _tile(56 * k, 24 * k, k)):  # origins on multiples of k
            s.reduced_decode = False
            area = read_tile(s, t).astype(int)
            s.reduced_decode = True
            assert reduced_factor(s, t) == k
            reduced = read_tile(s, t).astype(int)
            inside = (slice(0, (1500 - t.y0_level0) // k), slice(0, (2000 - t.x0_level0) // k))
            d = np.abs(area - reduced)[inside]
            assert d.mean() < 1.0 and np.percentile(d, 99.9) <= 8, (k, t, d.mean(), d.max())


def test_reduced_reads_only_where_the_factor_origin_and_tiles_allow(svs, tmp_path):
    with open_slide(svs, "tifffile") as s:
        s.reduced_decode = True
        assert reduced_factor(s, _tile(0, 0, 1)) == 0  # no resampling
        assert reduced_factor(s, Tile(0, 0, 0, 0, 0, 256, 1.5, 0, 384)) == 0  # not an integer factor
        assert reduced_factor(s, _tile(2, 0, 4)) == 0  # an origin off the 4 x 4 blocks
        assert reduced_factor(s, _tile(16, 0, 16)) == 0  # past DCT scaling's 1/8
        s.reduced_decode = False
        assert reduced_factor(s, _tile(0, 0, 2)) == 0  # not asked for
    deflate = tmp_path / "deflate.tif"
    write_layout(deflate, next(lay for lay in generic_layouts() if lay.name == "generic-deflate"))
    with open_slide(str(deflate), "tifffile") as s:
        s.reduced_decode = True
        assert s.reduced_scales(0) == () and reduced_factor(s, _tile(0, 0, 2)) == 0


def test_reduced_reads_are_decoded_on_the_cpu_and_the_setting_is_checked(svs):
    with open_slide(svs, "tifffile") as s:
        s.reduced_decode = True
        where, why, decoder = choose_tile_decode(s, [_tile(0, 0, 2)], "auto", "warn", "torch", on_cuda=True)
        assert (where, decoder) == ("cpu", "reader") and "resample = reduced" in why
    assert RunConfig(resample="reduced").resample == "reduced"
    with pytest.raises(ConfigError, match="resample: expected one of area, reduced"):
        RunConfig(resample="dct")
