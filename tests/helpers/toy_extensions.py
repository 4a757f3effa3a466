"""A toy decoder, output format and slide reader, as a user's package defines them.

``register_all()`` adds the three to their registries: a plugin module calls it when imported
(tests/test_plugins.py copies this file beside such a module, into a folder on ``PYTHONPATH``),
or a script calls it itself. The functions and the reader are module-level, so that a helper
process imports them by this module's name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from wsi_pipeline.inference.decoder_registry import DecoderEntry, register_decoder
from wsi_pipeline.inference.tile_detections import BatchDetections, TileDetections
from wsi_pipeline.io.formats import DETECTIONS, OutputFormat, register_format
from wsi_pipeline.slide.base import Slide
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.slide.readers import FormatProbe, SlideReader, register_reader

TOP_ONE = "top_one"
COUNTS = "counts"
RAW_SUFFIX = ".rawrgb"


def decode_top_one_batch(outputs: dict[str, Any], card: Any) -> BatchDetections:
    """The highest-scoring row of each tile, whatever its score (the outputs named by the card's
    decoder parameters)."""
    p = {"boxes": "boxes", "scores": "scores", "labels": "labels", **card.decoder.params}
    boxes, scores, labels = (np.asarray(outputs[p[k]]) for k in ("boxes", "scores", "labels"))
    best = scores.argmax(axis=1)
    rows = np.arange(len(best))
    return BatchDetections(
        boxes[rows, best].astype(np.float32),
        scores[rows, best].astype(np.float32),
        labels[rows, best].astype(np.int64),
        np.ones(len(best), np.int64),
    )


def decode_top_one(outputs: dict[str, Any], card: Any) -> list[TileDetections]:
    return decode_top_one_batch(outputs, card).tiles()


def write_counts(path: str | os.PathLike[str], detections: np.ndarray, classes: list[dict]) -> None:
    """A detections file: the number of detections of each class, as JSON (a writer-pool job)."""
    names = [c["name"] for c in classes]
    counts = np.bincount(detections["label"].astype(int), minlength=len(names))
    Path(path).write_text(json.dumps({n: int(c) for n, c in zip(names, counts, strict=False)}), encoding="utf-8")


class RawRgbReader(SlideReader):
    """``.rawrgb``: width and height (little-endian uint32), then the RGB pixels row by row."""

    name = "rawrgb"
    suffixes = (RAW_SUFFIX,)

    @classmethod
    def reads(cls, path: str, probe: FormatProbe) -> bool:
        return probe.extension == RAW_SUFFIX

    @classmethod
    def open(cls, path: str) -> Slide:
        data = np.fromfile(path, np.uint8)
        w, h = (int(v) for v in np.frombuffer(data[:8].tobytes(), "<u4"))
        return ImageSlide.from_array(data[8:].reshape(h, w, 3), name=path)


def write_rawrgb(path: str | os.PathLike[str], pixels: np.ndarray) -> Path:
    h, w, _ = pixels.shape
    Path(path).write_bytes(np.array([w, h], "<u4").tobytes() + pixels.tobytes())
    return Path(path)


DECODER = DecoderEntry(
    TOP_ONE,
    {"boxes": (str, "boxes"), "scores": (str, "scores"), "labels": (str, "labels")},
    decode_top_one,
    decode_top_one_batch,
    output_params=("boxes", "scores", "labels"),
)
FORMAT = OutputFormat(COUNTS, "detections.counts.json", DETECTIONS, f"{__name__}:write_counts", about="counts")


def register_all() -> None:
    register_decoder(DECODER)
    register_format(FORMAT)
    register_reader(RawRgbReader)
