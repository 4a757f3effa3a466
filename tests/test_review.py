"""Review helpers: filters, GeoJSON export, run loading and the figures' coordinate frames."""

import json

import pytest

matplotlib = pytest.importorskip("matplotlib")  # the notebooks extra
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from wsi_pipeline.errors import WSIPipelineError  # noqa: E402
from wsi_pipeline.io.detections import make_detections, read_geojson  # noqa: E402
from wsi_pipeline.review import (  # noqa: E402
    ReviewRun,
    busiest_region,
    count_by_class,
    export_geojson,
    filter_detections,
    load_run,
    plot_counts,
    plot_gallery,
    plot_overview,
    plot_region,
    region_mask,
    save_figure,
    score_slider,
    widgets_available,
)
from wsi_pipeline.review.figures import DETECTION_GID, heatmap_for_display  # noqa: E402
from wsi_pipeline.slide.image import ImageSlide  # noqa: E402

CLASSES = ["spot", "scratch"]
COLORS = [(230, 160, 0), (0, 170, 230)]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def hand_made() -> np.ndarray:
    """Six boxes (level-0 px) of two classes with known scores."""
    boxes = [
        [10, 10, 20, 20],  # 0 spot 0.9, centre (15, 15)
        [100, 100, 140, 120],  # 1 scratch 0.5, centre (120, 110)
        [195, 50, 215, 70],  # 2 spot 0.3, centre (205, 60): straddles x = 200
        [300, 300, 310, 310],  # 3 scratch 0.95
        [50, 180, 60, 190],  # 4 spot 0.5 (score on the bound)
        [0, 0, 4, 4],
    ]  # 5 scratch 0.1
    return make_detections(np.array(boxes, np.float32), [0.9, 0.5, 0.3, 0.95, 0.5, 0.1], [0, 1, 0, 1, 0, 1])


# -- filters -------------------------------------------------------------------
def test_filter_by_class_name_and_label():
    d = hand_made()
    spots = filter_detections(d, classes="spot", class_names=CLASSES)
    assert spots["label"].tolist() == [0, 0, 0]
    assert spots["score"].tolist() == pytest.approx([0.9, 0.3, 0.5])
    assert np.array_equal(filter_detections(d, classes=[1]), d[[1, 3, 5]])
    assert len(filter_detections(d, classes=["spot", "scratch"], class_names=CLASSES)) == 6
    with pytest.raises(WSIPipelineError, match="'nucleus' is not one of"):
        filter_detections(d, classes="nucleus", class_names=CLASSES)


def test_filter_by_score_bounds_are_inclusive():
    d = hand_made()
    assert filter_detections(d, min_score=0.5)["score"].tolist() == pytest.approx([0.9, 0.5, 0.95, 0.5])
    assert filter_detections(d, max_score=0.5)["score"].tolist() == pytest.approx([0.5, 0.3, 0.5, 0.1])
    both = filter_detections(d, min_score=0.3, max_score=0.5, classes="spot", class_names=CLASSES)
    assert both["score"].tolist() == pytest.approx([0.3, 0.5])


def test_filter_by_region_modes():
    d = hand_made()
    region = (0, 0, 200, 200)  # x, y in [0, 200)
    assert region_mask(d, region, "centre").tolist() == [True, True, False, False, True, True]
    assert region_mask(d, region, "inside").tolist() == [True, True, False, False, True, True]
    assert region_mask(d, region, "overlap").tolist() == [True, True, True, False, True, True]
    # A region holding box 2's centre (205, 60) but not all of it.
    assert region_mask(d, (200, 40, 50, 50), "centre").tolist() == [False, False, True, False, False, False]
    assert region_mask(d, (200, 40, 50, 50), "inside").tolist() == [False] * 6
    # Box 4 (y 180..190, centre 185) starts inside y < 185 but its centre does not.
    assert region_mask(d, (0, 0, 200, 185), "centre").tolist() == [True, True, False, False, False, True]
    assert region_mask(d, (0, 0, 200, 185), "overlap")[4]
    kept = filter_detections(d, region=(90, 90, 300, 300), min_score=0.9)
    assert np.array_equal(kept, d[[3]])
    with pytest.raises(WSIPipelineError, match="region mode"):
        region_mask(d, region, "middle")
    with pytest.raises(WSIPipelineError, match="positive"):
        region_mask(d, (0, 0, 0, 10))


