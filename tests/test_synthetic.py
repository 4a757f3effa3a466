"""Synthetic slides: scene rendering, files OpenSlide/tifffile read, truth, CLI."""

import os
import tracemalloc

import cv2
import numpy as np
import openslide
import pytest
import tifffile

from wsi_pipeline import cli
from wsi_pipeline.errors import ConfigError
from wsi_pipeline.synthetic import (
    SyntheticScene,
    default_truth_path,
    load_truth,
    write_synthetic_slide,
    write_truth,
)

W, H, SEED = 3000, 2000, 7


@pytest.fixture(scope="module")
def pathology_slide(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "slide.tiff"
    info = write_synthetic_slide(out, W, H, SEED)
    return info


@pytest.fixture(scope="module")
def scene():
    return SyntheticScene(W, H, SEED)


def _tissue_window(scene, size=512):
    """Origin of a size x size window that is mostly tissue, on the cell grid."""
    mask = scene.region_mask(0, 0, W, H, 16)
    k = size // 16
    best, origin = -1.0, (0, 0)
    for y in range(0, mask.shape[0] - k, k // 2):
        for x in range(0, mask.shape[1] - k, k // 2):
            frac = (mask[y : y + k, x : x + k] > 0).mean()
            if frac > best:
                best, origin = frac, (x * 16, y * 16)
    return origin


# ------------------------------------------------------------------ files


def test_pathology_slide_opens_in_openslide_with_pyramid_and_mpp(pathology_slide):
    with openslide.OpenSlide(pathology_slide["path"]) as s:
        assert s.properties["openslide.vendor"] == "generic-tiff"
        assert s.level_count == 3
        assert s.level_dimensions == ((3000, 2000), (1500, 1000), (750, 500))
        assert float(s.properties["openslide.mpp-x"]) == pytest.approx(0.25)
        assert float(s.properties["openslide.mpp-y"]) == pytest.approx(0.25)
        assert "seed=7" in s.properties["tiff.ImageDescription"]
    assert pathology_slide["level_dimensions"] == [(3000, 2000), (1500, 1000), (750, 500)]
    with tifffile.TiffFile(pathology_slide["path"]) as tf:
        assert len(tf.pages) == 3  # levels as pages, not SubIFDs
        assert all(p.is_tiled and p.tilewidth == 256 for p in tf.pages)
        assert all(p.compression == tifffile.COMPRESSION.JPEG for p in tf.pages)


def test_slide_pixels_match_scene_render_within_jpeg_tolerance(pathology_slide, scene):
    x, y = _tissue_window(scene)
    with openslide.OpenSlide(pathology_slide["path"]) as s:
        read0 = np.asarray(s.read_region((x, y), 0, (512, 512)).convert("RGB"), np.int16)
        read1 = np.asarray(s.read_region((x, y), 1, (256, 256)).convert("RGB"), np.int16)
    assert np.abs(read0 - scene.render(x, y, 512, 512)).mean() < 3.0
    assert np.abs(read1 - scene.render(x, y, 512, 512, downsample=2)).mean() < 3.0
    # And the window does hold tissue and nuclei, not only background.
    assert (scene.region_mask(x, y, 512, 512) > 0).mean() > 0.5
    assert len(scene.objects_in(x, y, 512, 512)[0]) > 10


def test_render_at_downsample_looks_like_a_downsampled_render(scene):
    x, y = _tissue_window(scene, 1024)
    full = scene.render(x, y, 1024, 1024)
    for d in (2, 4, 8):
        small = scene.render(x, y, 1024, 1024, downsample=d)
        assert small.shape == (1024 // d, 1024 // d, 3)
        ref = cv2.resize(full, (1024 // d, 1024 // d), interpolation=cv2.INTER_AREA)
        assert np.abs(small.astype(int) - ref).mean() < 4.0, d


def test_render_shape_and_dtype():
    s = SyntheticScene(1000, 700, 1)
    img = s.render(10, 20, 301, 99, downsample=4)
    assert img.shape == (25, 76, 3) and img.dtype == np.uint8 and img.flags.c_contiguous
    assert s.region_mask(10, 20, 301, 99, 4).shape == (25, 76)


def test_truth_boxes_lie_in_tissue_inside_the_slide(pathology_slide, scene):
    truth = load_truth(pathology_slide["truth_path"])
    assert truth.class_names == ["nucleus"]
    assert len(truth.boxes) == pathology_slide["object_count"] > 200
    b = truth.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
    assert (b[:, 2] <= W).all() and (b[:, 3] <= H).all()
    size = np.maximum(b[:, 2] - b[:, 0], b[:, 3] - b[:, 1])
    assert size.min() >= 6 and size.max() <= 22  # 8-20 px nuclei at 0.25 um/px
    cx, cy = (b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2
    assert (scene.labels_at(cx, cy) > 0).all()
    mask = scene.region_mask(0, 0, W, H)
    assert (mask[cy.astype(int), cx.astype(int)] > 0).mean() > 0.99


def test_truth_round_trips_the_scene_objects_exactly(pathology_slide, scene):
    truth = load_truth(pathology_slide["truth_path"])
    boxes, labels = scene.objects_in(0, 0, W, H)
    np.testing.assert_array_equal(truth.boxes, boxes)
    np.testing.assert_array_equal(truth.labels, labels)
    assert (truth.width, truth.height, truth.mpp, truth.seed) == (W, H, 0.25, SEED)


def test_truth_regions_trace_the_region_mask(pathology_slide, scene):
    truth = load_truth(pathology_slide["truth_path"])
    assert set(truth.regions) == {"tissue", "tumour"}
    for ring in truth.regions["tissue"]:
        assert ring.shape[1] == 2 and len(ring) >= 4 and (ring[0] == ring[-1]).all()
    mask = scene.region_mask(0, 0, W, H, 4)
    tissue = truth.region_mask("tissue", 4).astype(bool)
    tumour = truth.region_mask("tumour", 4).astype(bool)
    assert (tissue != (mask >= 1)).mean() < 0.01
    assert (tumour != (mask == 2)).mean() < 0.01
    assert 0.3 < tissue.mean() < 0.6


def test_tumour_nuclei_are_denser_and_larger(scene):
    boxes, _ = scene.objects_in(0, 0, W, H)
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    lab = scene.labels_at(cx, cy)
    mask = scene.region_mask(0, 0, W, H)
    area_tumour, area_tissue = (mask == 2).sum(), (mask == 1).sum()
    assert area_tumour > 0.05 * W * H and area_tissue > 0.1 * W * H
    density_tumour = (lab == 2).sum() / area_tumour
    density_tissue = (lab == 1).sum() / area_tissue
    assert density_tumour > 2.0 * density_tissue
    size = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert size[lab == 2].mean() > 1.5 * size[lab == 1].mean()


def test_nuclei_do_not_overlap_heavily(scene):
    boxes, _ = scene.objects_in(0, 0, W, H)
    c = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2], 1)
    half = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]) / 2
    # Pairs closer than half their smaller radii would merge into one blob for a detector.
    grid = {}
    close = 0
    for i, (x, y) in enumerate(c):
        key = (int(x // 32), int(y // 32))
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                for j in grid.get((key[0] + dx, key[1] + dy), []):
                    if np.hypot(*(c[i] - c[j])) < 0.5 * (half[i] + half[j]):
                        close += 1
        grid.setdefault(key, []).append(i)
    assert close <= 0.01 * len(boxes)


# ------------------------------------------------------------------ scene model


def test_same_seed_same_scene_other_seed_other_scene(tmp_path, scene):
    again = SyntheticScene(W, H, SEED)
    other = SyntheticScene(W, H, SEED + 1)
    b1, l1 = scene.objects_in(0, 0, W, H)
    b2, l2 = again.objects_in(0, 0, W, H)
    b3, _ = other.objects_in(0, 0, W, H)
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(l1, l2)
    assert b1.shape != b3.shape or not np.array_equal(b1, b3)
    np.testing.assert_array_equal(scene.render(0, 0, W, H, 8), again.render(0, 0, W, H, 8))
    assert not np.array_equal(scene.render(0, 0, W, H, 8), other.render(0, 0, W, H, 8))
    write_truth(scene, tmp_path / "a.geojson")
    write_truth(again, tmp_path / "b.geojson")
    write_truth(other, tmp_path / "c.geojson")
    assert (tmp_path / "a.geojson").read_bytes() == (tmp_path / "b.geojson").read_bytes()
    assert (tmp_path / "a.geojson").read_bytes() != (tmp_path / "c.geojson").read_bytes()


@pytest.mark.parametrize("kind", ["pathology", "industrial"])
@pytest.mark.parametrize("d", [1, 2])
def test_render_is_local_pieces_equal_the_whole(kind, d):
    s = SyntheticScene(W, H, SEED, kind=kind)
    if kind == "pathology":
        x, y = _tissue_window(s, 1024)
        x, y = x // 512 * 512, y // 512 * 512
    else:
        x, y = 0, 0
    whole = s.render(x, y, 1024, 1024, d)
    # Split on a cell border (objects straddle it) and off one.
    for cut in (512, 300):
        left = s.render(x, y, cut, 1024, d)
        right = s.render(x + cut, y, 1024 - cut, 1024, d)
        np.testing.assert_array_equal(np.hstack([left, right]), whole)
        top = s.render(x, y, 1024, cut, d)
        bottom = s.render(x, y + cut, 1024, 1024 - cut, d)
        np.testing.assert_array_equal(np.vstack([top, bottom]), whole)
    # A fresh scene (no cached cells) renders a sub-window identically.
    fresh = SyntheticScene(W, H, SEED, kind=kind)
    np.testing.assert_array_equal(
        fresh.render(x + 256, y + 128, 512, 512, d), whole[128 // d : 640 // d, 256 // d : 768 // d]
    )


def test_objects_in_lists_objects_whose_box_meets_the_region(scene):
    boxes, _ = scene.objects_in(0, 0, W, H)
    x0, y0, w, h = 1000, 700, 600, 450
    sub, _ = scene.objects_in(x0, y0, w, h)
    hit = (boxes[:, 2] > x0) & (boxes[:, 0] < x0 + w) & (boxes[:, 3] > y0) & (boxes[:, 1] < y0 + h)
    assert sorted(map(tuple, sub.tolist())) == sorted(map(tuple, boxes[hit].tolist()))


def test_huge_scene_renders_a_tile_in_bounded_memory():
    tracemalloc.start()
    try:
        s = SyntheticScene(100_000, 100_000, 3)
        x, y = 50_000, 50_000
        tile = s.render(x, y, 512, 512)
        boxes, _ = s.objects_in(x, y, 512, 512)
        overview = s.render(0, 0, 100_000, 100_000, downsample=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tile.shape == (512, 512, 3) and overview.shape == (391, 391, 3)
    coloured = np.abs(overview.astype(int) - overview[0, 0]).sum(-1) > 30
    assert 0.25 < coloured.mean() < 0.7  # tissue shows in the overview
    assert peak < 64e6
    assert len(boxes) == len(s.objects_in(x, y, 512, 512)[0])


def test_writing_streams_in_bounded_memory(tmp_path):
    peaks = []
    for w, h in ((1024, 1024), (4096, 4096)):
        tracemalloc.start()
        try:
            write_synthetic_slide(tmp_path / f"s{w}.tiff", w, h, 5, kind="industrial")
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    raw_big = 4096 * 4096 * 3
    assert peaks[1] < raw_big / 2
    assert peaks[1] < peaks[0] + 0.05 * raw_big  # 16x the pixels, about the same peak


# ------------------------------------------------------------------ industrial


def test_industrial_bigtiff_with_spots_and_scratches(tmp_path):
    info = write_synthetic_slide(tmp_path / "plate.tiff", 4096, 4096, 11, kind="industrial")
    assert info["mpp"] is None
    with tifffile.TiffFile(info["path"]) as tf:
        assert tf.is_bigtiff
        page = tf.pages[0]
        assert page.is_tiled and page.shape == (4096, 4096, 3)
        unit = page.tags.get("ResolutionUnit")
        assert unit is None or unit.value == tifffile.RESUNIT.NONE
        level0 = page.asarray()
    with openslide.OpenSlide(info["path"]) as s:
        assert "openslide.mpp-x" not in s.properties
    truth = load_truth(info["truth_path"])
    assert truth.class_names == ["spot", "scratch"]
    counts = np.bincount(truth.labels, minlength=2)
    assert counts[0] >= 5 and counts[1] >= 3
    assert truth.regions == {}
    size = np.maximum(truth.boxes[:, 2] - truth.boxes[:, 0], truth.boxes[:, 3] - truth.boxes[:, 1])
    assert (size[truth.labels == 0] >= 6).all() and (size[truth.labels == 0] <= 41).all()
    assert (size[truth.labels == 1] >= 25).all() and (size[truth.labels == 1] <= 204).all()
    # Each defect changes the surface where it lies.
    scene = SyntheticScene(4096, 4096, 11, kind="industrial")
    grey = level0.astype(float).mean(-1)
    for (x0, y0, x1, y1), lab in zip(truth.boxes, truth.labels, strict=True):
        if lab == 0:
            cx, cy = int((x0 + x1) / 2), int((y0 + y1) / 2)
            assert abs(grey[cy, cx] - 150) > 25
    assert scene.region_mask(0, 0, 64, 64).min() == 1


# ------------------------------------------------------------------ CLI and errors


def test_cli_writes_slide_and_truth(tmp_path, capsys):
    out = tmp_path / "cli.tiff"
    rc = cli.main(["synth", str(out), "--width", "1500", "--height", "1100", "--seed", "3"])
    assert rc == 0
    assert out.exists() and os.path.exists(default_truth_path(out))
    assert str(tmp_path / "cli.truth.geojson") == default_truth_path(out)
    assert "cli.tiff" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["cli.tiff", "cli.truth.geojson"]  # no temporaries left
    truth_path = tmp_path / "other.geojson"
    rc = cli.main(
        [
            "synth",
            str(tmp_path / "i.tiff"),
            "--width",
            "800",
            "--height",
            "600",
            "--kind",
            "industrial",
            "--truth",
            str(truth_path),
            "--tile-size",
            "128",
        ]
    )
    assert rc == 0 and truth_path.exists()
    with tifffile.TiffFile(tmp_path / "i.tiff") as tf:
        assert tf.pages[0].tilewidth == 128


@pytest.mark.parametrize(
    "argv",
    [
        ["--width", "0", "--height", "100"],
        ["--width", "100", "--height", "-5"],
        ["--width", "10000000", "--height", "100"],
        ["--width", "100", "--height", "100", "--tile-size", "100"],
        ["--width", "100", "--height", "100", "--mpp", "0"],
    ],
)
def test_cli_rejects_bad_sizes(tmp_path, capsys, argv):
    out = tmp_path / "bad.tiff"
    assert cli.main(["synth", str(out), *argv]) != 0
    assert "error:" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_bad_arguments_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="width"):
        SyntheticScene(0, 10, 1)
    with pytest.raises(ConfigError, match="kind"):
        SyntheticScene(10, 10, 1, kind="radiology")
    with pytest.raises(ConfigError, match="folder"):
        write_synthetic_slide(tmp_path / "missing" / "s.tiff", 100, 100, 1)
    with pytest.raises(ConfigError, match="region size"):
        SyntheticScene(100, 100, 1).render(0, 0, 0, 10)


def test_tissue_holes_are_kept_in_the_truth(tmp_path):
    scene = SyntheticScene(W, H, 3)  # this seed's tissue has a hole
    write_truth(scene, tmp_path / "t.geojson")
    truth = load_truth(tmp_path / "t.geojson")
    assert sum(len(h) for h in truth.region_holes["tissue"]) >= 1
    mask = scene.region_mask(0, 0, W, H, 4)
    assert (truth.region_mask("tissue", 4).astype(bool) != (mask >= 1)).mean() < 0.01
