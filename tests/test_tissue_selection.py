"""Tissue masks on images with little or no background, and warnings for selections that look wrong."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import cv2
import numpy as np
import pytest
from helpers import write_pyramid_tiff

from wsi_pipeline import Pipeline
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.synthetic import SyntheticScene
from wsi_pipeline.tiling import TileGrid, tissue_mask
from wsi_pipeline.tiling.tissue import otsu_tissue_mask

# A 1000 x 1500 px window of this scene that is tissue everywhere (checked below).
SCENE = dict(width=6000, height=6000, seed=3, kind="pathology")
CROP_XYWH = (2280, 380, 1000, 1500)


@pytest.fixture(scope="module")
def all_tissue_crop() -> np.ndarray:
    scene = SyntheticScene(**SCENE)
    x, y, w, h = CROP_XYWH
    assert (scene.region_mask(x, y, w, h, downsample=10) > 0).all()
    return scene.render(x, y, w, h)


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline.from_card(backend="ort")
    yield p
    p.close()


def test_all_tissue_crop_is_all_tissue(all_tissue_crop):
    tm = tissue_mask(ImageSlide.from_array(all_tissue_crop))
    assert tm.fraction > 0.95
    assert tm.selection_warning(6, 6, 0.05) is None


def test_background_with_two_stains_keeps_both():
    # Background, a faint stain and a strong one: Otsu alone splits the stains apart.
    img = np.full((400, 600, 3), 240, np.uint8)
    img[:, 300:400] = (200, 150, 180)  # faint: saturation about 64
    img[:, 400:] = (150, 40, 110)  # strong: saturation about 188
    mask = otsu_tissue_mask(img)
    assert mask[:, 310:390].mean() > 0.95 and mask[:, 410:].mean() > 0.95
    assert mask[:, :290].mean() < 0.01


def test_all_white_image_selects_nothing_and_says_so():
    s = ImageSlide.from_array(np.full((1000, 1500, 3), 245, np.uint8))
    tm = tissue_mask(s)
    grid = TileGrid(s, 512, 64)
    tiles = grid.select(tm.tile_fractions(grid), 0.05)
    assert tm.fraction == 0 and tiles == []
    assert "no tile selected" in tm.selection_warning(len(tiles), len(grid), 0.05)


def test_mask_missing_most_of_the_content_warns(all_tissue_crop):
    tm = tissue_mask(ImageSlide.from_array(all_tissue_crop))
    assert "only 1 of 40 tiles" in tm.selection_warning(1, 40, 0.05)


def test_all_tissue_array_gets_the_detections_of_tissue_all(pipe, all_tissue_crop):
    default = pipe.run(all_tissue_crop)
    assert default.summary["tiles"]["read"] == default.summary["tiles"]["total"]
    assert default.summary["tissue_warning"] is None
    with Pipeline.from_card(backend="ort", tissue="all") as everything:
        expected = len(everything.run(all_tissue_crop).detections)
    assert expected > 20
    assert len(default.detections) == expected


def test_all_white_array_warns_and_records_it(pipe, caplog):
    with caplog.at_level(logging.WARNING, logger="wsi_pipeline"):
        result = pipe.run(np.full((1000, 1500, 3), 245, np.uint8))
    assert len(result.detections) == 0 and result.summary["tiles"]["read"] == 0
    assert "no tile selected" in result.summary["tissue_warning"]
    assert any("no tile selected" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_all_tissue_tiff_from_the_cli(all_tissue_crop, tmp_path):
    slide = tmp_path / "roi.tiff"
    write_pyramid_tiff(slide, all_tissue_crop, levels=2, mpp=0.25)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", str(slide), "--out", str(out), "--backend", "ort"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "slides" / "roi" / "summary.json").read_text())
    assert summary["tiles"]["read"] == summary["tiles"]["total"]
    assert summary["detections_total"] > 20
    assert summary["tissue_warning"] is None


def test_all_white_image_from_the_cli_warns_in_the_log_and_summary(tmp_path):
    image = tmp_path / "white.png"
    cv2.imwrite(str(image), np.full((1000, 1500, 3), 245, np.uint8))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "wsi_pipeline", "run", str(image), "--out", str(out), "--backend", "ort"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" in (log := (out / "run.log").read_text()) and "no tile selected" in log
    summary = json.loads((out / "slides" / "white" / "summary.json").read_text())
    assert summary["tiles"]["read"] == 0 and "no tile selected" in summary["tissue_warning"]


@pytest.mark.parametrize("side", [100, 16])
def test_an_image_smaller_than_a_tile_is_one_tile_as_much_tissue_as_the_image(side):
    frame = np.full((side, side, 3), 128, np.uint8)
    if side >= 100:
        yy, xx = np.mgrid[:side, :side]
        frame[(yy - 50) ** 2 + (xx - 50) ** 2 < 12**2] = 40  # one spot
    with Pipeline.from_card("defects_industrial", backend="ort") as p:
        result = p.run(frame)
    assert result.summary["tiles"]["read"] == 1 and result.summary["tissue_warning"] is None
    assert len(result.detections) == (1 if side >= 100 else 0)


def test_the_advice_names_the_setting_that_excluded_the_tiles():
    tm = tissue_mask(ImageSlide.from_array(np.full((300, 300, 3), 128, np.uint8)), "all")
    said = tm.selection_warning(0, 1, 0.5, "all")
    assert "--min-tissue, now 0.5" in said and "use tissue 'all'" not in said
    said = tm.selection_warning(0, 1, 0.5, "otsu")
    assert "--tissue all" in said and "--min-tissue" in said
    assert "mask file covers" in tm.selection_warning(0, 1, 0.5, "file")


def _tissue_scene(h: int = 3072, w: int = 4096) -> np.ndarray:
    """White background with one stained disc and one stained band (a slide's thumbnail look)."""
    img = np.full((h, w, 3), 235, np.uint8)
    cv2.circle(img, (w // 3, h // 2), h // 4, (170, 60, 150), -1)
    cv2.rectangle(img, (w * 2 // 3, h // 6), (w * 5 // 6, h * 5 // 6), (120, 40, 160), -1)
    return img


def test_a_single_level_slides_mask_decodes_its_tiles_reduced_and_agrees_with_the_full_decode(tmp_path):
    """One stored level (4,096 px, a 2,048 px thumbnail): the mask's thumbnail comes from level 0's
    JPEG tiles decoded at 1/2 in the DCT domain, each stored tile once, and the mask is that of the
    full decode shrunk (the same pixels within a few mask pixels)."""
    path = str(tmp_path / "one.tif")
    write_pyramid_tiff(path, _tissue_scene(), levels=1, tile=256)
    from wsi_pipeline.slide import open_slide

    with open_slide(path) as slide:
        mask = tissue_mask(slide)
        src = mask.source
        assert src["level"] == 0 and src["decode"] == "1/2" and src["read"] == "shrunk"
        assert src["stored_tiles_decoded"] == 16 * 12 and src["seconds"] >= 0
        full = slide.get_thumbnail(2048)
    want = otsu_tissue_mask(full)
    assert mask.mask.shape == want.shape
    assert np.count_nonzero(mask.mask != want) <= 0.002 * want.size


def test_a_subifd_pyramids_mask_reads_a_stored_level_as_it_is(tmp_path):
    """The same slide with its levels in page 0's SubIFDs: the mask reads the 2x level as stored
    (no stored tile of level 0 decoded), recorded in summary.json's tissue entry."""
    from helpers.slide_corpus import Layout, Page, write_layout

    layout = Layout("s", (Page(1), Page(2, subfiletype=1, subifd=True), Page(4, subfiletype=1, subifd=True)))
    path = str(tmp_path / "subifds.tif")
    write_layout(path, layout, _tissue_scene())
    from wsi_pipeline.slide import open_slide

    with open_slide(path) as slide:
        assert slide.level_count == 3
        src = tissue_mask(slide).source
        assert (src["level"], src["decode"], src["read"]) == (1, "whole", "as stored")
        _, _, across, down = slide.tile_grid_shape(1)
        assert src["stored_tiles_decoded"] == across * down
