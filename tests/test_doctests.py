"""Every docstring example in the package runs and gives what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import wsi_pipeline

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(wsi_pipeline.__path__, "wsi_pipeline.") if not m.name.endswith("__main__")
)


def _has_examples(name: str) -> bool:
    try:
        module = importlib.import_module(name)
    except ImportError:  # an optional backend (TensorRT) that is not installed here
        return False
    return bool(doctest.DocTestFinder().find(module)) and any(t.examples for t in doctest.DocTestFinder().find(module))


@pytest.mark.parametrize("name", [m for m in MODULES if _has_examples(m)])
def test_docstring_examples(name, monkeypatch):
    monkeypatch.chdir(wsi_pipeline.__path__[0] + "/..")  # examples name engines/... relative to the repository
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
