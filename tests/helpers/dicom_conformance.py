"""DICOM files checked against the standard: by pydicom with highdicom's tables of the standard
(always), and by dicom3tools' ``dciodvfy`` where it is installed (Debian's ``dicom3tools``)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pydicom
from highdicom._standard_utils import get_iod_module_map, get_module_attribute_map, get_sop_class_iod_map
from pydicom.dataset import Dataset

DCIODVFY = shutil.which("dciodvfy")
# dciodvfy (dicom3tools 2022) reports Common Z Coordinate Value as "Only valid for AnnotationCoordinateType
# of 3D" in 2D annotation groups that do not hold it; the attribute is absent there, as PS3.3 C.37.1.2
# wants (docs/outputs_heatmap_dicom.md).
_VALIDATOR_FALSE_ERRORS = ("CommonZCoordinateValue(006a,0010)> - Only valid for AnnotationCoordinateType of 3D",)


def _items(ds: Dataset, path: list[str]) -> Iterator[Dataset]:
    """The datasets at ``path`` (sequence keywords) below ``ds``: every item of each sequence on the way."""
    if not path:
        yield ds
        return
    for item in ds.get(path[0]) or []:
        yield from _items(item, path[1:])


def standard_problems(path) -> list[str]:
    """What the file lacks by the standard's tables (through highdicom): Type 1 attributes of its
    IOD's mandatory modules absent or empty, Type 2 absent (where their sequence is present; not in
    functional groups), and
    private coding schemes ("99...") used without a Coding Scheme Identification item."""
    ds = pydicom.dcmread(path)
    iod = get_sop_class_iod_map()[ds.SOPClassUID]
    attributes = get_module_attribute_map()
    problems = []
    for module in get_iod_module_map()[iod]:
        if module["usage"] != "M":
            continue
        for attr in attributes[module["key"]]:
            if attr["path"][:1] in (["SharedFunctionalGroupsSequence"], ["PerFrameFunctionalGroupsSequence"]):
                continue  # the functional group macros each IOD takes are conditional: not in these tables
            for parent in _items(ds, attr["path"]):
                where = "/".join([*attr["path"], attr["keyword"]])
                if attr["type"] in ("1", "2") and attr["keyword"] not in parent:
                    problems.append(f"{where}: Type {attr['type']} attribute absent")
                elif attr["type"] == "1" and parent[attr["keyword"]].is_empty:
                    problems.append(f"{where}: Type 1 attribute empty")
    declared = {item.CodingSchemeDesignator for item in ds.get("CodingSchemeIdentificationSequence", [])}
    used = set()

    def collect(_ds: Dataset, elem) -> None:
        if elem.keyword == "CodingSchemeDesignator":
            used.add(str(elem.value))

    ds.walk(collect)
    problems += [f"coding scheme {s} used, not declared" for s in sorted(used - declared) if s.startswith("99")]
    return problems


def dciodvfy_errors(path) -> list[str]:
    """The errors ``dciodvfy`` reports for the file (less :data:`_VALIDATOR_FALSE_ERRORS`)."""
    run = subprocess.run([DCIODVFY, "-new", str(path)], capture_output=True, text=True, check=False)
    errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("Error")]
    groups = pydicom.dcmread(path, stop_before_pixels=True).get("AnnotationGroupSequence") or []
    if any("CommonZCoordinateValue" in g for g in groups):
        return errors
    return [line for line in errors if not line.endswith(_VALIDATOR_FALSE_ERRORS)]
