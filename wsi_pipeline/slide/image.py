"""Plain images (PNG, JPEG, BMP, untiled TIFF) and in-memory arrays as one-level slides.

This is the QC-station reader: a camera frame or a file that fits in
memory. Opening reads only the file's header (size, resolution); the pixels
are decoded whole on the first read, and only if that fits
:data:`IMAGE_MEMORY_BUDGET_BYTES`. Larger images must be stored as tiled
TIFF, which is read tile by tile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator

import cv2
import numpy as np

from ..errors import SlideOpenError
from .base import Slide, checked_mpp, composite_rgba, paste_into_background
from .resolution import tiff_page_mpp

# Memory a plain image may take to decode whole: the decoder's array plus the
# RGB copy (a 16,000 x 16,000 RGB PNG needs about 1.4 GiB).
IMAGE_MEMORY_BUDGET_BYTES = 2 * 1024**3

PLAIN_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

# Deflate never compresses better than about 1032:1: a PNG whose rows would
# need more than this many times its file size cannot be genuine.
_MAX_DEFLATE_RATIO = 1032

# Rows converted to RGB at a time (bounds the temporaries of the conversion).
_CONVERT_ROWS = 256


log = logging.getLogger(__name__)

# One capture of the process's stderr at a time: each redirects file descriptor 2 and puts back
# what it found there, so two at once would put back each other's.
_STDERR_LOCK = threading.Lock()
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def _decoder_stderr() -> Iterator[list[str]]:
    """The lines C decoders (libpng, libjpeg) write to the process's stderr meanwhile, in the list
    yielded once the block ends. They print there, without the file's name, what they find wrong;
    OpenCV passes on no message of theirs, so file descriptor 2 is redirected to a temporary file
    for the call. Whatever another thread writes to stderr meanwhile lands there too: the caller
    shows or logs every line it gets, so nothing is lost."""
    lines: list[str] = []
    with _STDERR_LOCK, tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            lines.extend(line.strip() for line in text.splitlines() if line.strip())


def _png_truncation(data: np.ndarray) -> str | None:
    """Where a PNG file's chunks run past its end (None: its IEND chunk is there), walking the
    chunk headers alone; libpng would only say "PNG input buffer is incomplete"."""
    raw = data.data
    pos = len(_PNG_SIGNATURE)
    while pos + 8 <= len(raw):
        length, kind = struct.unpack(">I4s", raw[pos : pos + 8])
        end = pos + 12 + length
        if end > len(raw):
            name = kind.decode("latin-1")
            return f"the file ends inside its {name} chunk at byte {len(raw):,} ({end - len(raw):,} bytes missing)"
        if kind == b"IEND":
            return None
        pos = end
    return f"the file ends at byte {len(raw):,} before its IEND chunk"


def _jpeg_without_end(data: np.ndarray) -> bool:
    """Whether ``data`` is a JPEG stream (SOI marker first) whose last bytes, less zero padding,
    are not its EOI marker: asked of a file that did not decode (OpenCV says nothing of why)."""
    raw = data.tobytes()
    return raw[:2] == b"\xff\xd8" and not raw.rstrip(b"\x00 \r\n").endswith(b"\xff\xd9")


def _png_depth_and_colour(path: str) -> tuple[int, int] | None:
    """(bit depth, colour type) from a PNG's IHDR, or None if ``path`` is no PNG."""
    with open(path, "rb") as f:
        head = f.read(26)
    if len(head) < 26 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return head[24], head[25]


