"""Each list of names has one owner that the settings import, and no module imports from above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import wsi_pipeline
from wsi_pipeline import config
from wsi_pipeline.inference import backend, card_spec
from wsi_pipeline.slide import damage

PACKAGE = Path(wsi_pipeline.__path__[0])


def _imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names taken) for each ``from ... import`` in ``path``, wherever it stands."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: -node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_the_settings_take_each_list_of_names_from_its_owner():
    limits = (card_spec.MAX_TILE, card_spec.MIN_MPP, card_spec.MAX_MPP)
    assert (config.MAX_TILE, config.MIN_MPP, config.MAX_MPP) == limits
    assert config.DAMAGED_TILE_CHOICES is damage.DAMAGED_TILE_CHOICES
    assert config.BACKEND_CHOICES == ("auto", *backend.BACKENDS)


@pytest.mark.parametrize(
    "owner", ["inference/card.py", "inference/card_spec.py", "inference/backend.py", "slide/damage.py"]
)
def test_an_owner_of_names_does_not_import_the_settings(owner):
    assert not [m for m, _ in _imported_modules(PACKAGE / owner) if m == "wsi_pipeline.config"]


def test_no_module_takes_names_from_the_package_face():
    """``wsi_pipeline/__init__.py`` imports the slide readers: a module below them importing it goes up."""
    taken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, names in _imported_modules(path):
            if module == "wsi_pipeline":
                not_submodules = [n for n in names if not (PACKAGE / f"{n}.py").exists() and not (PACKAGE / n).is_dir()]
                taken.extend(f"{path.relative_to(PACKAGE)}: {n}" for n in not_submodules)
    assert taken == []


@pytest.mark.parametrize("folder", ["io", "slide", "inference", "tiling", "stitch", "boxes"])
def test_the_stages_do_not_import_the_batch_layer_above_them(folder):
    taken = [
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for module, _ in _imported_modules(path)
        if module == "wsi_pipeline.batch" or module.startswith("wsi_pipeline.batch.")
    ]
    assert taken == []
