"""Plain images (PNG, JPEG, BMP, untiled TIFF) and in-memory arrays as one-level slides.

This is the QC-station reader: a camera frame or a file that fits in
memory, held decoded as a single level.
"""

from __future__ import annotations

import os

import cv2
import numpy as np

from ..errors import SlideError
from .base import Slide, checked_mpp, paste_into_background
from .resolution import tiff_page_mpp

# The whole image is decoded into memory; refuse headers that claim more
# than this instead of letting the decoder try to allocate it.
MAX_IMAGE_PIXELS = 1_500_000_000

PLAIN_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def _header_size(path: str) -> tuple[int, int] | None:
    """(width, height) from the file header without decoding pixels, if known."""
    try:
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None
        with Image.open(path) as im:
            return im.size
    except Exception:
        return None


def _to_rgb(arr: np.ndarray, path: str) -> np.ndarray:
    if arr.dtype != np.uint8:
        if arr.dtype == np.uint16:
            arr = (arr >> 8).astype(np.uint8)
        else:
            raise SlideError(path, f"expected 8-bit pixels, found {arr.dtype}")
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    elif arr.ndim == 3 and arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    elif arr.ndim == 3 and arr.shape[2] == 4:
        a = arr[..., 3:4].astype(np.float32) / 255.0
        arr = (arr[..., :3] * a + 255.0 * (1 - a) + 0.5).astype(np.uint8)
    elif not (arr.ndim == 3 and arr.shape[2] == 3):
        raise SlideError(path, f"expected a 2-D grey or RGB(A) image, found shape {arr.shape}")
    return np.ascontiguousarray(arr)


class ImageSlide(Slide):
    """A single-level slide held in memory."""

    backend = "image"

    def __init__(self, path: str | os.PathLike[str], mpp: tuple[float, float] | None = None):
        super().__init__(path)
        size = _header_size(self.path)
        if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
            raise SlideError(
                self.path,
                f"image claims {size[0]}x{size[1]} pixels, more than the {MAX_IMAGE_PIXELS:,} "
                "a plain image may have (it is decoded whole); store it as a tiled TIFF",
            )
        ext = os.path.splitext(self.path)[1].lower()
        file_mpp = None
        if ext in (".tif", ".tiff"):
            import tifffile

            try:
                with tifffile.TiffFile(self.path) as tif:
                    page = tif.pages[0]
                    if page.shape and np.prod(page.shape[:2]) > MAX_IMAGE_PIXELS:
                        raise SlideError(self.path, f"image claims shape {page.shape}, too large to decode whole")
                    arr = page.asarray()
                    file_mpp = tiff_page_mpp(page)
            except SlideError:
                raise
            except Exception as exc:
                raise SlideError(self.path, f"cannot decode TIFF image: {exc}") from exc
            arr = _to_rgb(arr, self.path)
        else:
            buf = np.fromfile(self.path, np.uint8)
            arr = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
            if arr is None:
                raise SlideError(self.path, "not a decodable image (PNG, JPEG, BMP, WebP or TIFF expected)")
            if arr.ndim == 3:
                code = cv2.COLOR_BGRA2RGBA if arr.shape[2] == 4 else cv2.COLOR_BGR2RGB
                arr = cv2.cvtColor(arr, code)
            arr = _to_rgb(arr, self.path)
        self._init_array(arr, mpp if mpp is not None else file_mpp, vendor=ext.lstrip(".") or "image")

    def _init_array(self, arr: np.ndarray, mpp, vendor: str) -> None:
        self._arr = arr
        h, w = arr.shape[:2]
        self._level_dimensions = [(w, h)]
        self._level_downsamples = [1.0]
        self._mpp = checked_mpp(self.path, *mpp) if mpp is not None else None
        self._vendor = vendor

    @classmethod
    def from_array(
        cls, image: np.ndarray, mpp: tuple[float, float] | None = None, name: str = "<array>"
    ) -> ImageSlide:
        """Wrap an ``HxWx3`` (or HxW grey) uint8 array as a one-level slide (no copy if RGB)."""
        self = cls.__new__(cls)
        Slide.__init__(self, name)
        self._init_array(_to_rgb(np.asarray(image), name), mpp, vendor="array")
        return self

    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        ih, iw = self._arr.shape[:2]
        if x0_level0 >= 0 and y0_level0 >= 0 and x0_level0 + w <= iw and y0_level0 + h <= ih:
            return self._arr[y0_level0:y0_level0 + h, x0_level0:x0_level0 + w].copy()
        out = paste_into_background(h, w, self.background_rgb)
        sx0, sy0 = max(x0_level0, 0), max(y0_level0, 0)
        sx1, sy1 = min(x0_level0 + w, iw), min(y0_level0 + h, ih)
        if sx0 < sx1 and sy0 < sy1:
            out[sy0 - y0_level0:sy1 - y0_level0, sx0 - x0_level0:sx1 - x0_level0] = self._arr[sy0:sy1, sx0:sx1]
        return out

    def close(self) -> None:
        self._arr = None
        super().close()

