import os

import pytest
from helpers import smooth_rgb, write_pyramid_tiff


@pytest.fixture(scope="session")
def pyramid_tiff(tmp_path_factory):
    """A 4100 x 3000 three-level JPEG-tiled TIFF at 0.25 um/px, and its level-0 pixels."""
    path = os.path.join(tmp_path_factory.mktemp("slides"), "pyramid.tif")
    image = smooth_rgb(3000, 4100, seed=1)
    write_pyramid_tiff(path, image)
    return path


@pytest.fixture(scope="session")
def storage_kinds(tmp_path_factory):
    """A 2600 x 2100 synthetic slide (0.25 um/px, ``"synth"``) and its pixels in every storage kind
    of :mod:`wsi_pipeline.synthetic.storage`: {kind: path}."""
    from wsi_pipeline.slide import open_slide
    from wsi_pipeline.synthetic import write_synthetic_slide
    from wsi_pipeline.synthetic.storage import STORAGE_KINDS, write_storage

    folder = tmp_path_factory.mktemp("kinds")
    synth = folder / "synth.tiff"
    write_synthetic_slide(synth, 2600, 2100, seed=3)
    paths = {"synth": str(synth)}
    with open_slide(synth) as src:
        for kind in STORAGE_KINDS:
            paths[kind] = write_storage(src, folder / f"{kind}.{'svs' if kind.startswith('svs') else 'tiff'}", kind)[
                "path"
            ]
    return paths


@pytest.fixture(scope="session")
def small_slide(tmp_path_factory):
    """A 300 x 300 synthetic pathology slide (a tiled TIFF): a slide that runs in seconds."""
    from wsi_pipeline.synthetic import write_synthetic_slide

    path = tmp_path_factory.mktemp("small") / "s.tiff"
    write_synthetic_slide(path, 300, 300, seed=1, kind="pathology")
    return path
