import os

import cv2
import numpy as np
import pytest
import tifffile


def smooth_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth random RGB image (compresses like a real scan, not like noise)."""
    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, h // 32), max(2, w // 32), 3)) * 255).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    noise = rng.integers(-6, 7, (h, w, 3))
    return np.clip(img.astype(int) + noise, 0, 255).astype(np.uint8)


def write_pyramid_tiff(
    path, image: np.ndarray, levels: int = 3, tile: int = 256, photometric: str = "ycbcr",
    mpp: float | None = 0.25, subifds: bool = False, compression: str = "jpeg",
) -> None:
    """A pyramidal tiled TIFF: levels as successive pages, or as SubIFDs (OME)."""
    pyramid = [image]
    for _ in range(levels - 1):
        p = pyramid[-1]
        pyramid.append(cv2.resize(p, (p.shape[1] // 2, p.shape[0] // 2), interpolation=cv2.INTER_AREA))
    kw = dict(tile=(tile, tile), compression=compression, photometric=photometric)
    if compression == "jpeg":
        kw["compressionargs"] = {"level": 90}
    res = dict(resolution=(1e4 / mpp, 1e4 / mpp), resolutionunit="CENTIMETER") if mpp else {}
    with tifffile.TiffWriter(path, bigtiff=subifds, ome=subifds) as tw:
        if subifds:
            meta = {"PhysicalSizeX": mpp, "PhysicalSizeY": mpp} if mpp else {}
            tw.write(pyramid[0], subifds=levels - 1, metadata=meta, **res, **kw)
            for p in pyramid[1:]:
                tw.write(p, subfiletype=1, **kw)
        else:
            tw.write(pyramid[0], **res, **kw)
            for p in pyramid[1:]:
                tw.write(p, subfiletype=1, **kw)


@pytest.fixture(scope="session")
def pyramid_tiff(tmp_path_factory):
    """A 4100 x 3000 three-level JPEG-tiled TIFF at 0.25 um/px, and its level-0 pixels."""
    path = os.path.join(tmp_path_factory.mktemp("slides"), "pyramid.tif")
    image = smooth_rgb(3000, 4100, seed=1)
    write_pyramid_tiff(path, image)
    return path


def corrupt_stored_tile(path, index: int | None = None, page: int = 0) -> int:
    """Overwrite one stored tile of a TIFF page (default: the middle one) with a broken JPEG."""
    with tifffile.TiffFile(path) as tif:
        p = tif.pages[page]
        i = len(p.dataoffsets) // 2 if index is None else index
        off, n = p.dataoffsets[i], p.databytecounts[i]
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\xff\xd8" + b"\x00" * (n - 2))
    return i
