"""The optional packages and the extra of ``pip install 'wsi-pipeline[EXTRA]'`` that brings each.

A command that needs one asks :func:`require` first, so that a plain install answers with one
line naming the extra (:class:`~.errors.MissingExtraError`, exit code 2) instead of a traceback;
the command line turns any other missing optional package into the same line (:func:`missing_extra`).
"""

from __future__ import annotations

import importlib.util

from .errors import MissingExtraError

# Top-level module -> the extra that installs it (setup.cfg's extras_require; tests/test_extras.py
# checks each against it). torch comes with both gpu and train: train is the one named here, as it
# is the one a command (``train``) needs; the backends name ``gpu`` themselves.
MODULE_EXTRAS = {
    "onnx": "quantize",
    "torch": "train",
    "torchvision": "train",
    "pycocotools": "train",
    "pyarrow": "parquet",
    "shapely": "geoparquet",
    "zarr": "zarr",
    "numcodecs": "zarr",
    "ome_zarr": "zarr",
    "highdicom": "dicom",
    "boto3": "remote",
    "dask": "dask",
    "distributed": "dask",
    "pandas": "notebooks",
    "matplotlib": "notebooks",
    "ipywidgets": "notebooks",
}
# Packages whose import name differs from the name pip installs.
PACKAGE_NAMES = {"ome_zarr": "ome-zarr"}


def require(what: str, *modules: str) -> None:
    """Raise :class:`~.errors.MissingExtraError` naming ``what`` (a command or function) and the
    extra to install when any of ``modules`` (keys of :data:`MODULE_EXTRAS`) is not installed."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(what, PACKAGE_NAMES.get(module, module), MODULE_EXTRAS[module])


def missing_extra(what: str, exc: ModuleNotFoundError) -> MissingExtraError | None:
    """The :class:`~.errors.MissingExtraError` of an import that failed for want of an optional
    package, or None when the module missing is none of :data:`MODULE_EXTRAS`."""
    top = (exc.name or "").split(".")[0]
    if top not in MODULE_EXTRAS:
        return None
    return MissingExtraError(what, PACKAGE_NAMES.get(top, top), MODULE_EXTRAS[top])
