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
