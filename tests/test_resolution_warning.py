"""A run at another resolution than the model card's (the config's mpp or level) says so in
summary.json ``warnings``, with both resolutions; the card's own resolution says nothing."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from wsi_pipeline import Pipeline
from wsi_pipeline.synthetic import write_synthetic_slide


@pytest.fixture(scope="module")
def slide_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("res") / "fine.tiff"
    info = write_synthetic_slide(path, 2048, 2048, seed=5, kind="pathology", mpp=0.25)
    assert len(info["level_dimensions"]) >= 2
    return path


def _warnings(slide_path, out, **settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Pipeline(backend="ort", formats="csv", writer_processes=0, **settings) as pipe:
            pipe.run(slide_path, out_dir=out)
    return json.loads((out / "summary.json").read_text())["warnings"]


@pytest.mark.parametrize(
    "settings, read_mpp, chose",
    [({"mpp": 0.5}, "0.5", "mpp = 0.5"), ({"level": 1}, "0.5", "level = 1"), ({"mpp": 1.0}, "1", "mpp = 1")],
)
def test_another_resolution_than_the_cards_warns_with_both(slide_path, tmp_path, settings, read_mpp, chose):
    said = [w for w in _warnings(slide_path, tmp_path / "out", **settings) if "was made for" in w]
    assert len(said) == 1, said
    assert re.search(
        rf"read at {read_mpp} um/px \({chose}\), but the model nuclei_pathology was made for 0.25 um/px", said[0]
    )
    assert said[0].startswith(str(slide_path))


@pytest.mark.parametrize("settings", [{}, {"mpp": 0.25}, {"level": 0}, {"mpp": 0.26}])
def test_the_cards_resolution_does_not_warn(slide_path, tmp_path, settings):
    assert not [w for w in _warnings(slide_path, tmp_path / "out", **settings) if "was made for" in w]
