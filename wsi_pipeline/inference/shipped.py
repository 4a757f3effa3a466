"""The models shipped with wsi-pipeline, and where they are found.

The shipped models (``NAME.onnx`` and ``NAME.card.json``) live in the
source tree's top-level ``engines/`` folder; a wheel carries the same files
as ``wsi_pipeline/engines/``. The folder used is the first of:

1. ``$WSI_PIPELINE_ENGINES``, when set (a folder of cards and models);
2. ``engines/`` of the source checkout this package is imported from (a run
   from the repository or an editable install);
3. ``wsi_pipeline/engines/`` inside the installed package (``pip install .``).

A shipped model is also named by its ``NAME`` alone wherever a card is asked
for (``--model defects_industrial``, ``Pipeline.from_card("defects_industrial")``):
:func:`resolve_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINES_ENV = "WSI_PIPELINE_ENGINES"
DEFAULT_MODEL_NAME = "nuclei_pathology"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_CHECKOUT_ROOT = _PACKAGE_DIR.parent


def engines_candidates() -> list[Path]:
    """The folders looked in for shipped models, in lookup order."""
    found = []
    if os.environ.get(ENGINES_ENV):
        found.append(Path(os.environ[ENGINES_ENV]).expanduser())
    # A source checkout: the package sits beside setup.cfg and engines/.
    if (_CHECKOUT_ROOT / "setup.cfg").is_file():
        found.append(_CHECKOUT_ROOT / "engines")
    found.append(_PACKAGE_DIR / "engines")
    return found


def engines_dir() -> Path:
    """The folder of the shipped models: ``$WSI_PIPELINE_ENGINES`` when set, else the first that exists."""
    candidates = engines_candidates()
    if os.environ.get(ENGINES_ENV):
        return candidates[0]
    return next((p for p in candidates if p.is_dir()), candidates[-1])


def shipped_card(name: str = DEFAULT_MODEL_NAME) -> Path:
    """The card of the shipped model ``name`` (``nuclei_pathology``, ``defects_industrial``, ...)."""
    return engines_dir() / f"{name}.card.json"


CARD_SUFFIX = ".card.json"


def shipped_names() -> list[str]:
    """The shipped models' names (``NAME`` of each ``NAME.card.json`` in :func:`engines_dir`), sorted."""
    folder = engines_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(CARD_SUFFIX)] for p in folder.glob(f"*{CARD_SUFFIX}"))


def is_shipped_name(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` is a bare name (no folder) of a shipped model."""
    p = Path(model)
    return len(p.parts) == 1 and p.name in shipped_names()


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """``model``, a card or model path, as a path: itself where that exists or it names a folder;
    the card of the shipped model of that name otherwise (``defects_industrial``)."""
    p = Path(model)
    if not p.exists() and is_shipped_name(p):
        return shipped_card(p.name)
    return p
