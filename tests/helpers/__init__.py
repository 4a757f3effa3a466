"""Helpers the tests share: synthetic images and slides, a tiny detector, comparisons."""

import threading

import cv2
import imagecodecs
import numpy as np
import simplejpeg
import tifffile
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.uid import (
    ExplicitVRLittleEndian,
    JPEGBaseline8Bit,
    SecondaryCaptureImageStorage,
    VLWholeSlideMicroscopyImageStorage,
    generate_uid,
)

TILE_PX = 128


def smooth_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth random RGB image (compresses like a real scan, not like noise)."""
    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, h // 32), max(2, w // 32), 3)) * 255).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    noise = rng.integers(-6, 7, (h, w, 3))
    return np.clip(img.astype(int) + noise, 0, 255).astype(np.uint8)


def write_pyramid_tiff(
    path,
    image: np.ndarray,
    levels: int = 3,
    tile: int = 256,
    photometric: str = "ycbcr",
    mpp: float | None = 0.25,
    subifds: bool = False,
    compression: str = "jpeg",
) -> None:
    """A pyramidal tiled TIFF: levels as successive pages, or as SubIFDs (OME). ``image`` is RGB;
    with JPEG, ``photometric`` says how the tiles store it: "ycbcr" (4:2:0) or "rgb"."""
    pyramid = [image]
    for _ in range(levels - 1):
        p = pyramid[-1]
        pyramid.append(cv2.resize(p, (p.shape[1] // 2, p.shape[0] // 2), interpolation=cv2.INTER_AREA))
    kw = dict(tile=(tile, tile), compression=compression, photometric=photometric)
    if compression == "jpeg":
        # tifffile takes ``photometric`` as the colour space of the data given and the stored one
        # from ``outcolorspace``: the data is RGB either way.
        kw.update(photometric="rgb", compressionargs={"level": 90, "outcolorspace": photometric})
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


def stored_tiles_under(slide, tiles, stored: int = 256) -> set[tuple[int, int]]:
    """The stored tiles ``(tx, ty)`` under the tiles' pixels inside their level (pixel by pixel, slowly)."""
    out = set()
    for t in tiles:
        w, h = slide.level_dimensions[t.level]
        ds = slide.level_downsamples[t.level]
        x0, y0 = int(t.x0_level0 // ds), int(t.y0_level0 // ds)
        xs, ys = np.arange(x0, x0 + t.size), np.arange(y0, y0 + t.size)
        cols = np.unique(xs[(xs >= 0) & (xs < w)] // stored)
        rows = np.unique(ys[(ys >= 0) & (ys < h)] // stored)
        out.update((int(c), int(r)) for r in rows for c in cols)
    return out


def stored_tiles_per_batch(slide, tiles, batch_size: int, stored: int = 256) -> tuple[int, int, int]:
    """Batches of ``tiles`` in order, each decoding what the previous batch's do not cover.

    Returns (stored tiles to decode, stored tiles shared with the previous
    batch, distinct stored tiles under all the tiles).
    """
    needs = [stored_tiles_under(slide, tiles[s : s + batch_size], stored) for s in range(0, len(tiles), batch_size)]
    before = [set(), *needs[:-1]]
    fresh = sum(len(n - p) for n, p in zip(needs, before, strict=True))
    shared = sum(len(n & p) for n, p in zip(needs, before, strict=True))
    return fresh, shared, len(set().union(*needs))


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


def make_tiny_model(out_dir, tile_px: int = TILE_PX, seed: int = 0):
    """A randomly initialised detector of the demo architecture, exported to ONNX + card.

    Its score threshold is set from the model's own scores on smooth test
    images so that at most half of the top-k peaks of any tile pass: results
    stay independent of how the architecture's untrained output happens to be
    distributed, and the top-k cut never lies near the threshold.
    """
    import dataclasses

    import torch

    from wsi_pipeline.inference.backend import create_backend
    from wsi_pipeline.inference.card import load_card, write_card
    from wsi_pipeline.models.export import export_with_card
    from wsi_pipeline.models.net import CenterNetSmall

    torch.manual_seed(seed)
    net = CenterNetSmall(2, 3).eval()
    with torch.no_grad():
        for m in net.modules():  # non-trivial batch norms, so folding them is exercised
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
        net.center_head.weight.mul_(50.0)  # spread the peak scores
    top_k = 48
    card = export_with_card(
        net,
        out_dir / "tiny.onnx",
        name="tiny",
        version="0",
        class_names=["cell", "debris"],
        class_colors=["#ff0000", "#00ff00"],
        region_classes=["tumour", "stroma", "other"],
        top_k=top_k,
        mpp=0.5,
        score_threshold=0.5,
        tile_px=tile_px,
    )
    probe = np.stack([smooth_image(tile_px, tile_px, seed=100 + i) for i in range(6)])
    scores = create_backend(card, "ort").infer(probe)["scores"]
    threshold = float(np.sort(scores, axis=1)[:, ::-1][:, top_k // 2].max()) + 1e-3
    params = {**card.decoder.params, "score_threshold": round(threshold, 6)}
    card = dataclasses.replace(card, decoder=dataclasses.replace(card.decoder, params=params))
    return load_card(write_card(card))


def score_threshold(card) -> float:
    return float(card.decoder.params["score_threshold"])


def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    import cv2

    rng = np.random.default_rng(seed)
    small = (rng.random((max(2, h // 16), max(2, w // 16), 3)) * 255).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    return np.clip(img.astype(int) + rng.integers(-20, 21, (h, w, 3)), 0, 255).astype(np.uint8)


def _unmatched(a, b, box_tol, score_tol):
    """Indices of ``a``'s detections with no partner in ``b`` (same label, close box and score)."""
    free = list(range(len(b)))
    missing = []
    for i in range(len(a)):
        for j in free:
            if (
                a.labels[i] == b.labels[j]
                and abs(a.scores[i] - b.scores[j]) <= score_tol
                and np.abs(a.boxes[i] - b.boxes[j]).max() <= box_tol
            ):
                free.remove(j)
                break
        else:
            missing.append(i)
    return missing


def assert_same_detections(got, want, threshold=None, box_tol=1e-3, score_tol=1e-4, heat_tol=1e-4):
    """Same detections per tile, up to order among near-equal scores.

    A detection may lack a partner only when its score is within ``score_tol``
    of the decoder's ``threshold`` (it may fall on either side).
    """
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.labels.dtype == np.int64 and g.boxes.dtype == np.float32 and g.scores.dtype == np.float32
        assert np.all(np.diff(g.scores) <= 0), "detections must come sorted by score"
        for a, b in ((g, w), (w, g)):
            for i in _unmatched(a, b, box_tol, score_tol):
                assert threshold is not None and abs(a.scores[i] - threshold) <= score_tol, (
                    f"detection {a.boxes[i]} {a.scores[i]} label {a.labels[i]} has no partner"
                )
        np.testing.assert_allclose(g.heatmap, w.heatmap, atol=heat_tol)


class CountingLoader:
    """Wraps a loader's batches, counting releases (the executor must release every batch)."""

    def __init__(self, loader):
        self.loader = loader
        self.given = 0
        self.released = 0
        self._lock = threading.Lock()

    def __iter__(self):
        for batch in self.loader:
            self.given += 1
            inner = batch._release

            def release(inner=inner):
                with self._lock:
                    self.released += 1
                inner()

            batch._release = release
            yield batch


def random_detections(n: int = 300, seed: int = 0) -> np.ndarray:
    """``n`` detections with boxes 2-40 px wide spread over a 50,000 px square, labels 0 and 1."""
    from wsi_pipeline.io.detections import make_detections

    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 5e4, (n, 2))
    wh = rng.uniform(2, 40, (n, 2))
    return make_detections(np.c_[xy, xy + wh], rng.random(n), rng.integers(0, 2, n))


def _dicom_frame_bytes(frame: np.ndarray, photometric: str | None) -> bytes:
    """A frame's stored bytes: raw (``photometric`` None), or JPEG Baseline in the named colour space."""
    if photometric is None:
        return frame.tobytes()
    if photometric == "RGB":  # no colour transform (libjpeg writes the Adobe marker that says so)
        return imagecodecs.jpeg8_encode(frame, level=90, colorspace="RGB", outcolorspace="RGB")
    subsampling = {"YBR_FULL_422": "422", "YBR_FULL": "444"}[photometric]
    return simplejpeg.encode_jpeg(frame, quality=90, colorspace="RGB", colorsubsampling=subsampling)


def write_dicom_level(
    path,
    image: np.ndarray,
    uids: dict[str, str],
    level: int,
    mpp: float,
    tile: int = 256,
    jpeg: str | None = None,
    sparse: bool = False,
    image_type: str = "VOLUME",
) -> None:
    """One image of a DICOM WSI: uncompressed RGB frames, or JPEG Baseline frames with the
    photometric interpretation ``jpeg`` (YBR_FULL_422, YBR_FULL or RGB); TILED_FULL, or
    TILED_SPARSE (``sparse``: tiles wholly of one colour have no frame), as OpenSlide reads them."""
    h, w = image.shape[:2]
    frames, positions = [], []
    for y in range(0, h, tile):
        for x in range(0, w, tile):
            frame = np.zeros((tile, tile, 3), np.uint8)
            part = image[y : y + tile, x : x + tile]
            frame[: part.shape[0], : part.shape[1]] = part
            if sparse and (part == part[0, 0]).all():
                continue
            frames.append(_dicom_frame_bytes(frame, jpeg))
            positions.append((x, y))
    _save_dicom_level(path, w, h, frames, positions, uids, level, mpp, tile, jpeg, sparse, image_type)


def write_sparse_dicom_level(
    path, width: int, height: int, tiles: dict[tuple[int, int], np.ndarray], mpp: float = 0.25, tile: int = 256
) -> None:
    """A one-level TILED_SPARSE DICOM WSI (YBR_FULL_422 JPEG frames) claiming ``width x height`` px,
    with a frame only for ``tiles``: ``(tx, ty) -> tile x tile x 3`` uint8; nothing else is stored."""
    uids = {name: generate_uid() for name in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID")}
    order = sorted(tiles, key=lambda t: (t[1], t[0]))
    frames = [_dicom_frame_bytes(tiles[t], "YBR_FULL_422") for t in order]
    positions = [(tx * tile, ty * tile) for tx, ty in order]
    _save_dicom_level(path, width, height, frames, positions, uids, 0, mpp, tile, "YBR_FULL_422", True, "VOLUME")


def _save_dicom_level(path, w, h, frames, positions, uids, level, mpp, tile, jpeg, sparse, image_type) -> None:
    """One image of a DICOM WSI from its frames (stored bytes) and their places (pixel x, y)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = VLWholeSlideMicroscopyImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian if jpeg is None else JPEGBaseline8Bit
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = VLWholeSlideMicroscopyImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    for name, uid in uids.items():
        setattr(ds, name, uid)
    ds.Modality = "SM"
    if image_type != "VOLUME":
        ds.ImageType = ["ORIGINAL", "PRIMARY", image_type, "NONE"]
    elif level == 0:
        ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    else:
        ds.ImageType = ["DERIVED", "PRIMARY", "VOLUME", "RESAMPLED"]
    ds.InstanceNumber = level + 1
    ds.DimensionOrganizationType = "TILED_SPARSE" if sparse else "TILED_FULL"
    ds.SamplesPerPixel = 3
    ds.PhotometricInterpretation = jpeg or "RGB"
    ds.PlanarConfiguration = 0
    ds.NumberOfFrames = len(frames)
    ds.Rows = ds.Columns = tile
    ds.BitsAllocated = ds.BitsStored = 8
    ds.HighBit = 7
    ds.PixelRepresentation = 0
    ds.TotalPixelMatrixColumns, ds.TotalPixelMatrixRows = w, h
    ds.TotalPixelMatrixFocalPlanes = ds.NumberOfOpticalPaths = 1
    measures = Dataset()
    measures.PixelSpacing = [mpp / 1000, mpp / 1000]  # mm
    measures.SliceThickness = 0
    shared = Dataset()
    shared.PixelMeasuresSequence = [measures]
    ds.SharedFunctionalGroupsSequence = [shared]
    if sparse:
        groups = []
        for x, y in positions:
            where = Dataset()
            where.ColumnPositionInTotalImagePixelMatrix, where.RowPositionInTotalImagePixelMatrix = x + 1, y + 1
            where.XOffsetInSlideCoordinateSystem = where.YOffsetInSlideCoordinateSystem = 0
            where.ZOffsetInSlideCoordinateSystem = 0
            group = Dataset()
            group.PlanePositionSlideSequence = [where]
            groups.append(group)
        ds.PerFrameFunctionalGroupsSequence = groups
    optical = Dataset()
    optical.OpticalPathIdentifier = "0"
    ds.OpticalPathSequence = [optical]
    if jpeg is None:
        ds.PixelData = b"".join(frames)
    else:
        ds.LossyImageCompression = "01"
        ds.PixelData = encapsulate(frames)
        ds["PixelData"].VR = "OB"
        ds["PixelData"].is_undefined_length = True
    ds.save_as(path, enforce_file_format=True)


def write_dicom_wsi(
    folder,
    stem: str,
    image: np.ndarray,
    levels: int = 2,
    mpp: float = 0.25,
    jpeg: str | None = None,
    sparse: bool = False,
    tile: int = 256,
    associated: tuple[str, ...] = (),
) -> list:
    """A DICOM WSI of ``levels`` files ``stem_N.dcm`` in ``folder`` (one series); returns the paths.

    ``jpeg``, ``sparse``, ``tile``: as :func:`write_dicom_level`; ``associated``: image types
    (LABEL, OVERVIEW, THUMBNAIL) also written, as ``stem_label.dcm`` ... (not returned).
    """
    uids = {
        name: generate_uid() for name in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID", "PyramidUID")
    }
    paths = []
    for level in range(levels):
        path = folder / f"{stem}_{level}.dcm"
        pixels = np.ascontiguousarray(image[:: 2**level, :: 2**level])
        write_dicom_level(path, pixels, uids, level, mpp * 2**level, tile, jpeg, sparse)
        paths.append(path)
    for kind in associated:
        small = np.ascontiguousarray(image[::8, ::8])
        write_dicom_level(folder / f"{stem}_{kind.lower()}.dcm", small, uids, 0, mpp * 8, 64, jpeg, image_type=kind)
    return paths


def write_secondary_capture(path, uids: dict[str, str] | None = None) -> None:
    """A DICOM Secondary Capture image of 8 x 8 grey pixels: a DICOM object that is no slide.
    ``uids``: its StudyInstanceUID, SeriesInstanceUID ... (new ones where not given)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID, ds.SeriesInstanceUID = generate_uid(), generate_uid()
    for name, uid in (uids or {}).items():
        setattr(ds, name, uid)
    ds.Modality = "OT"
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.Rows = ds.Columns = 8
    ds.BitsAllocated = ds.BitsStored = 8
    ds.HighBit, ds.PixelRepresentation = 7, 0
    ds.PixelData = bytes(range(64))
    ds.save_as(path, enforce_file_format=True)


def _patch_ul(data: bytearray, tag: tuple[int, int], value: int) -> None:
    """Set the first explicit-VR little-endian UL element ``tag`` of a DICOM file's bytes."""
    head = tag[0].to_bytes(2, "little") + tag[1].to_bytes(2, "little") + b"UL\x04\x00"
    at = data.index(head) + len(head)
    data[at : at + 4] = value.to_bytes(4, "little")


def write_many_level_series(folder, count: int, tile: int = 64) -> list:
    """``count`` files ``level_NNNNN.dcm`` of one DICOM WSI series, each a pyramid level of its own
    size (at most ``tile`` x ``tile``: one JPEG frame each). One file is written, the others are
    its bytes with the size patched: thousands take a second."""
    if count > tile * tile:
        raise ValueError(f"at most {tile * tile} levels of distinct sizes in one {tile} px frame")
    uids = {n: generate_uid() for n in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID")}
    template = folder / "level_00000.dcm"
    write_dicom_level(template, smooth_rgb(tile, tile, seed=1), uids, 0, 0.25, tile=tile, jpeg="YBR_FULL_422")
    data = bytearray(template.read_bytes())
    paths = []
    for i in range(count):
        width, height = tile - i % tile, tile - i // tile
        _patch_ul(data, (0x0048, 0x0006), width)  # TotalPixelMatrixColumns
        _patch_ul(data, (0x0048, 0x0007), height)  # TotalPixelMatrixRows
        path = folder / f"level_{i:05d}.dcm"
        path.write_bytes(bytes(data))
        paths.append(path)
    return paths
