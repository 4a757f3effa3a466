"""Output decoders: a batch's raw model outputs -> one :class:`TileDetections` per tile.

Every decoder returns boxes in TILE pixels of the model input (``x0, y0, x1,
y1``, origin top-left of the tile, x right, y down); the stitcher moves them
to level-0 slide pixels. The card's ``decoder`` entry picks the decoder and
its parameters: a :class:`~.decoder_registry.DecoderEntry` each, the built-in
ones registered below (another is added with
:func:`~.decoder_registry.register_decoder`):

``centernet``
    The shipped models' graph already does peak extraction and outputs
    fixed-size ``boxes [B,K,4]`` (xyxy tile px), ``scores [B,K]``, ``labels
    [B,K]``; decoding keeps the entries with ``score >= score_threshold``.
    Params: ``boxes``, ``scores``, ``labels`` (output names; default those
    words), ``score_threshold`` (0.3), ``max_detections`` (all),
    ``iou_threshold`` (null: no NMS; a number: class-aware NMS per tile, for
    long objects such as scratches that can raise more than one peak).
``boxes_scores_labels``
    Detection exports in torchvision's style: ``boxes [B,N,4]``, ``scores
    [B,N]``, ``labels [B,N]`` (rank-2 outputs are taken as B=1), possibly
    padded. Params: the three output names, ``num_detections`` (optional
    output ``[B]`` with the count of valid rows per tile), ``score_threshold``
    (0.0), ``box_format`` (``xyxy`` | ``xywh`` | ``cxcywh``), ``normalized``
    (boxes in 0..1 of the tile: false), ``label_offset`` (added to labels, e.g.
    -1 for exports whose class 0 is the background: 0). Rows with a negative
    label after the offset are padding and dropped.
``yolo``
    A raw YOLO (v8-style) head ``[B, 4+C, N]`` of ``cx, cy, w, h`` in tile px
    followed by C class scores. Params: ``output``, ``score_threshold``
    (0.25), ``iou_threshold`` (0.45), ``max_detections`` (300),
    ``channels_last`` (the head is ``[B, N, 4+C]``: false), ``objectness``
    (a v5-style objectness column after the box, multiplied in: false).
    Class-aware NMS per tile, the slide-level NMS (``boxes.nms.global_nms``) on each tile.

Every decoder keeps a row only where its score reaches ``score_threshold``, its
label is 0 or more (a negative label is padding or "no class") and its box is
finite (:func:`detection_rows`); a label past the card's classes is a
:class:`~wsi_pipeline.errors.ModelError`.

A card's ``heatmap`` output ``[B, C, H/stride, W/stride]`` is returned per
tile as ``CxHxW float32`` probabilities after the card's activation
(:func:`card_heatmaps`, which :func:`decode_batch` and :func:`decode` apply to a
decoder's result that carries none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..boxes.nms import global_nms
from ..errors import ModelError
from .decoder_registry import (
    BatchDecoder,
    Decoder,
    DecoderEntry,
    EntryField,
    ParamTable,
    decoder_entry,
    decoder_params,
    register_decoder,
)
from .tile_detections import BatchDetections, TileDetections, row_offsets, rows_over_cap

if TYPE_CHECKING:
    from .card_spec import ModelCard


CENTERNET_PARAMS: ParamTable = {
    "boxes": (str, "boxes"),
    "scores": (str, "scores"),
    "labels": (str, "labels"),
    "score_threshold": ((int, float), 0.3),
    "max_detections": ((int, type(None)), None),
    "iou_threshold": ((int, float, type(None)), None),
}
BOXES_SCORES_LABELS_PARAMS: ParamTable = {
    "boxes": (str, "boxes"),
    "scores": (str, "scores"),
    "labels": (str, "labels"),
    "num_detections": ((str, type(None)), None),
    "score_threshold": ((int, float), 0.0),
    "box_format": (str, "xyxy"),
    "normalized": (bool, False),
    "label_offset": (int, 0),
}
YOLO_PARAMS: ParamTable = {
    "output": (str, "output0"),
    "score_threshold": ((int, float), 0.25),
    "iou_threshold": ((int, float), 0.45),
    "max_detections": (int, 300),
    "channels_last": (bool, False),
    "objectness": (bool, False),
}
BOX_FORMATS = ("xyxy", "xywh", "cxcywh")


def _get(outputs: Mapping[str, np.ndarray], name: str, card: ModelCard) -> np.ndarray:
    try:
        return np.asarray(outputs[name])
    except KeyError:
        raise ModelError(
            f"{card.model_path}: output {name!r} missing from the model's results (found {sorted(outputs)})"
        ) from None


def check_heatmap_shape(shape: Sequence[int], card: ModelCard, batch: int) -> None:
    """Raise ModelError unless ``shape`` is the card's heatmap output for ``batch`` tiles: ``[batch, C, H, W]``."""
    shape = list(shape)
    if len(shape) != 4 or shape[0] != batch or shape[1] != len(card.heatmap.classes):
        raise ModelError(
            f"{card.model_path}: heatmap output {card.heatmap.output!r}: expected "
            f"[{batch}, {len(card.heatmap.classes)}, H, W], found {shape}"
        )