def _image_header(path: str) -> tuple[int, int, int]:
    """(width, height, bytes per pixel decoded, at most) from the header, decoding no pixels."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # the size is checked here, against the file and the memory budget
    try:
        with Image.open(path) as im:
            (width, height), bands, fmt = im.size, len(im.getbands()), im.format
    except Exception as exc:  # Pillow raises several types on a bad header
        raise SlideOpenError(path, f"not a readable image header (PNG, JPEG, BMP or WebP expected): {exc}") from exc
    if width < 1 or height < 1:
        raise SlideOpenError(path, f"image header claims {width}x{height} pixels")
    png = _png_depth_and_colour(path) if fmt == "PNG" else None
    if png is None:
        return width, height, max(bands, 3)
    depth, colour = png
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(colour, 4)
    raw = height * (1 + -(-width * channels * max(depth, 1) // 8))  # the filtered rows deflate must yield
    size = os.path.getsize(path)
    if raw > _MAX_DEFLATE_RATIO * size:
        raise SlideOpenError(
            path,
            f"image claims {width}x{height} pixels ({raw:,} bytes of PNG rows), more than a "
            f"{size:,}-byte file can hold (deflate compresses at most {_MAX_DEFLATE_RATIO}:1)",
        )
    decoded_channels = {0: 1, 2: 3}.get(colour, 4)  # as OpenCV decodes: grey, BGR, or BGRA
    return width, height, decoded_channels * (2 if depth == 16 else 1)


def _convert_rows(src: np.ndarray, out: np.ndarray, path: str) -> None:
    """Rows of a decoded image (grey, RGB or RGBA; 8 or 16 bits) into ``out`` (RGB uint8)."""
    if src.dtype == np.uint16:
        src = (src >> 8).astype(np.uint8)
    elif src.dtype != np.uint8:
        raise SlideOpenError(path, f"expected 8- or 16-bit pixels, found {src.dtype}")
    if src.ndim == 3 and src.shape[2] == 1:
        src = src[..., 0]
    if src.ndim == 2:
        out[...] = src[..., None]
    elif src.ndim == 3 and src.shape[2] == 3:
        out[...] = src
    elif src.ndim == 3 and src.shape[2] == 4:
        out[...] = composite_rgba(src, (255, 255, 255))
    else:
        raise SlideOpenError(path, f"expected a 2-D grey or RGB(A) image, found shape {src.shape}")


def _to_rgb(arr: np.ndarray, path: str) -> np.ndarray:
    """``arr`` as C-contiguous HxWx3 uint8 RGB (itself where it already is), converted a band at a time;
    :class:`SlideOpenError` where the copy does not fit in memory (a broadcast or strided view of a
    huge image)."""
    if arr.ndim not in (2, 3):
        raise SlideOpenError(path, f"expected a 2-D grey or RGB(A) image, found shape {arr.shape}")
    as_is = arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
    if as_is and arr.flags.c_contiguous:
        return arr
    h, w = arr.shape[:2]
    try:
        if h * w * 3 > _physical_memory():  # an allocation the kernel may grant, then kill the process filling it
            raise MemoryError
        out = np.empty((h, w, 3), np.uint8)
    except MemoryError:
        raise SlideOpenError(
            path,
            f"a {w}x{h} image needs {h * w * 3 / 2**30:.1f} GiB as a contiguous RGB copy, more memory than is "
            "available (a C-contiguous HxWx3 uint8 array is used without a copy; a tiled TIFF is read tile by tile)",
        ) from None
    if as_is:
        out[...] = arr
        return out
    for y in range(0, arr.shape[0], _CONVERT_ROWS):
        _convert_rows(arr[y : y + _CONVERT_ROWS], out[y : y + _CONVERT_ROWS], path)
    return out


def _physical_memory() -> int:
    """The machine's memory in bytes (no limit where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class ImageSlide(Slide):
    """A single-level slide held in memory, decoded on its first read."""

    backend = "image"

    def __init__(self, path: str | os.PathLike[str], mpp: tuple[float, float] | None = None):
        super().__init__(path)
        self._arr: np.ndarray | None = None
        self._decode_lock = threading.Lock()
        ext = os.path.splitext(self.path)[1].lower()
        self._is_tiff = ext in (".tif", ".tiff")
        file_mpp = None
        if self._is_tiff:
            from .tiff_file import check_page_data, open_tifffile, refuse_cmyk

            with open_tifffile(self.path) as tif:
                page = tif.pages[0]
                check_page_data(self.path, page, os.path.getsize(self.path))
                refuse_cmyk(self.path, page, "image")
                shape = tuple(int(v) for v in page.shape)
                if len(shape) < 2 or shape[0] < 1 or shape[1] < 1:
                    raise SlideOpenError(self.path, f"TIFF image has shape {shape}; expected a 2-D image")
                width, height = shape[1], shape[0]
                per_pixel = max(1, page.nbytes // (width * height))
                file_mpp = tiff_page_mpp(page)
        else:
            width, height, per_pixel = _image_header(self.path)
        self._decode_bytes = width * height * (per_pixel + 3)
        self._level_dimensions = [(width, height)]
        self._level_downsamples = [1.0]
        mpp = mpp if mpp is not None else file_mpp
        self._mpp = checked_mpp(self.path, *mpp) if mpp is not None else None
        self._vendor = ext.lstrip(".") or "image"

    def _init_array(self, arr: np.ndarray, mpp, vendor: str) -> None:
        self._arr = arr
        h, w = arr.shape[:2]
        self._level_dimensions = [(w, h)]
        self._level_downsamples = [1.0]
        self._mpp = checked_mpp(self.path, *mpp) if mpp is not None else None
        self._vendor = vendor

    @classmethod
    def from_array(cls, image: np.ndarray, mpp: tuple[float, float] | None = None, name: str = "<array>") -> ImageSlide:
        """Wrap an ``HxWx3`` (or HxW grey) uint8 array as a one-level slide (no copy if RGB)."""
        self = cls.__new__(cls)
        Slide.__init__(self, name)
        image = np.asarray(image)
        if image.ndim >= 2 and (image.shape[0] < 1 or image.shape[1] < 1):
            raise SlideOpenError(name, f"the array holds no pixels ({image.shape[1]} x {image.shape[0]})")
        self._init_array(_to_rgb(image, name), mpp, vendor="array")
        return self

    def _pixels(self) -> np.ndarray:
        """The decoded image, decoded on the first call (once, whatever the threads asking)."""
        if self._arr is not None:
            return self._arr
        with self._decode_lock:
            if self._arr is None:
                self._arr = self._decode()
        return self._arr

    def _decode(self) -> np.ndarray:
        w, h = self._level_dimensions[0]
        if self._decode_bytes > IMAGE_MEMORY_BUDGET_BYTES:
            raise SlideOpenError(
                self.path,
                f"a {w}x{h} plain image needs about {self._decode_bytes / 2**30:.1f} GiB to decode "
                f"whole, over the {IMAGE_MEMORY_BUDGET_BYTES / 2**30:g} GiB limit for plain images; "
                "store it as a tiled TIFF (read tile by tile)",
            )
        if self._is_tiff:
            from .tiff_file import open_tifffile

            with open_tifffile(self.path) as tif:
                arr = tif.pages[0].asarray()
        else:
            arr = self._decode_plain()
            if arr.ndim == 3 and arr.shape[2] in (3, 4):
                code = cv2.COLOR_BGRA2RGBA if arr.shape[2] == 4 else cv2.COLOR_BGR2RGB
                arr = cv2.cvtColor(arr, code, dst=arr)
        if arr.shape[:2] != (h, w):
            raise SlideOpenError(
                self.path,
                f"header claims {w}x{h} pixels, the data decodes to "
                f"{arr.shape[1] if arr.ndim > 1 else '?'}x{arr.shape[0]}",
            )
        return _to_rgb(arr, self.path)

    def _decode_plain(self) -> np.ndarray:
        """A PNG, JPEG, BMP or WebP decoded by OpenCV (BGR order); a truncated file says so, and
        what the decoder printed is told with the file's name."""
        data = np.fromfile(self.path, np.uint8)
        if data[:8].tobytes() == _PNG_SIGNATURE:
            cut = _png_truncation(data)
            if cut is not None:
                raise SlideOpenError(self.path, f"truncated PNG: {cut}")
        with _decoder_stderr() as said:
            arr = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
        told = f" (the decoder said: {'; '.join(said)})" if said else ""
        if any("premature end" in line.lower() for line in said):  # libjpeg decodes the rest as grey
            raise SlideOpenError(self.path, f"truncated JPEG: the file ends before its last scan{told}")
        if arr is None and _jpeg_without_end(data):
            raise SlideOpenError(self.path, f"truncated JPEG: no end-of-image marker at its end{told}")
        if arr is None:
            raise SlideOpenError(self.path, f"not a decodable image (PNG, JPEG, BMP, WebP or TIFF expected){told}")
        if said:
            log.info("%s: decoded; the decoder said: %s", self.path, "; ".join(said))
        return arr

    def _read_level(self, x0_level0: int, y0_level0: int, level: int, w: int, h: int) -> np.ndarray:
        arr = self._pixels()
        ih, iw = arr.shape[:2]
        if x0_level0 >= 0 and y0_level0 >= 0 and x0_level0 + w <= iw and y0_level0 + h <= ih:
            return arr[y0_level0 : y0_level0 + h, x0_level0 : x0_level0 + w].copy()
        out = paste_into_background(h, w, self.background_rgb)
        sx0, sy0 = max(x0_level0, 0), max(y0_level0, 0)
        sx1, sy1 = min(x0_level0 + w, iw), min(y0_level0 + h, ih)
        if sx0 < sx1 and sy0 < sy1:
            out[sy0 - y0_level0 : sy1 - y0_level0, sx0 - x0_level0 : sx1 - x0_level0] = arr[sy0:sy1, sx0:sx1]
        return out

    def close(self) -> None:
        self._arr = None
        super().close()