def test_count_by_class_lists_every_class():
    d = hand_made()
    assert count_by_class(d, CLASSES) == {"spot": 3, "scratch": 3}
    assert count_by_class(d[:1], CLASSES + ["dent"]) == {"spot": 1, "scratch": 0, "dent": 0}


def test_busiest_region_finds_the_cluster():
    rng = np.random.default_rng(0)
    centres = np.concatenate([rng.uniform(0, 4000, (50, 2)), rng.uniform([2600, 1100], [2900, 1400], (200, 2))])
    boxes = np.concatenate([centres - 5, centres + 5], axis=1)
    d = make_detections(boxes, np.ones(len(boxes)), np.zeros(len(boxes)))
    x0, y0, w, h = busiest_region(d, 512, (4000, 3000))
    assert (w, h) == (512, 512)
    inside = region_mask(d, (x0, y0, w, h)).sum()
    assert inside >= 200
    assert x0 <= 2600 and x0 + 512 >= 2900 and y0 <= 1100 and y0 + 512 >= 1400


def test_export_geojson_round_trip(tmp_path):
    d = hand_made()
    run = make_run(d)
    sub = run.filter(classes="scratch", min_score=0.4)
    path = export_geojson(tmp_path / "scratch.geojson", sub)
    doc = json.loads(path.read_text())
    assert len(doc["features"]) == 2
    props = doc["features"][0]["properties"]
    assert props["objectType"] == "detection"
    assert props["classification"] == {"name": "scratch", "color": [0, 170, 230]}
    back = read_geojson(path, classes=run.classes)
    for k in ("x0", "y0", "x1", "y1", "label"):
        assert np.array_equal(back[k], d[[1, 3]][k])
    assert back["score"] == pytest.approx(d[[1, 3]]["score"], abs=1e-6)
    with pytest.raises(WSIPipelineError, match="does not exist"):
        export_geojson(tmp_path / "nowhere" / "x.geojson", sub)


# -- figures on a hand-made image ------------------------------------------------
def image_with_objects(d: np.ndarray, w: int = 480, h: int = 360) -> np.ndarray:
    """Light grey image with each detection box painted dark (level-0 px = array px)."""
    img = np.full((h, w, 3), 220, np.uint8)
    for b in d:
        img[int(b["y0"]) : int(b["y1"]), int(b["x0"]) : int(b["x1"])] = (30, 30, 90)
    return img


def make_run(d: np.ndarray, img: np.ndarray | None = None, mpp=None, heatmap=None, scale=1.0) -> ReviewRun:
    img = image_with_objects(d) if img is None else img
    slide = ImageSlide.from_array(img, mpp=mpp)
    return ReviewRun(
        detections=d,
        class_names=list(CLASSES),
        class_colors=list(COLORS),
        dimensions=slide.dimensions,
        mpp=mpp,
        heatmap=heatmap,
        heatmap_classes=["tissue", "tumour"] if heatmap is not None else [],
        heatmap_scale_level0=scale,
        slide=slide,
    )


def drawn_boxes(ax) -> np.ndarray:
    """(N, 4) x0, y0, x1, y1 of the detection rectangles on ``ax`` (data = level-0 px)."""
    rects = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid() == DETECTION_GID]
    return np.array(
        [[r.get_x(), r.get_y(), r.get_x() + r.get_width(), r.get_y() + r.get_height()] for r in rects]
    ).reshape(-1, 4)


def image_value_at(ax, x: float, y: float) -> np.ndarray:
    """The pixel of the first image on ``ax`` under data point (x, y), located through its extent."""
    im = ax.images[0]
    arr = np.asarray(im.get_array())
    left, right, bottom, top = im.get_extent()
    col = int((x - left) / (right - left) * arr.shape[1])
    row = int((y - top) / (bottom - top) * arr.shape[0])
    return arr[row, col]