def card_heatmaps(outputs: Mapping[str, np.ndarray], card: ModelCard, batch: int) -> np.ndarray | None:
    """The card's heatmap output after its activation, ``batch x C x H x W float32`` (its own memory),
    checked against the card; None for a card without a heatmap.

    The heatmap step of the decoder contract: a decoder puts it in its result's ``heatmaps`` (one
    tile's in each :class:`TileDetections`' ``heatmap``); where a decoder leaves them None,
    :func:`decode_batch` and :func:`decode` attach it themselves."""
    if card.heatmap is None:
        return None
    given = _get(outputs, card.heatmap.output, card)
    raw = given.astype(np.float32, copy=False)
    check_heatmap_shape(raw.shape, card, batch)
    if card.heatmap.activation == "sigmoid":
        raw = 1.0 / (1.0 + np.exp(-raw))
    elif card.heatmap.activation == "softmax":
        e = np.exp(raw - raw.max(axis=1, keepdims=True))
        raw = e / e.sum(axis=1, keepdims=True)
    # Activations and conversions made new arrays; the caller's own array (a reused buffer) is copied.
    return np.array(raw, order="C", copy=True) if raw is given else raw


def _as_batched(a: np.ndarray, rank: int) -> np.ndarray:
    return a[None] if a.ndim == rank - 1 else a


