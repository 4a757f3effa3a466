"""The Python API end to end: quality against synthetic truth, outputs, arrays, threads."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tifffile
from helpers import corrupt_stored_tile

from wsi_pipeline import Pipeline
from wsi_pipeline.errors import ClosedError, ConfigError, SlideError, TileReadError
from wsi_pipeline.inference.choice import even_batches, fixed_batches
from wsi_pipeline.inference.executor import Executor
from wsi_pipeline.io.atomic import write_json
from wsi_pipeline.io.detections import detection_boxes, read_geojson
from wsi_pipeline.io.ome_tiff import HeatmapFile
from wsi_pipeline.models.evaluate import detection_counts, dice
from wsi_pipeline.outputs import OUTPUT_FILES
from wsi_pipeline.result import PendingResult, Result
from wsi_pipeline.synthetic import SyntheticScene, load_truth, write_synthetic_slide

INDUSTRIAL = "engines/defects_industrial.card.json"


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "tissue.tiff"
    write_synthetic_slide(path, 3072, 2560, seed=11, kind="pathology")
    return path


@pytest.fixture(scope="module")
def pipe():
    p = Pipeline.from_card(backend="ort")
    yield p
    p.close()


@pytest.fixture(scope="module")
def run_out(pipe, slide_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe_out") / "tissue"
    return pipe.run(slide_path, out_dir=out), out


def _counts(dets, truth_boxes):
    return detection_counts(
        [detection_boxes(dets)],
        [dets["score"]],
        [np.zeros(len(dets), int)],
        [truth_boxes],
        [np.zeros(len(truth_boxes), int)],
    )


def test_slide_detections_match_the_ground_truth(pipe, slide_path):
    result = pipe.run(slide_path)
    truth = load_truth(str(slide_path).replace(".tiff", ".truth.geojson"))
    c = _counts(result.detections, truth.boxes)
    # Tile-level figures of the model are P 0.997 / R 0.996; stitching must not lose that
    # (duplicates across overlaps would show up as false positives).
    assert c.precision >= 0.98, c
    assert c.recall >= 0.98, c
    assert result.summary["counts"]["nucleus"] == len(result.detections)


def test_a_slide_merged_in_the_merging_process_gives_the_same_detections(pipe, slide_path, run_out, monkeypatch):
    """Small images merge their boxes on a thread, large slides in the pipeline's merging process:
    the same detections either way (the module's fixture slide is small, so its threshold is lowered)."""
    from wsi_pipeline import slide_run

    on_thread = run_out[0]
    monkeypatch.setattr(slide_run, "MERGE_PROCESS_MIN_TILES", 0)
    in_process = pipe.run(slide_path)
    assert (on_thread.summary["box_merge"], in_process.summary["box_merge"]) == ("thread", "process")
    assert len(in_process.detections) > 100
    np.testing.assert_array_equal(in_process.detections, on_thread.detections)


def test_heatmap_covers_the_tumour_region(pipe, slide_path):
    result = pipe.run(slide_path)
    truth = load_truth(str(slide_path).replace(".tiff", ".truth.geojson"))
    scale = result.heatmap_scale_level0
    tumour = result.heatmap[result.heatmap_classes.index("tumour")]
    expected = truth.region_mask("tumour", scale)[: tumour.shape[0], : tumour.shape[1]]
    assert tumour.shape == expected.shape
    assert dice(tumour > 0.5, expected > 0) > 0.9


def test_qupath_geojson_shape(run_out, slide_path):
    result, out = run_out
    with open(out / "detections.geojson", encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["type"] == "FeatureCollection"
    assert len(doc["features"]) == len(result.detections) > 0
    w, h = result.summary["dimensions_level0"]
    for feat in doc["features"][:200]:
        assert feat["type"] == "Feature"
        geom = feat["geometry"]
        assert geom["type"] == "Polygon"
        ring = np.asarray(geom["coordinates"][0])
        assert ring.shape == (5, 2) and (ring[0] == ring[-1]).all()
        assert (ring[:, 0] >= 0).all() and (ring[:, 0] <= w).all() and (ring[:, 1] <= h).all()
        props = feat["properties"]
        assert props["objectType"] == "detection"
        assert props["classification"]["name"] == "nucleus"
        color = props["classification"]["color"]
        assert len(color) == 3 and all(isinstance(v, int) and 0 <= v <= 255 for v in color)
        assert 0 <= props["measurements"]["score"] <= 1
    back = read_geojson(out / "detections.geojson", [{"name": "nucleus"}])
    np.testing.assert_allclose(detection_boxes(back), detection_boxes(result.detections), atol=0.006)


def test_csv_matches_detections(run_out):
    result, out = run_out
    lines = (out / "detections.csv").read_text().splitlines()
    assert lines[0] == "x0,y0,x1,y1,score,label,class,tile_row,tile_col"
    assert len(lines) == len(result.detections) + 1
    first = lines[1].split(",")
    d = result.detections[0]
    assert float(first[0]) == pytest.approx(float(d["x0"]), abs=0.01)
    assert first[6] == "nucleus"


def test_heatmap_ome_tiff_has_pyramid_and_pixel_size(run_out):
    result, out = run_out
    with tifffile.TiffFile(out / "heatmap.ome.tif") as tif:
        assert tif.is_ome
        series = tif.series[0]
        assert series.axes == "CYX"
        assert len(series.levels) >= 2
        assert series.shape == (2, 2560 // 8, 3072 // 8)
        xml = tif.ome_metadata
    assert 'PhysicalSizeX="2.0"' in xml  # 0.25 um/px x stride 8
    assert 'Name="tumour"' in xml
    lazy = result.heatmap  # written to a folder: read lazily from the file
    assert lazy.shape == (2, 320, 384)
    assert lazy.channel_names == ["tissue", "tumour"]
    full = lazy.read(0)
    assert full.dtype == np.float32 and 0 <= full.min() and full.max() <= 1
    assert lazy.read(1).shape == (2, 160, 192)


def test_summary_holds_what_a_report_needs(run_out):
    result, out = run_out
    s = json.loads((out / "summary.json").read_text())
    assert s["counts"]["nucleus"] == len(result.detections)
    assert s["tissue"]["area_mm2"] > 0
    source = s["tissue"]["source"]  # where the mask came from, what it cost
    assert source["level"] in range(3) and source["seconds"] >= 0 and source["stored_tiles_decoded"] >= 0
    tumour = s["heatmap_scores"]["tumour"]
    assert 0 < tumour["area_above_0.5_mm2"] < s["tissue"]["area_mm2"]
    assert 0 < tumour["fraction_of_tissue_above_0.5"] < 1
    assert 0 < tumour["mean_probability"] <= tumour["max_probability"] <= 1
    assert s["tiles"]["read"] + s["tiles"]["skipped"] == s["tiles"]["total"]
    assert s["tiles"]["skipped"] > 0  # the background tiles
    seconds = s["seconds"]
    for stage in ("tissue_mask", "read_and_infer", "stitch", "write", "total"):
        assert seconds[stage] > 0, stage
    assert seconds["total"] >= seconds["tissue_mask"] + seconds["read_and_infer"] + seconds["stitch"]
    assert s["peak_host_memory_mb"] > 0
    assert s["peak_writer_memory_mb"] > 10  # the writer processes, each a Python with numpy at least
    assert s["detections_over_cap"] == 0
    assert len(s["model"]["sha256"]) == 64
    assert s["parameters"]["overlap"] == 64
    assert "numpy" in s["versions"] and "onnxruntime" in s["versions"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["detections.csv", "detections.geojson", "heatmap.ome.tif", "overlay.png", "summary.json"]
    )


def _industrial_image(seed: int, size: int = 1024):
    scene = SyntheticScene(size, size, seed=seed, kind="industrial")
    return scene.render(0, 0, size, size), scene


def test_array_input_finds_the_defects():
    preds, truths = [], []
    with Pipeline.from_card(INDUSTRIAL, backend="ort") as p:
        for seed in (2, 4, 8, 10):  # 24 defects in all
            img, scene = _industrial_image(seed, 2048)
            result = p.run(img)
            assert result.heatmap is None and result.summary["mpp"] is None
            preds.append(result.detections)
            truths.append(scene.objects_in(0, 0, 2048, 2048))
    c = detection_counts(
        [detection_boxes(d) for d in preds],
        [d["score"] for d in preds],
        [d["label"] for d in preds],
        [t[0] for t in truths],
        [t[1] for t in truths],
    )
    # Measured P 0.96 / R 1.0 here; the model's tile-level figures on scratches are P 0.91 / R 0.84.
    assert c.tp + c.fn == 24
    assert c.precision >= 0.9 and c.recall >= 0.9, c


def test_threads_share_batches_and_get_their_own_results():
    images = [_industrial_image(s, 800)[0] for s in (1, 2, 3, 4)]
    with Pipeline.from_card(INDUSTRIAL, backend="ort", max_wait_s=0.5) as p:
        alone = [p.run(img).detections for img in images]
        batches_before = p.service.batches_run
        results: dict[int, np.ndarray] = {}
        barrier = threading.Barrier(4)

        def call(i: int) -> None:
            barrier.wait()
            results[i] = p.run(images[i]).detections

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        mixed = p.service.mixed_batches
        batches = p.service.batches_run - batches_before
    for i in range(4):
        np.testing.assert_array_equal(results[i], alone[i])
    # 4 callers x 4 tiles each, all within the service's wait: shared batches of up to 8 tiles,
    # where callers alone would make 8 (each frame's tiles shared evenly by the 2 sessions).
    assert mixed > 0
    assert batches < 8


def test_corrupt_tile_fails_the_run_and_leaves_no_outputs(tmp_path):
    path = tmp_path / "broken.tiff"
    write_synthetic_slide(path, 2048, 2048, seed=2, kind="pathology")
    corrupt_stored_tile(path)
    out = tmp_path / "out"
    with Pipeline.from_card(backend="ort", tissue="all") as p, pytest.raises(TileReadError) as info:
        p.run(path, out_dir=out)
    assert "broken.tiff" in str(info.value)
    assert not any(p.name.endswith((".tif", ".geojson", ".json", ".png", ".csv")) for p in out.iterdir())
    assert list(out.iterdir()) == []  # no spool either
    stitching = [t.name for t in threading.enumerate() if t.name in ("box-merge", "heatmap-sink") and t.is_alive()]
    assert stitching == []  # the failed run's stitching threads have ended


def test_tile_size_must_match_the_model():
    with pytest.raises(ConfigError, match="takes 512 px tiles"):
        Pipeline.from_card(backend="ort", tile=256)


def test_detections_convert_to_a_dataframe(pipe, slide_path):
    pd = pytest.importorskip("pandas")
    result = pipe.run(slide_path)
    df = result.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == len(result.detections)
    assert list(df.columns) == ["x0", "y0", "x1", "y1", "score", "label", "class"]
    assert set(df["class"]) == {"nucleus"}
    assert (df["x1"] > df["x0"]).all() and df["score"].between(0, 1).all()
    np.testing.assert_array_equal(pd.DataFrame(result.detections)["x0"].to_numpy(), result.detections["x0"])


def test_outputs_can_finish_while_the_caller_goes_on(pipe, slide_path, run_out, tmp_path):
    """wait_written=False: the run returns before its files are written; the folder ends up the same."""
    run_out = run_out[1]
    res = pipe.run(slide_path, out_dir=tmp_path / "later", wait_written=False)
    assert res.written is not None
    res.wait_written()
    names = sorted(p.name for p in (tmp_path / "later").iterdir())
    assert names == sorted(OUTPUT_FILES)
    assert (tmp_path / "later" / "detections.csv").read_text() == (run_out / "detections.csv").read_text()
    assert res.heatmap.shape == HeatmapFile(run_out / "heatmap.ome.tif").shape
    assert json.loads((tmp_path / "later" / "summary.json").read_text())["seconds"]["write"] > 0


def test_runs_that_complete_later_overlap_and_give_the_same_results(pipe, slide_path, run_out, tmp_path):
    """wait_written=False returns a PendingResult once the tiles are through the model; a second run
    starts while the first one's merge, summary and files are still under way, and both give what
    a run alone gives."""
    first_res, first_out = run_out
    a = pipe.run(slide_path, out_dir=tmp_path / "a", wait_written=False)
    b = pipe.run(slide_path, out_dir=tmp_path / "b", wait_written=False)
    assert isinstance(a, PendingResult) and isinstance(b, PendingResult)
    for pending, folder in ((a, "a"), (b, "b")):
        res = pending.wait_written()
        assert isinstance(res, Result)
        np.testing.assert_array_equal(res.detections, first_res.detections)
        np.testing.assert_array_equal(pending.detections, res.detections)  # attributes wait, then read through
        assert res.summary["counts"] == first_res.summary["counts"]
        assert res.summary["heatmap_scores"] == first_res.summary["heatmap_scores"]
        assert (tmp_path / folder / "detections.csv").read_text() == (first_out / "detections.csv").read_text()
        assert json.loads((tmp_path / folder / "summary.json").read_text())["counts"] == res.summary["counts"]


def test_detection_files_written_in_parts_by_the_writer_processes_equal_the_whole(
    pipe, slide_path, run_out, tmp_path, monkeypatch
):
    """With parts of a few rows, the GeoJSON and CSV are written in parts by the writer processes
    and joined: the same bytes as written whole, and no part left in the folder."""
    import wsi_pipeline.io.writer_pool as writer_pool

    first_res, first_out = run_out
    assert pipe.writers.parts(len(first_res.detections)) == 1  # written whole by the fixture's run
    monkeypatch.setattr(writer_pool, "PART_ROWS", max(1, len(first_res.detections) // 5))
    assert pipe.writers.parts(len(first_res.detections)) == pipe.writers.processes > 1
    pipe.run(slide_path, out_dir=tmp_path / "parts")
    for name in ("detections.geojson", "detections.csv"):
        assert (tmp_path / "parts" / name).read_bytes() == (first_out / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == sorted(OUTPUT_FILES)


def test_a_part_that_fails_fails_the_run_and_leaves_no_part_and_no_summary(
    pipe, slide_path, run_out, tmp_path, monkeypatch
):
    """One part of the GeoJSON cannot be written (its name is taken by a folder): the run raises
    that, after every other job ended, and the folder holds no other part, no spool and no
    summary.json."""
    import wsi_pipeline.io.writer_pool as writer_pool
    from wsi_pipeline.io.atomic import partial_name

    first_res, _ = run_out
    monkeypatch.setattr(writer_pool, "PART_ROWS", max(1, len(first_res.detections) // 5))
    out = tmp_path / "broken"
    out.mkdir()
    blocked = partial_name(out / "detections.geojson.part1")
    blocked.mkdir()
    with pytest.raises(OSError) as err:
        pipe.run(slide_path, out_dir=out)
    assert str(blocked) in str(err.value)
    left = sorted(p.name for p in out.iterdir())
    assert "summary.json" not in left
    assert [n for n in left if ".part" in n or "spool" in n] == [blocked.name]
    assert len(pipe.run(slide_path).detections) == len(first_res.detections)


def test_a_run_that_fails_after_returning_raises_from_wait_written(pipe, slide_path, tmp_path, monkeypatch):
    """A failure of a run's last steps (here the stitching's end) comes out of wait_written and of any
    attribute read; the pipeline goes on with the next run."""
    from wsi_pipeline.stitch.stitcher import Stitcher

    real_finish = Stitcher.finish

    def failing_finish(self):
        raise OSError("the merge failed")

    monkeypatch.setattr(Stitcher, "finish", failing_finish)
    pending = pipe.run(slide_path, out_dir=tmp_path / "f", wait_written=False)
    with pytest.raises(OSError, match="the merge failed"):
        pending.wait_written()
    with pytest.raises(OSError, match="the merge failed"):
        pending.summary  # noqa: B018
    assert not (tmp_path / "f" / "summary.json").exists()
    monkeypatch.setattr(Stitcher, "finish", real_finish)
    assert len(pipe.run(slide_path).detections) > 0


def test_a_heatmap_file_that_fails_in_the_writer_process_leaves_no_file_and_no_spool(
    pipe, slide_path, tmp_path, monkeypatch
):
    """The heatmap file is written from its spool by a writer process; when that fails (here the
    spool is gone), the run raises, and the folder holds no heatmap file, spool, partial file or
    summary.json."""
    import shutil

    from wsi_pipeline.io.ome_tiff import OmeTiffHeatmapWriter

    real_spooled = OmeTiffHeatmapWriter.spooled

    def spool_lost(self):
        spooled = real_spooled(self)
        shutil.rmtree(spooled.spool)
        return spooled

    monkeypatch.setattr(OmeTiffHeatmapWriter, "spooled", spool_lost)
    assert pipe.writers.processes > 0
    pending = pipe.run(slide_path, out_dir=tmp_path / "f", wait_written=False)
    with pytest.raises(FileNotFoundError, match="level0.npy"):
        pending.wait_written()
    left = sorted(p.name for p in (tmp_path / "f").iterdir())
    assert "heatmap.ome.tif" not in left and "summary.json" not in left
    assert not [n for n in left if n.startswith(".")], left  # no spool, no partial file
    monkeypatch.setattr(OmeTiffHeatmapWriter, "spooled", real_spooled)
    pipe.run(slide_path, out_dir=tmp_path / "g")
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == sorted(OUTPUT_FILES)


def test_a_plan_made_ahead_runs_as_the_slide_itself(pipe, slide_path, run_out, tmp_path):
    """Pipeline.plan (open, tiling, tissue) then run(plan): the same files; the plan's steps counted
    in the summary; its slide closed by the run, or by close() when it is not run."""
    plan = pipe.plan(slide_path)
    assert plan.seconds["tissue_mask"] > 0 and len(plan.tiles) > 0
    res = pipe.run(plan, out_dir=tmp_path / "planned")
    assert (tmp_path / "planned" / "detections.csv").read_text() == (run_out[1] / "detections.csv").read_text()
    assert res.summary["seconds"]["tissue_mask"] == pytest.approx(plan.seconds["tissue_mask"], abs=1e-3)
    assert res.summary["seconds"]["total"] > sum(plan.seconds.values())
    with pytest.raises(ClosedError):
        plan.slide.read_region((0, 0), 0, (8, 8))
    unused = pipe.plan(slide_path)
    unused.close()
    with pytest.raises(ClosedError):
        unused.slide.read_region((0, 0), 0, (8, 8))
    with pytest.raises(SlideError, match="nope.tiff"):
        pipe.plan(tmp_path / "nope.tiff")
    with Pipeline.from_card(backend="ort") as other:
        foreign = other.plan(slide_path)
    with pytest.raises(ConfigError, match="a plan made by another pipeline"):
        pipe.run(foreign)
    with pytest.raises(ClosedError):
        foreign.slide.read_region((0, 0), 0, (8, 8))


def _fail_job(path):
    raise OSError(28, "No space left on device", str(path))


@pytest.mark.parametrize("processes", [0, 1])
def test_a_failed_write_job_raises_after_every_job_ended(tmp_path, processes):
    from wsi_pipeline.io.writer_pool import WriteJobs, WriterPool

    pool = WriterPool(processes)
    try:
        jobs = WriteJobs()
        pool.submit(jobs, "a.txt", _fail_job, tmp_path / "a.txt")
        pool.submit(jobs, "b.json", write_json, tmp_path / "b.json", {"ok": 1})
        with pytest.raises(OSError, match="No space left"):
            jobs.wait()
        assert jobs.done() and json.loads((tmp_path / "b.json").read_text()) == {"ok": 1}
    finally:
        pool.close()


def test_the_writer_processes_do_not_import_the_main_script(slide_path, tmp_path):
    """A script without a main guard writes its outputs: the writer processes start from their own
    module, so the script's top level (and what it imports) runs once, in the script's process."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    ran = tmp_path / "ran.txt"
    script.write_text(
        "import os\n"
        f"open({str(ran)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "from wsi_pipeline import Pipeline\n"
        "pipe = Pipeline.from_card(backend='ort', tissue='all')\n"
        f"pipe.run({str(slide_path)!r}, out_dir={str(tmp_path / 'out')!r})\n"
        "print(len(pipe.writers._pool._threads))\n"
        "pipe.close()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) > 0  # the files were written by writer processes
    assert len(ran.read_text().split()) == 1
    assert (tmp_path / "out" / "summary.json").exists()


def test_every_warning_about_a_slide_is_in_its_summary(pipe, tmp_path):
    """The resolution mismatch, on stderr before, is in summary.json's warnings; on every run of
    the same file (a warnings filter shows a repeated message once), and in the written summary."""
    path = tmp_path / "coarse.tiff"
    write_synthetic_slide(path, 600, 600, seed=3, kind="pathology", mpp=0.499)
    for run in range(2):
        with pytest.warns(UserWarning, match="coarser than the model's"):
            result = pipe.run(path, out_dir=tmp_path / f"out{run}")
        (said,) = [w for w in result.summary["warnings"] if "coarser" in w]
        assert said == f"{path}: level 0 is 0.499 um/px, coarser than the model's 0.25 um/px; reading level 0 as it is"
        written = json.loads((tmp_path / f"out{run}" / "summary.json").read_text())
        assert said in written["warnings"]
    for _ in range(2):
        unknown, no_tissue = pipe.run(np.full((300, 300, 3), 200, np.uint8)).summary["warnings"]
        assert unknown == "<array>: resolution unknown; the model expects 0.25 um/px, reading level 0"
        assert no_tissue.startswith("<array>: no tile selected")


@pytest.mark.parametrize(("tiles", "expected"), [(1, [1]), (9, [5, 4]), (16, [8, 8]), (25, [7, 6, 6, 6])])
def test_a_frame_s_tiles_are_shared_evenly_by_the_cpu_sessions(tiles, expected):
    assert even_batches(tiles, 8, 2) == expected
    assert fixed_batches(tiles, 8) == [8] * (tiles // 8) + ([tiles % 8] if tiles % 8 else [])


def test_an_array_run_on_the_cpu_gives_each_session_an_even_batch(monkeypatch):
    """A 1,024 px frame is 9 tiles: by default a batch of 5 and one of 4, each on a session; a batch
    size given is kept (8 and 1)."""
    image = _industrial_image(3, 1024)[0]
    seen: list[int] = []
    infer = Executor.infer_tiles
    monkeypatch.setattr(Executor, "infer_tiles", lambda self, batch: seen.append(len(batch)) or infer(self, batch))
    sizes = {}
    for name, overrides in (("default", {}), ("batch 8", {"batch_size": 8})):
        with Pipeline.from_card(INDUSTRIAL, backend="ort", **overrides) as p:
            seen.clear()
            p.run(image)
            sizes[name] = sorted(seen)
    assert sizes == {"default": [4, 5], "batch 8": [1, 8]}