def test_region_boxes_sit_on_the_objects():
    d = hand_made()
    run = make_run(d)
    fig = plot_region(run, 90, 40, 160, 100)
    ax = fig.axes[0]
    assert ax.images[0].get_extent() == [90, 250, 140, 40]
    assert ax.get_xlim() == (90, 250) and ax.get_ylim() == (140, 40)
    # Boxes 1 (100..140 x 100..120) and 2 (195..215 x 50..70) overlap the region; no other.
    got = drawn_boxes(ax)
    want = np.stack([d[k] for k in ("x0", "y0", "x1", "y1")], 1)[[1, 2]]
    assert np.allclose(got[np.lexsort(got.T[::-1])], want[np.lexsort(want.T[::-1])])
    for x0, y0, x1, y1 in got:  # the image under each box centre is the painted object
        assert image_value_at(ax, (x0 + x1) / 2, (y0 + y1) / 2).tolist() == [30, 30, 90]
    # ... and just outside it is background
    assert image_value_at(ax, 98, 110).tolist() == [220, 220, 220]
    assert ax.get_xlabel() == "x (level-0 px)"
    with pytest.raises(WSIPipelineError, match="too large"):
        plot_region(run, 0, 0, 5000, 5000)


def test_region_in_micrometres_when_mpp_known():
    d = hand_made()
    fig = plot_region(make_run(d, mpp=(0.5, 0.5)), 0, 0, 200, 200)
    ax = fig.axes[0]
    labels = [c.get_xlabel() for c in ax.child_axes] + [c.get_ylabel() for c in ax.child_axes]
    assert "x (µm)" in labels and "y (µm)" in labels


def test_overview_extent_maps_to_level0():
    d = make_detections(np.array([[1500, 400, 1700, 560]], np.float32), [0.8], [0])
    img = image_with_objects(d, w=3000, h=1200)
    # A heatmap at 10 level-0 px per pixel, 300 x 120: tumour hot on level-0 x 2000..2500, y 600..1000.
    heat = np.zeros((2, 120, 300), np.float32)
    heat[0] = 1.0
    heat[1, 60:100, 200:250] = 0.9
    run = make_run(d, img=img, heatmap=heat, scale=10.0)
    fig = plot_overview(run, thumb_size=600)
    ax = fig.axes[0]
    assert ax.images[0].get_extent() == [0, 3000, 1200, 0]
    assert np.asarray(ax.images[0].get_array()).shape[:2] == (240, 600)
    assert image_value_at(ax, 1600, 480).tolist() == [30, 30, 90]  # the object
    assert image_value_at(ax, 1400, 480).tolist() == [220, 220, 220]  # beside it
    # "tissue" is skipped; the tumour layer covers level-0 (0..3000, 0..1200) at 10 px per heatmap px.
    heat_images = ax.images[1:]
    assert [im.get_label() for im in heat_images] == ["tumour"]
    hm = heat_images[0]
    assert hm.get_extent() == [0.0, 3000.0, 1200.0, 0.0]
    arr = np.asarray(hm.get_array())
    left, right, bottom, top = hm.get_extent()
    rows, cols = np.nonzero(arr > 0.5)
    xs = left + (cols + 0.5) * (right - left) / arr.shape[1]
    ys = top + (rows + 0.5) * (bottom - top) / arr.shape[0]
    assert xs.min() > 2000 and xs.max() < 2500 and ys.min() > 600 and ys.max() < 1000
    # The boxes are drawn at their level-0 corners.
    coll = [c for c in ax.collections if c.get_gid() == DETECTION_GID]
    assert len(coll) == 1
    assert np.allclose(coll[0].get_paths()[0].vertices[:4], [[1500, 400], [1700, 400], [1700, 560], [1500, 560]])
    assert ax.get_xlabel() == "x (level-0 px)" and ax.get_ylabel() == "y (level-0 px)"
    # Asking for the tissue channel shows it.
    fig2 = plot_overview(run, channels=["tissue", "tumour"], thumb_size=600)
    assert [im.get_label() for im in fig2.axes[0].images[1:]] == ["tissue", "tumour"]
    with pytest.raises(WSIPipelineError, match="not in this run's heatmap"):
        plot_overview(run, channels=["stroma"])


def test_heatmap_for_display_reduces_but_keeps_extent():
    heat = np.zeros((1, 400, 1000), np.float32)
    run = make_run(hand_made(), heatmap=heat, scale=4.0)
    run.heatmap_classes = ["tumour"]
    data, extent = heatmap_for_display(run, 200)
    assert data.shape == (1, 80, 200)
    assert extent == (0.0, 4000.0, 1600.0, 0.0)