def _check_rows(card: ModelCard, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> None:
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.shape != boxes.shape[:2] or labels.shape != boxes.shape[:2]:
        raise ModelError(
            f"{card.model_path}: detection outputs: expected boxes [B,N,4], scores [B,N], "
            f"labels [B,N], found {list(boxes.shape)}, {list(scores.shape)}, {list(labels.shape)}"
        )


def nms_per_class(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Indices kept by class-aware greedy NMS, by descending score (ties in row order).

    ``boxes``: ``Nx4`` xyxy; ``scores``: ``N``; ``labels``: ``N`` ints. The
    slide-level NMS (:func:`~wsi_pipeline.boxes.nms.global_nms`) on one tile's
    boxes: one NMS for tiles and slides.
    """
    try:
        return global_nms(boxes, scores, labels, iou_threshold=float(iou_threshold))
    except ValueError as exc:  # boxes or scores the model gave as NaN or infinity
        raise ModelError(f"detection outputs: {exc}") from exc


def _check_labels(card: ModelCard, labels: np.ndarray) -> None:
    """A label past the card's classes means the card lists fewer classes than the model has."""
    if labels.size and int(labels.max()) >= len(card.classes):
        raise ModelError(
            f"{card.card_path}: the model gave label {int(labels.max())}, but the card names "
            f"{len(card.classes)} classes (labels 0 to {len(card.classes) - 1}): expected a class "
            "for every label the model emits"
        )


def detection_rows(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, score_threshold: float) -> np.ndarray:
    """The rows every decoder keeps: score at least ``score_threshold``, label >= 0, a finite box.

    ``boxes`` ``[..., 4]``, ``scores`` and ``labels`` ``[...]``; a bool mask of their shape.
    """
    return (scores >= score_threshold) & (labels >= 0) & np.isfinite(boxes).all(axis=-1)


def first_by_key(key: np.ndarray, k: int) -> np.ndarray:
    """Each row's columns of its ``k`` smallest keys, in key order, ties in column order: the first ``k``
    of a stable argsort, without sorting a row of a million rows where ``k`` is small."""
    b, n = key.shape
    if k == 0:
        return np.zeros((b, 0), np.int64)
    if 8 * k >= n:
        return np.argsort(key, axis=1, kind="stable")[:, :k]
    out = np.empty((b, k), np.int64)
    for i, row in enumerate(key):
        last = row[np.argpartition(row, k - 1)[:k]].max()
        less = np.flatnonzero(row < last)
        sel = np.concatenate([less, np.flatnonzero(row == last)[: k - len(less)]])
        sel.sort()
        out[i] = sel[np.argsort(row[sel], kind="stable")]
    return out


def over_cap(valid: np.ndarray, card: ModelCard) -> np.ndarray | None:
    """How many of each tile's ``valid`` rows (``[B,N]``) are past the card's cap of detections a tile."""
    return rows_over_cap(np.maximum(valid.sum(axis=1, dtype=np.int64) - card.detections_cap, 0))


def _ranked(
    boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, valid: np.ndarray, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each tile's valid rows by descending score (ties in row order), at most ``limit`` a tile.

    ``boxes`` ``[B,N,4]``, ``scores``, ``labels``, ``valid`` ``[B,N]``. Returns
    the kept rows of all tiles, tile after tile (boxes float32, scores
    float32, labels int64), and each tile's count: one sort for the batch.
    """
    key = np.where(valid, -scores.astype(np.float64), np.inf)
    counts = valid.sum(axis=1, dtype=np.int64)
    if limit is not None:
        counts = np.minimum(counts, limit)
    k = int(counts.max(initial=0))
    order = first_by_key(key, k)
    rows = np.arange(len(order))[:, None]
    take = np.arange(k)[None, :] < counts[:, None]
    return (
        boxes[rows, order][take].astype(np.float32, copy=False),
        scores[rows, order][take].astype(np.float32, copy=False),
        labels[rows, order][take].astype(np.int64, copy=False),
        counts,
    )


def decode_centernet_batch(outputs: Mapping[str, np.ndarray], card: ModelCard) -> BatchDetections:
    """Fixed-size peak outputs -> detections with ``score >= score_threshold``."""
    p = decoder_params(card)
    boxes = _as_batched(_get(outputs, p["boxes"], card), 3)
    scores = _as_batched(_get(outputs, p["scores"], card), 2)
    labels = _as_batched(_get(outputs, p["labels"], card), 2)
    _check_rows(card, boxes, scores, labels)
    heatmaps = card_heatmaps(outputs, card, boxes.shape[0])
    valid = detection_rows(boxes, scores, labels, p["score_threshold"])
    cap = card.detections_cap
    if p["iou_threshold"] is None:
        limit = cap if p["max_detections"] is None else min(cap, p["max_detections"])
        b, s, lab, counts = _ranked(boxes, scores, labels, valid, limit)
    else:  # per-tile NMS between the ranking and the limit
        b, s, lab, counts = _ranked(boxes, scores, labels, valid, cap)
        off = row_offsets(counts)
        keep = []
        for i in range(len(counts)):
            rows = np.arange(off[i], off[i + 1])
            if rows.size > 1:
                rows = rows[nms_per_class(b[rows], s[rows], lab[rows], p["iou_threshold"])]
            keep.append(rows[: p["max_detections"]])
        counts = np.array([len(k) for k in keep], np.int64)
        keep_all = np.concatenate(keep) if keep else np.zeros(0, np.int64)
        b, s, lab = b[keep_all], s[keep_all], lab[keep_all]
    _check_labels(card, lab)
    return BatchDetections(b, s, lab, counts, heatmaps, over_cap(valid, card))


def decode_centernet(outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]:
    """:func:`decode_centernet_batch`, per tile."""
    return decode_centernet_batch(outputs, card).tiles()


def _to_xyxy(boxes: np.ndarray, box_format: str) -> np.ndarray:
    if box_format == "xyxy":
        return boxes
    out = np.empty_like(boxes)
    if box_format == "xywh":
        out[..., :2] = boxes[..., :2]
        out[..., 2:] = boxes[..., :2] + boxes[..., 2:]
    else:  # cxcywh
        half = boxes[..., 2:] / 2
        out[..., :2] = boxes[..., :2] - half
        out[..., 2:] = boxes[..., :2] + half
    return out


def decode_boxes_scores_labels_batch(outputs: Mapping[str, np.ndarray], card: ModelCard) -> BatchDetections:
    """torchvision-style ``boxes/scores/labels`` outputs -> detections (padding and low scores dropped)."""
    p = decoder_params(card)
    boxes = _as_batched(_get(outputs, p["boxes"], card), 3).astype(np.float32)
    scores = _as_batched(_get(outputs, p["scores"], card), 2).astype(np.float32)
    labels = _as_batched(_get(outputs, p["labels"], card), 2).astype(np.int64) + p["label_offset"]
    _check_rows(card, boxes, scores, labels)
    boxes = _to_xyxy(boxes, p["box_format"])
    if p["normalized"]:
        h, w = card.input.size_hw
        boxes = boxes * np.array([w, h, w, h], np.float32)
    counts = None
    if p["num_detections"] is not None:
        counts = _get(outputs, p["num_detections"], card).reshape(-1).astype(np.int64)
        if counts.shape[0] != boxes.shape[0]:
            raise ModelError(
                f"{card.model_path}: output {p['num_detections']!r}: expected "
                f"[{boxes.shape[0]}], found {list(counts.shape)}"
            )
    heatmaps = card_heatmaps(outputs, card, boxes.shape[0])
    valid = detection_rows(boxes, scores, labels, p["score_threshold"])
    if counts is not None:
        valid &= np.arange(boxes.shape[1])[None, :] < counts[:, None]
    b, s, lab, kept = _ranked(boxes, scores, labels, valid, card.detections_cap)
    _check_labels(card, lab)
    return BatchDetections(b, s, lab, kept, heatmaps, over_cap(valid, card))


def decode_boxes_scores_labels(outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]:
    """:func:`decode_boxes_scores_labels_batch`, per tile."""
    return decode_boxes_scores_labels_batch(outputs, card).tiles()


def decode_yolo(outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]:
    """Raw YOLO head -> thresholded, class-aware NMS'd detections per tile."""
    return _decode_yolo(outputs, card)


def decode_yolo_batch(outputs: Mapping[str, np.ndarray], card: ModelCard) -> BatchDetections:
    """:func:`decode_yolo` as a batch."""
    return BatchDetections.from_tiles(decode_yolo(outputs, card))


def _decode_yolo(outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]:
    p = decoder_params(card)
    raw = _as_batched(_get(outputs, p["output"], card), 3).astype(np.float32)
    if not p["channels_last"]:
        raw = raw.transpose(0, 2, 1)  # -> [B, N, 4+C]
    n_cls = len(card.classes)
    width = 4 + int(p["objectness"]) + n_cls
    if raw.ndim != 3 or raw.shape[2] != width:
        layout = "[B, N, {}]" if p["channels_last"] else "[B, {}, N]"
        raise ModelError(
            f"{card.model_path}: yolo output {p['output']!r}: expected "
            f"{layout.format(width)} for {n_cls} classes, found "
            f"{list(_get(outputs, p['output'], card).shape)}"
        )
    heatmaps = card_heatmaps(outputs, card, raw.shape[0])
    results = []
    cap = card.detections_cap
    for i in range(raw.shape[0]):
        rows = raw[i]
        cls_scores = rows[:, width - n_cls :]
        if p["objectness"]:
            cls_scores = cls_scores * rows[:, 4:5]
        labels = cls_scores.argmax(axis=1)
        scores = cls_scores[np.arange(rows.shape[0]), labels]
        cand = np.flatnonzero(detection_rows(rows[:, :4], scores, labels, p["score_threshold"]))
        dropped = max(0, cand.size - cap)
        if dropped:  # the highest scores, in row order
            cand = np.sort(cand[first_by_key(-scores[cand][None].astype(np.float64), cap)[0]])
        hm = None if heatmaps is None else heatmaps[i]
        if cand.size == 0:
            results.append(TileDetections.empty(hm))
            continue
        boxes = _to_xyxy(rows[cand, :4], "cxcywh")
        keep = nms_per_class(boxes, scores[cand], labels[cand], p["iou_threshold"])[: p["max_detections"]]
        results.append(
            TileDetections(
                boxes[keep].astype(np.float32),
                scores[cand][keep].astype(np.float32),
                labels[cand][keep].astype(np.int64),
                hm,
                dropped,
            )
        )
    return results


register_decoder(
    DecoderEntry(
        "centernet",
        CENTERNET_PARAMS,
        decode_centernet,
        decode_centernet_batch,
        compacts_on_device=True,
        output_params=("boxes", "scores", "labels"),
    )
)
register_decoder(
    DecoderEntry(
        "boxes_scores_labels",
        BOXES_SCORES_LABELS_PARAMS,
        decode_boxes_scores_labels,
        decode_boxes_scores_labels_batch,
        compacts_on_device=True,
        output_params=("boxes", "scores", "labels", "num_detections"),
        choices={"box_format": BOX_FORMATS},
    )
)
register_decoder(DecoderEntry("yolo", YOLO_PARAMS, decode_yolo, decode_yolo_batch, output_params=("output",)))

# {decoder name: function}, live views of the registry (a decoder registered later is in them).
DECODERS: Mapping[str, Decoder] = EntryField("decode")
BATCH_DECODERS: Mapping[str, BatchDecoder] = EntryField("decode_batch")


def get_decoder(card: ModelCard) -> Decoder:
    """The decoder function named by the card."""
    return decoder_entry(card).decode


def decode(outputs: Mapping[str, np.ndarray], card: ModelCard) -> list[TileDetections]:
    """Decode one batch of raw outputs with the card's decoder: one TileDetections per tile, each
    with its heatmap where the card names one (:func:`card_heatmaps`)."""
    tiles = get_decoder(card)(outputs, card)
    if card.heatmap is not None and any(t.heatmap is None for t in tiles):
        for t, heatmap in zip(tiles, card_heatmaps(outputs, card, len(tiles)), strict=True):
            if t.heatmap is None:
                t.heatmap = heatmap
    return tiles


def decode_batch(outputs: Mapping[str, np.ndarray], card: ModelCard) -> BatchDetections:
    """:func:`decode` as arrays for the whole batch (:class:`BatchDetections`): the same detections."""
    batch = decoder_entry(card).decode_batch(outputs, card)
    if batch.heatmaps is None and card.heatmap is not None:
        batch = dataclasses.replace(batch, heatmaps=card_heatmaps(outputs, card, len(batch.counts)))
    return batch
