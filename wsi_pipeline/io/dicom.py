"""Detections and heatmaps as DICOM objects (through highdicom), for PACS and DICOMweb viewers.

- :func:`write_dicom_annotations`: the detections as one **Microscopy Bulk
  Simple Annotations** instance (SOP class 1.2.840.10008.5.1.4.1.1.91.1):
  one annotation group per class found, each box a ``POLYGON`` of its four
  corners in the 2D image coordinates of the slide's level 0 (column, row in
  level-0 pixels, (0, 0) the top-left corner of the top-left pixel, so a
  detection box ``x0, y0, x1, y1`` is stored as it is), the score as a
  measurement (SCT 246262008 "Score", unit UCUM "1").
- :func:`write_dicom_parametric_map`: the heatmap as **Parametric Map**
  instances (SOP class 1.2.840.10008.5.1.4.1.1.30), one per class in one
  series (a folder of files: one instance holding every class would have
  frames that its dimension index cannot tell apart), each tiled
  (``TILED_SPARSE`` by default, one frame per tile with its position),
  uint16 stored values with the real-world value mapping
  ``value = stored / 65535``, pixel spacing ``mpp x heatmap scale`` and
  its position in the slide's frame of reference; frames are stored
  uncompressed (Explicit VR Little Endian: :data:`PARAMETRIC_MAP_TRANSFER_SYNTAX`
  says why).

Source: both objects reference the slide's level-0 image. For a DICOM slide
(a VL Whole Slide Microscopy series) that is the real instance: its patient,
study, specimen and frame of reference are copied and its series and instance
UIDs referenced. For any other slide a placeholder source description is made
(:func:`~.dicom_source.placeholder_source_image`): Study, Series, Frame of Reference and
SOP Instance UIDs derived from the slide file's identity (its size and a
fingerprint of its content, :func:`~.dicom_source.placeholder_uids`), so that every DICOM
object made for one slide, by any process or run, lands in one study and
one frame of reference; empty patient and study attributes, the slide's file
name as container and specimen identifier. The references then point at an
instance that exists nowhere; users who store the outputs in a PACS fill in
the patient and study attributes first (docs/outputs_heatmap_dicom.md lists them).

A Microscopy Bulk Simple Annotations instance holds at least one annotation
group of at least one annotation (PS3.3 C.37.1.2: the group sequence and the
point data are Type 1), so a slide without detections has no annotation file
(:class:`NoAnnotationsError`; the pipeline leaves the file out and says so in
``summary.json``).

Writes are atomic: the file appears complete under its name or not at all.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
from highdicom.coding_schemes import CodingSchemeIdentificationItem
from pydicom.dataset import Dataset
from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code
from pydicom.uid import ExplicitVRLittleEndian

from wsi_pipeline._version import __version__
from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.io.atomic import atomic_write, partial_name, replace_tree
from wsi_pipeline.io.detections import detection_class, parse_color
from wsi_pipeline.io.dicom_source import source_image
from wsi_pipeline.io.heatmap_rows import quantise
from wsi_pipeline.io.ome_tiff import HeatmapFile
from wsi_pipeline.io.spool import spool_array

MANUFACTURER = "wsi-pipeline"
# Stored bytes (H x W x 2, uint16) of one class's Parametric Map: highdicom keeps every encoded
# frame of the instance in memory until the file is written (up to twice the compressed
# size, and a heatmap that does not compress is its raw size), so the size is capped; write
# a reduced level (``level=1`` has a quarter of the pixels) above it.
MAX_PARAMETRIC_MAP_BYTES = 1024**3
# Uncompressed (lossless, as every compression the standard allows for integers would be), because
# it is what every reader of Parametric Maps decodes: Bio-Formats 7.3 (QuPath's and Fiji's reader)
# fails on JPEG-LS frames (ArrayIndexOutOfBoundsException in DicomReader.getTile), swaps the bytes of
# 16-bit RLE Lossless samples and does not read Deflated Explicit VR Little Endian. The compact copy
# of the heatmap is the OME-TIFF it is made from.
PARAMETRIC_MAP_TRANSFER_SYNTAX = ExplicitVRLittleEndian
SCORE = codes.SCT.Score  # SCT 246262008 "Score (attribute)"
NO_UNITS = Code("1", "UCUM", "no units")
_PRIVATE_SCHEME = "99WSIPL"  # private coding scheme of the detector's class names
# Its declaration (PS3.3 C.12.1.1.3.3: a private scheme's designator is described in the
# Coding Scheme Identification Sequence of the instances that use it).
PRIVATE_SCHEME_ITEM = CodingSchemeIdentificationItem(
    designator=_PRIVATE_SCHEME,
    name="wsi-pipeline detector classes",
    responsible_organization="wsi-pipeline",
)
# Parametric Map stored values: uint16, value = stored / 65535 (an 8-bit heatmap's values map exactly: 257 x).
_STORED = np.dtype(np.uint16)
_SCALE = 1 / 65535


class NoAnnotationsError(WSIPipelineError):
    """No detections to write: a DICOM annotation object cannot be empty."""


def _equipment() -> dict[str, Any]:
    return {
        "manufacturer": MANUFACTURER,
        "manufacturer_model_name": "wsi-pipeline",
        "software_versions": __version__,
        "device_serial_number": "none",
    }


def save_dataset(ds: Dataset, target: Any) -> None:
    """``ds.save_as(target)`` (a path or a binary file), its failure raised as the error that caused
    it: pydicom wraps an error met writing an element (a full disk's ``OSError``) in one of the same
    type whose text holds the whole traceback, and without its errno."""
    try:
        ds.save_as(target, enforce_file_format=True)
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None and "Traceback (most recent call last)" in str(cause):
            cause = cause.__cause__
        if cause is exc:
            raise
        raise cause from None


def _save(path: Path, ds: Dataset) -> Path:
    with atomic_write(path, "wb") as f:
        save_dataset(ds, f)
    return path


def _class_codes(label: int, classes: Sequence[dict]) -> tuple[str, Code, Code]:
    """Name, property category and property type of a class (``"code"`` in its dict overrides the private code)."""
    cls = detection_class(classes, label)
    name = str(cls["name"])
    code = cls.get("code")
    prop_type = (
        Code(str(code["value"]), str(code["scheme"]), str(code["meaning"]))
        if code
        else Code(f"class-{label}", _PRIVATE_SCHEME, name[:64])
    )
    return name, codes.SCT.MorphologicallyAbnormalStructure, prop_type


def write_dicom_annotations(
    path: str | os.PathLike[str],
    dets: np.ndarray,
    classes: Sequence[dict],
    *,
    dimensions: tuple[int, int],
    slide_path: str | os.PathLike[str] | None = None,
    mpp: tuple[float, float] | None = None,
    series_number: int = 901,
    algorithm_name: str = "wsi-pipeline detector",
    algorithm_version: str = __version__,
) -> Path:
    """Write detections as a Microscopy Bulk Simple Annotations file, atomically; returns ``path``.

    Args:
        path: output file, conventionally ``*.dcm``.
        dets: detection array (:data:`~wsi_pipeline.io.detections.DETECTION_DTYPE`,
            boxes in level-0 pixels).
        classes: the model's classes, dicts with ``name`` and optionally
            ``color`` and ``code`` (``{"value", "scheme", "meaning"}``, a coded
            annotated property type; default a private code per class).
        dimensions: the slide's level-0 (width, height) in pixels.
        slide_path: the slide; a DICOM WSI series is referenced, anything else
            gets a placeholder source (:func:`placeholder_source_image`).
        mpp: level-0 (x, y) µm per pixel, for a placeholder source.
        series_number, algorithm_name, algorithm_version: recorded in the file.
    """
    path = Path(path)
    dets = np.asarray(dets)
    if dets.dtype.names is None or not {"x0", "y0", "x1", "y1", "score", "label"} <= set(dets.dtype.names):
        raise TypeError(f"dets: expected a detection record array, found dtype {dets.dtype}")
    if not len(dets):
        raise NoAnnotationsError(
            f"{path}: no detections to write: a DICOM Microscopy Bulk Simple Annotations object holds at "
            "least one annotation, so no file is written"
        )
    src, _ = source_image(slide_path, dimensions, mpp)
    algorithm = hd.AlgorithmIdentificationSequence(
        name=algorithm_name, family=codes.DCM.ArtificialIntelligence, version=str(algorithm_version)
    )
    groups, schemes = [], set()
    for number, label in enumerate(np.unique(dets["label"]).tolist(), start=1):
        d = dets[dets["label"] == label]
        name, category, prop_type = _class_codes(label, classes)
        schemes.add(prop_type.scheme_designator)
        color = detection_class(classes, label).get("color")
        group = hd.ann.AnnotationGroup(
            number=number,
            uid=hd.UID(),
            label=name[:64],
            annotated_property_category=category,
            annotated_property_type=prop_type,
            graphic_type=hd.ann.GraphicTypeValues.POLYGON,
            graphic_data=[_box_corners(d[:1])[0]],  # the group's form; its data are set whole below
            algorithm_type=hd.ann.AnnotationGroupGenerationTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
            display_color=hd.color.CIELabColor.from_rgb(*parse_color(color)) if color is not None else None,
        )
        _set_boxes(group, d)
        groups.append(group)
    ann = hd.ann.MicroscopyBulkSimpleAnnotations(
        source_images=[src],
        annotation_coordinate_type=hd.ann.AnnotationCoordinateTypeValues.SCOORD,
        annotation_groups=groups,
        series_instance_uid=hd.UID(),
        series_number=series_number,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        content_label="DETECTIONS",
        content_description="Detections of the wsi-pipeline detector, level-0 pixel boxes",
        coding_schemes=[PRIVATE_SCHEME_ITEM] if _PRIVATE_SCHEME in schemes else None,
        **_equipment(),
    )
    return _save(path, ann)


def _box_corners(d: np.ndarray) -> np.ndarray:
    """N x 4 x (column, row) float32 corners of detection boxes, clockwise from the top-left."""
    x0, y0, x1, y1 = (d[k].astype(np.float32) for k in ("x0", "y0", "x1", "y1"))
    return np.stack([x0, y0, x1, y0, x1, y1, x0, y1], axis=1).reshape(-1, 4, 2)


def _set_boxes(group: Any, d: np.ndarray) -> None:
    """Give an annotation group the polygons and scores of ``d`` as the arrays DICOM stores them.

    What highdicom's ``AnnotationGroup`` makes from a list of one array per annotation, made from
    whole arrays instead: memory of a few copies of the coordinates, not of a Python object per box.
    """
    corners = _box_corners(d)
    if not np.isfinite(corners).all():
        raise ValueError("detection boxes for a DICOM annotation group: expected finite coordinates")
    closed = np.flatnonzero((corners[:, 0] == corners[:, 3]).all(axis=1))
    if closed.size:  # a polygon whose first and last points are one: DICOM forbids it, as highdicom does
        raise ValueError(
            f"annotation #{int(closed[0]) + 1}: a box of no height gives a POLYGON whose first and last "
            "coordinates are identical"
        )
    n = len(d)
    group.NumberOfAnnotations = n
    group.PointCoordinatesData = corners.tobytes()
    # 1-based index of each polygon's first value: 4 points of 2 values each.
    group.LongPrimitivePointIndexList = (np.arange(n, dtype=np.int32) * 8 + 1).tobytes()
    group._graphic_data = {}  # read back from the data above, as for a group read from a file
    group.MeasurementsSequence = [hd.ann.Measurements(name=SCORE, values=d["score"].astype(np.float32), unit=NO_UNITS)]


def _spool_class(heatmap: np.ndarray | HeatmapFile, level: int, k: int, spool: Path) -> np.ndarray:
    """Class ``k`` of the heatmap's level ``level`` as a 1 x H x W uint16 memmap (``round(value * 65535)``).

    Written band by band (a HeatmapFile's page is first decoded tile by tile
    into a file of its own): heap use is a few bands, whatever the size.
    """
    for old in spool.glob("*.npy"):
        old.unlink()
    if isinstance(heatmap, HeatmapFile):
        import tifffile

        _, h, w = heatmap.level_shapes[level]
        out = spool_array(spool / "class.npy", _STORED, (1, h, w))
        with tifffile.TiffFile(heatmap.path) as tif:
            page = tif.series[0].levels[level].pages[k]
            stored = spool_array(spool / "page.npy", page.dtype, (h, w))
            page.asarray(out=stored)
            for y in range(0, h, 256):
                out[0, y : y + 256] = quantise(stored[y : y + 256] * np.float32(heatmap.value_scale), _STORED, _SCALE)
        return out
    _, h, w = heatmap.shape
    out = spool_array(spool / "class.npy", _STORED, (1, h, w))
    for y in range(0, h, 256):
        out[0, y : y + 256] = quantise(heatmap[k, y : y + 256], _STORED, _SCALE)
    return out


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:40] or "class"


def parametric_map_file_names(channel_names: Sequence[str]) -> list[str]:
    """The file names of the classes' Parametric Maps in the output folder, in class order."""
    return [f"heatmap_{k:02d}_{_slug(str(n))}.dcm" for k, n in enumerate(channel_names)]


def _checked_arguments(
    path: Path,
    heatmap: np.ndarray | HeatmapFile,
    channel_names: Sequence[str] | None,
    level: int,
    max_bytes: int,
    dimension_organization: str,
) -> tuple[np.ndarray | HeatmapFile, list[str]]:
    """:func:`write_dicom_parametric_map`'s heatmap (an array, or the file) and its C class names, once
    they agree, its level ``level`` exists and fits in ``max_bytes`` a class, and the dimension
    organisation is known."""
    if isinstance(heatmap, HeatmapFile):
        if not 0 <= level < heatmap.level_count:
            raise ValueError(f"{heatmap.path}: level {level} does not exist ({heatmap.level_count} levels)")
        shape = heatmap.level_shapes[level]
        names = list(channel_names) if channel_names is not None else list(heatmap.channel_names)
    else:
        heatmap = np.asarray(heatmap)
        shape = heatmap.shape
        if len(shape) != 3:
            raise TypeError(f"heatmap: expected a C x H x W array or a HeatmapFile, found shape {shape}")
        if level:
            raise ValueError(f"{path}: level {level} asked of a numpy heatmap, which has only level 0")
        names = list(channel_names) if channel_names is not None else [f"channel_{k}" for k in range(shape[0])]
    if len(names) != shape[0]:
        raise ValueError(
            f"{path}: expected {shape[0]} channel names for a heatmap of shape {shape}, found {len(names)}"
        )
    if dimension_organization not in ("TILED_FULL", "TILED_SPARSE"):
        raise ValueError(
            f"{path}: dimension_organization expected 'TILED_FULL' or 'TILED_SPARSE', found {dimension_organization!r}"
        )
    plane_bytes = shape[1] * shape[2] * 2
    if plane_bytes > max_bytes:
        raise WSIPipelineError(
            f"{path}: a parametric map holds at most {max_bytes} bytes a class, found a "
            f"{shape[2]} x {shape[1]} heatmap ({plane_bytes} bytes); "
            f"write a reduced level (level={level + 1})"
        )
    return heatmap, names


def _plane_geometry(src: Dataset, scale: float) -> dict[str, Any]:
    """The Parametric Map's pixel spacing, orientation and position on the slide ``src`` (keywords of
    ``ParametricMap``), for heatmap pixels of ``scale`` level-0 pixels each."""
    (row_mm, col_mm) = (float(v) for v in src.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing)
    # Centre of the heatmap's top-left pixel, in level-0 pixel indices (0 = centre of level-0 pixel 0).
    offset = (scale - 1.0) / 2.0
    to_slide = hd.spatial.PixelToReferenceTransformer.for_image(src, for_total_pixel_matrix=True)
    p00, p10, p01 = to_slide(np.array([[0, 0], [1, 0], [0, 1]]))  # (column, row) indices; the map is affine
    position = p00 + offset * (p10 - p00) + offset * (p01 - p00)
    return {
        "pixel_measures": hd.PixelMeasuresSequence(pixel_spacing=(row_mm * scale, col_mm * scale), slice_thickness=1.0),
        "plane_orientation": hd.PlaneOrientationSequence(
            coordinate_system="SLIDE", image_orientation=src.ImageOrientationSlide
        ),
        "plane_positions": [
            hd.PlanePositionSequence(coordinate_system="SLIDE", image_position=position, pixel_matrix_position=(1, 1))
        ],
    }


def _probability_mapping(name: str) -> hd.pm.RealWorldValueMapping:
    """Stored values to the probability of class ``name``: ``value = stored / 65535``."""
    return hd.pm.RealWorldValueMapping(
        lut_label=name[:16],
        lut_explanation=f"probability of {name}"[:64],
        unit=NO_UNITS,
        value_range=(0, 65535),
        slope=1 / 65535,
        intercept=0,
    )


def write_dicom_parametric_map(
    path: str | os.PathLike[str],
    heatmap: np.ndarray | HeatmapFile,
    channel_names: Sequence[str] | None = None,
    *,
    scale_level0: float,
    dimensions: tuple[int, int],
    slide_path: str | os.PathLike[str] | None = None,
    mpp: tuple[float, float] | None = None,
    level: int = 0,
    tile: int = 256,
    max_bytes: int = MAX_PARAMETRIC_MAP_BYTES,
    series_number: int = 902,
    dimension_organization: str = "TILED_SPARSE",
) -> Path:
    """Write a heatmap as a series of tiled Parametric Maps, one file per class, in the folder ``path``.

    The folder is written under a temporary name and renamed when every file
    is in it; returns ``path``. The files are
    :func:`parametric_map_file_names`, one series (instance k + 1 is class k).

    Args:
        path: output folder, conventionally ``heatmap.dcm.d`` or similar.
        heatmap: C x H x W float values in [0, 1] (heatmap pixels), or a
            :class:`~wsi_pipeline.io.ome_tiff.HeatmapFile`; stored as uint16
            ``round(value * 65535)`` with the mapping ``value = stored / 65535``.
        channel_names: C class names (default: the HeatmapFile's, or ``channel_k``).
        scale_level0: level-0 pixels per heatmap pixel (of level 0 of the heatmap).
        dimensions: the slide's level-0 (width, height) in pixels.
        slide_path, mpp: as for :func:`write_dicom_annotations`.
        level: pyramid level of a HeatmapFile to write (2**level coarser).
        tile: frame side in heatmap pixels.
        max_bytes: refuse a class plane H x W x 2 (bytes, uint16) larger than
            this (see :data:`MAX_PARAMETRIC_MAP_BYTES`).
        dimension_organization: ``"TILED_SPARSE"`` (each frame with its
            position: what every reader of Parametric Maps takes, and what
            dciodvfy validates) or ``"TILED_FULL"`` (frames in row-major tile
            order without per-frame metadata: smaller, newer in the standard).
    """
    path = Path(path)
    heatmap, names = _checked_arguments(path, heatmap, channel_names, level, max_bytes, dimension_organization)
    src, _ = source_image(slide_path, dimensions, mpp)
    geometry = _plane_geometry(src, float(scale_level0) * 2**level)
    series_uid = hd.UID()
    tmp = partial_name(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for k, (name, file_name) in enumerate(zip(names, parametric_map_file_names(names), strict=True)):
            stored = _spool_class(heatmap, level, k, tmp)
            pm = hd.pm.ParametricMap(
                source_images=[src],
                pixel_array=stored,  # 1 x H x W: one total pixel matrix
                series_instance_uid=series_uid,
                series_number=series_number,
                sop_instance_uid=hd.UID(),
                instance_number=k + 1,
                contains_recognizable_visual_features=False,
                real_world_value_mappings=[_probability_mapping(name)],
                voi_lut_transformations=[hd.VOILUTTransformation(window_center=32767.5, window_width=65536.0)],
                transfer_syntax_uid=PARAMETRIC_MAP_TRANSFER_SYNTAX,
                content_label=f"HEATMAP{k}",
                content_description=f"Probability of {name}"[:64],
                tile_pixel_array=True,
                tile_size=(tile, tile),
                dimension_organization_type=dimension_organization,
                **geometry,
                **_equipment(),
            )
            save_dataset(pm, tmp / file_name)
            del pm, stored
        for spooled in tmp.glob("*.npy"):
            spooled.unlink()
        replace_tree(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_heatmap_parametric_maps(
    path: str | os.PathLike[str],
    heatmap_path: str | os.PathLike[str],
    channel_names: Sequence[str],
    *,
    scale_level0: float,
    dimensions: tuple[int, int],
    slide_path: str | os.PathLike[str] | None = None,
    mpp: tuple[float, float] | None = None,
    max_bytes: int = MAX_PARAMETRIC_MAP_BYTES,
) -> Path:
    """:func:`write_dicom_parametric_map` of the OME-TIFF heatmap file ``heatmap_path``, at its
    finest pyramid level whose class plane fits in ``max_bytes`` (a writer-pool job: plain arguments)."""
    heatmap = HeatmapFile(heatmap_path)
    level = next(
        (k for k, (_, h, w) in enumerate(heatmap.level_shapes) if h * w * 2 <= max_bytes), heatmap.level_count - 1
    )
    return write_dicom_parametric_map(
        path,
        heatmap,
        channel_names,
        scale_level0=scale_level0,
        dimensions=dimensions,
        slide_path=slide_path,
        mpp=mpp,
        level=level,
        max_bytes=max_bytes,
    )