def test_gallery_sorted_by_score_with_labels():
    d = hand_made()
    run = make_run(d)
    fig = plot_gallery(run, n=3, margin=4)
    blocks = fig.subfigs
    assert [b._suptitle.get_text() for b in blocks] == ["highest scores", "lowest scores"]
    for block, want in zip(blocks, ([0.95, 0.9, 0.5], [0.1, 0.3, 0.5]), strict=True):
        crops = [a for a in block.axes if getattr(a, "review_score", None) is not None]
        assert [a.review_score for a in crops] == pytest.approx(want)
        for a in crops:
            assert a.get_title().startswith(f"{a.review_score:.3f}")
            det = d[a.review_index]
            assert np.allclose(drawn_boxes(a), [[det["x0"], det["y0"], det["x1"], det["y1"]]])
            x0, y0, x1, y1 = drawn_boxes(a)[0]
            assert image_value_at(a, (x0 + x1) / 2, (y0 + y1) / 2).tolist() == [30, 30, 90]
    only = plot_gallery(run, n=5, which="highest", classes=["spot"])
    crops = [a for a in only.subfigs[0].axes if getattr(a, "review_score", None) is not None]
    assert [a.review_score for a in crops] == pytest.approx([0.9, 0.5, 0.3])


def test_counts_and_histogram():
    d = hand_made()
    fig = plot_counts(make_run(d[:5]), bins=10, threshold=0.5)
    ax_bar, ax_hist = fig.axes[:2]
    assert [p.get_height() for p in ax_bar.patches] == [3, 2]
    tops = sum(p.get_height() for p in ax_hist.patches if p.get_height() > 0 and p.get_y() == 0)
    stacked = sum(p.get_height() for p in ax_hist.patches)
    assert stacked == 5 and tops >= 1


