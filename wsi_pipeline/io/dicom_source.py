"""The slide's level-0 image that the DICOM objects of :mod:`.dicom` reference as their source.

For a DICOM slide (a VL Whole Slide Microscopy series) that is the real
instance (:func:`dicom_source_image`): its patient, study, specimen and frame
of reference are copied and its series and instance UIDs referenced. For any
other slide a placeholder source description is made
(:func:`placeholder_source_image`), with UIDs derived from the slide file's
identity (:func:`placeholder_uids`) and empty :data:`PLACEHOLDER_ATTRIBUTES`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import highdicom as hd
import pydicom
from pydicom.dataset import Dataset
from pydicom.uid import VLWholeSlideMicroscopyImageStorage, generate_uid

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.special_files import open_regular

# Attributes a placeholder source leaves empty: fill them before storing the outputs in a PACS.
PLACEHOLDER_ATTRIBUTES = (
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "AccessionNumber",
    "StudyID",
    "StudyDate",
    "StudyTime",
    "ReferringPhysicianName",
)


def _read_header(path: Path) -> Dataset | None:
    """The header of a DICOM file without its pixels, or None when ``path`` is not DICOM;
    :class:`SpecialFileError` naming a FIFO, socket or device (never opened: it could block)."""
    try:
        with open_regular(path) as f:
            return pydicom.dcmread(f, stop_before_pixels=True)
    except (pydicom.errors.InvalidDicomError, OSError, ValueError):
        return None


def dicom_source_image(slide_path: str | os.PathLike[str]) -> Dataset | None:
    """The level-0 image header of the DICOM WSI series ``slide_path`` belongs to, or None if it is not DICOM.

    ``slide_path`` is one file of the series (as a batch names a DICOM slide)
    or the folder holding it; every ``*.dcm`` file beside it with the same
    SeriesInstanceUID is a level, and level 0 is the VOLUME image with the
    largest total pixel matrix.
    """
    p = Path(slide_path)
    candidates = sorted(p.glob("*.dcm")) if p.is_dir() else [p]
    first = next(
        (
            ds
            for ds in map(_read_header, candidates)
            if ds is not None and ds.get("SOPClassUID") == VLWholeSlideMicroscopyImageStorage
        ),
        None,
    )
    if first is None:
        return None
    folder = p if p.is_dir() else p.parent
    best = first
    for f in sorted(folder.glob("*.dcm")):
        ds = _read_header(f)
        if ds is None or ds.get("SeriesInstanceUID") != first.SeriesInstanceUID:
            continue
        image_type = list(ds.get("ImageType", []))
        if len(image_type) > 2 and image_type[2] != "VOLUME":
            continue
        size = int(ds.get("TotalPixelMatrixColumns", 0)) * int(ds.get("TotalPixelMatrixRows", 0))
        if size > int(best.get("TotalPixelMatrixColumns", 0)) * int(best.get("TotalPixelMatrixRows", 0)):
            best = ds
    return best


def placeholder_uids(
    slide_path: str | os.PathLike[str] | None, dimensions: tuple[int, int], mpp: tuple[float, float] | None
) -> dict[str, str]:
    """The UIDs of a slide's placeholder source: ``study``, ``series``, ``frame_of_reference``,
    ``instance`` and ``specimen``, the same for every call about the same slide.

    They are derived (:func:`pydicom.uid.generate_uid` of fixed entropy) from the slide file's
    identity (size and content fingerprint, as a batch's resume compares) with its level-0 size
    and resolution, or from its path where the file cannot be read. So the annotations and each
    heatmap file, written by different processes, reference one study, series and frame of
    reference, and a rerun of the slide joins that study.
    """
    from ..file_identity import input_identity  # the fingerprint a batch keeps of a slide

    identity = input_identity(slide_path) if slide_path is not None and Path(slide_path).exists() else None
    key = json.dumps(
        {
            "slide": identity or (os.path.abspath(slide_path) if slide_path is not None else None),
            "dimensions": [int(v) for v in dimensions],
            "mpp": [float(v) for v in mpp] if mpp is not None else None,
        },
        sort_keys=True,
    )
    roles = ("study", "series", "frame_of_reference", "instance", "specimen")
    return {role: generate_uid(entropy_srcs=["wsi-pipeline placeholder source", key, role]) for role in roles}


def placeholder_source_image(
    slide_path: str | os.PathLike[str] | None,
    dimensions: tuple[int, int],
    mpp: tuple[float, float] | None,
    tile: int = 256,
) -> Dataset:
    """A VL Whole Slide Microscopy image header standing for a slide that is not DICOM.

    It has level 0's size (``dimensions``: width, height in pixels), its pixel
    spacing (``mpp``: x, y µm per pixel; 1 µm when unknown), the usual slide
    orientation (rows along -X, columns along -Y) with the origin placed so
    that the image lies at positive slide coordinates, the slide's :func:`placeholder_uids`, the
    slide's file name as container and specimen identifier, and empty
    :data:`PLACEHOLDER_ATTRIBUTES`. No file is written for it.
    """
    width, height = (int(v) for v in dimensions)
    uids = placeholder_uids(slide_path, dimensions, mpp)
    mpp_x, mpp_y = mpp if mpp is not None else (1.0, 1.0)
    name = (Path(slide_path).name.split(".")[0] if slide_path is not None else "") or "slide"
    ds = Dataset()
    ds.SOPClassUID = VLWholeSlideMicroscopyImageStorage
    ds.SOPInstanceUID = uids["instance"]
    ds.StudyInstanceUID = uids["study"]
    ds.SeriesInstanceUID = uids["series"]
    ds.FrameOfReferenceUID = uids["frame_of_reference"]
    ds.PositionReferenceIndicator = "SLIDE_CORNER"
    ds.Modality = "SM"
    for keyword in PLACEHOLDER_ATTRIBUTES:
        setattr(ds, keyword, "")
    ds.ContainerIdentifier = name[:16]
    ds.IssuerOfTheContainerIdentifierSequence = []
    ds.ContainerTypeCodeSequence = []
    ds.SpecimenDescriptionSequence = [hd.SpecimenDescription(specimen_id=name[:64], specimen_uid=uids["specimen"])]
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    ds.SamplesPerPixel = 3
    ds.PhotometricInterpretation = "RGB"
    ds.BitsAllocated = ds.BitsStored = 8
    ds.HighBit = 7
    ds.PixelRepresentation = 0
    ds.Rows = ds.Columns = int(tile)
    ds.NumberOfFrames = math.ceil(width / tile) * math.ceil(height / tile)
    ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = width, height
    ds.TotalPixelMatrixFocalPlanes = 1
    ds.DimensionOrganizationType = "TILED_FULL"
    ds.ImageOrientationSlide = [0.0, -1.0, 0.0, -1.0, 0.0, 0.0]
    origin = Dataset()
    # Rows run along -X and columns along -Y (the usual orientation): the origin at the far corner
    # puts the whole image at positive slide coordinates (mm).
    origin.XOffsetInSlideCoordinateSystem = round(height * mpp_y / 1000.0, 6)
    origin.YOffsetInSlideCoordinateSystem = round(width * mpp_x / 1000.0, 6)
    ds.TotalPixelMatrixOriginSequence = [origin]
    measures = Dataset()
    measures.PixelSpacing = [mpp_y / 1000.0, mpp_x / 1000.0]  # mm: row spacing, column spacing
    measures.SliceThickness = 0.0
    shared = Dataset()
    shared.PixelMeasuresSequence = [measures]
    ds.SharedFunctionalGroupsSequence = [shared]
    return ds


def source_image(
    slide_path: str | os.PathLike[str] | None, dimensions: tuple[int, int], mpp: tuple[float, float] | None
) -> tuple[Dataset, bool]:
    """The slide's level-0 source image header and whether it is a placeholder.

    A DICOM slide must have the level-0 size the pipeline read (``dimensions``).
    """
    ds = dicom_source_image(slide_path) if slide_path is not None and Path(slide_path).exists() else None
    if ds is None:
        return placeholder_source_image(slide_path, dimensions, mpp), True
    found = (int(ds.get("TotalPixelMatrixColumns", 0)), int(ds.get("TotalPixelMatrixRows", 0)))
    if found != tuple(int(v) for v in dimensions):
        raise WSIPipelineError(
            f"{slide_path}: expected a DICOM level 0 of {dimensions[0]} x {dimensions[1]} pixels, "
            f"found {found[0]} x {found[1]}"
        )
    # Attributes some scanners leave out: empty patient/study attributes, the usual orientation, origin 0, 0.
    for keyword in PLACEHOLDER_ATTRIBUTES:
        if keyword not in ds:
            setattr(ds, keyword, "")
    if "ImageOrientationSlide" not in ds:
        ds.ImageOrientationSlide = [0.0, -1.0, 0.0, -1.0, 0.0, 0.0]
    if "TotalPixelMatrixOriginSequence" not in ds:
        origin = Dataset()
        origin.XOffsetInSlideCoordinateSystem = origin.YOffsetInSlideCoordinateSystem = 0.0
        ds.TotalPixelMatrixOriginSequence = [origin]
    return ds, False
