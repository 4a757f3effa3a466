"""Every docstring example in the package runs and gives what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import wsi_pipeline
from wsi_pipeline.errors import BackendUnavailableError

# A subpackage of an optional backend that cannot be imported here (no torch) is left out with its
# modules: walk_packages imports each package to list it, and calls onerror where that fails.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(wsi_pipeline.__path__, "wsi_pipeline.", onerror=lambda name: None)
    if not m.name.endswith("__main__")
)


def _has_examples(name: str) -> bool:
    try:
        module = importlib.import_module(name)
    except (ImportError, BackendUnavailableError):  # an optional backend (torch, TensorRT) not installed here
        return False
    return bool(doctest.DocTestFinder().find(module)) and any(t.examples for t in doctest.DocTestFinder().find(module))


@pytest.mark.parametrize("name", [m for m in MODULES if _has_examples(m)])
def test_docstring_examples(name, monkeypatch):
    monkeypatch.chdir(wsi_pipeline.__path__[0] + "/..")  # examples name engines/... relative to the repository
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_examples_are_collected_where_torch_is_not_installed():
    """A core install (no 'gpu' extra): the modules that need torch are left out, not an error."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # an import of torch raises ImportError, as where it is not installed\n"
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', sys.argv[1]]))\n"
    )
    root = os.path.dirname(wsi_pipeline.__path__[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code, __file__], capture_output=True, text=True, timeout=120, cwd=root, env=env
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "test_docstring_examples" in out.stdout