def test_save_figure_writes_a_png(tmp_path):
    fig = plot_region(make_run(hand_made()), 0, 0, 240, 240)
    path = save_figure(fig, tmp_path / "sub" / "region.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import cv2

    img = cv2.imread(str(path))
    assert img.shape[0] > 100 and img.std() > 10


def test_widgets_report_unavailable_outside_a_kernel(capsys):
    assert widgets_available() is False
    assert score_slider(make_run(hand_made())) is None
    assert "needs ipywidgets" in capsys.readouterr().out


# -- a real run ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pathology_run(tmp_path_factory):
    from wsi_pipeline import Pipeline
    from wsi_pipeline.synthetic import write_synthetic_slide

    root = tmp_path_factory.mktemp("review_run")
    info = write_synthetic_slide(root / "slide.tif", 1024, 1024, seed=5)
    with Pipeline.from_card(None, backend="ort") as pipe:
        result = pipe.run(info["path"], out_dir=root / "run")
    return root, info, result


def test_load_run_matches_the_result(pathology_run):
    root, info, result = pathology_run
    run = load_run(root / "run")
    assert run.class_names == ["nucleus"] and run.class_colors == [(0x7B, 0x2C, 0xBF)]
    assert run.dimensions == (1024, 1024) and run.mpp == (0.25, 0.25)
    assert run.heatmap_classes == ["tissue", "tumour"]
    assert run.heatmap_scale_level0 == pytest.approx(result.heatmap_scale_level0)
    assert str(run.slide_path) == info["path"]
    assert len(run.detections) == len(result.detections) > 0
    for k in ("x0", "y0", "x1", "y1"):  # the GeoJSON holds coordinates to 0.01 px
        np.testing.assert_allclose(run.detections[k], result.detections[k], atol=0.006)
    assert np.array_equal(run.detections["label"], result.detections["label"])
    assert "detections" in repr(run) and len(repr(run)) < 300
    via_result = ReviewRun.from_result(result)
    assert via_result.class_colors == run.class_colors and via_result.slide_path == run.slide_path
    with pytest.raises(WSIPipelineError, match="summary.json"):
        load_run(root / "missing")


def test_load_run_reads_whichever_detection_file_the_run_wrote(pathology_run, tmp_path):
    """Runs whose formats leave out GeoJSON: Parquet, CSV, the DSA annotation, the GeoParquet name of
    earlier versions; a folder with none loads empty and says so."""
    import shutil

    from wsi_pipeline.io.dsa import write_dsa
    from wsi_pipeline.io.parquet import write_geoparquet, write_parquet
    from wsi_pipeline.review.results import NoDetectionFileWarning

    root, _, result = pathology_run
    classes = [{"name": "nucleus", "color": "#7b2cbf"}]
    writers = {
        "detections.parquet": write_parquet,
        "detections.csv": None,  # the run's own
        "detections.geoparquet": write_geoparquet,
        "detections.dsa.json": write_dsa,
    }
    for name, write in writers.items():
        folder = tmp_path / name / "slide"
        folder.mkdir(parents=True)
        shutil.copy(root / "run" / "summary.json", folder)
        if write is None:
            shutil.copy(root / "run" / name, folder)
        else:
            write(folder / name, result.detections, classes)
        run = load_run(folder)
        assert run.detections_file == folder / name
        assert run.class_names == ["nucleus"] and len(run.detections) == len(result.detections) > 0
        for k in ("x0", "y0", "x1", "y1"):
            np.testing.assert_allclose(run.detections[k], result.detections[k], atol=0.006)
    folder = tmp_path / "none"
    folder.mkdir()
    shutil.copy(root / "run" / "summary.json", folder)
    with pytest.warns(NoDetectionFileWarning, match=r"no detection file \(detections.parquet, detections.geojson"):
        run = load_run(folder)
    assert len(run.detections) == 0 and run.detections_file is None


def test_zoom_boxes_land_on_truth_objects(pathology_run):
    from wsi_pipeline.synthetic import load_truth

    root, info, _ = pathology_run
    run = load_run(root / "run")
    truth = load_truth(info["truth_path"])
    x0, y0, w, h = busiest_region(run.detections, 256, run.dimensions)
    ax = plot_region(run, x0, y0, w, h, reference=truth.boxes).axes[0]
    got = drawn_boxes(ax)
    assert len(got) >= 10
    tb = truth.boxes.astype(np.float64)
    ix = np.clip(np.minimum(got[:, None, 2], tb[None, :, 2]) - np.maximum(got[:, None, 0], tb[None, :, 0]), 0, None)
    iy = np.clip(np.minimum(got[:, None, 3], tb[None, :, 3]) - np.maximum(got[:, None, 1], tb[None, :, 1]), 0, None)
    inter = ix * iy
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
    iou = inter / (area(got)[:, None] + area(tb)[None, :] - inter)
    assert (iou.max(1) >= 0.5).mean() >= 0.9
    # Nuclei are darker than the tissue around them: the image under the box centres is dark.
    centre_v = [
        image_value_at(ax, (a + c) / 2, (b + e) / 2).mean()
        for a, b, c, e in got
        if x0 <= (a + c) / 2 < x0 + w and y0 <= (b + e) / 2 < y0 + h
    ]
    assert np.median(centre_v) < np.median(np.asarray(ax.images[0].get_array()).mean(2)) - 30


def test_widgets_redraw_when_available(monkeypatch):
    pytest.importorskip("ipywidgets")
    from wsi_pipeline.review import widgets

    monkeypatch.setattr(widgets, "widgets_available", lambda: True)
    d = hand_made()
    run = make_run(d)
    slider = widgets.score_slider(run)
    slider.children[0].value = (0.45, 0.92)
    slider.update()  # draws the overview and the counts for scores in [0.45, 0.92]
    bars = [f for f in map(plt.figure, plt.get_fignums()) if len(f.axes) >= 2 and f.axes[0].patches]
    assert [p.get_height() for p in bars[-1].axes[0].patches] == [2, 1]  # spots 0.9, 0.5; scratch 0.5
    picker = widgets.region_picker(run, size=128)
    picker.children[0].value, picker.children[1].value = 96, 32
    picker.update()
    ax = plt.figure(plt.get_fignums()[-1]).axes[0]
    assert ax.images[0].get_extent() == [96, 224, 160, 32]


def test_widgets_are_shown_only_under_a_live_front_end_unless_asked():
    from wsi_pipeline.review import widgets_wanted

    assert not widgets_wanted({})  # nbclient, nbconvert, papermill: no front end's variables
    assert widgets_wanted({"JPY_SESSION_NAME": "/work/02_review_results.ipynb"})  # Jupyter Server
    assert widgets_wanted({"VSCODE_PID": "123"})
    assert not widgets_wanted({"JPY_SESSION_NAME": "x.ipynb", "WSI_NB_WIDGETS": "0"})
    assert widgets_wanted({"WSI_NB_WIDGETS": "1"})
