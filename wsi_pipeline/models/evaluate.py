"""Detection precision/recall at IoU 0.5 (pycocotools' matching) and heatmap Dice.

Matching is COCO's, from ``pycocotools.cocoeval.COCOeval`` with one IoU
threshold: per image and class, detections in descending score order are
matched greedily to the unmatched truth box of highest IoU >= the threshold.
Truth objects cut by the tile border (less than ``min_visible`` of the box
inside) are "crowd" regions: a detection on them counts neither as a true
nor as a false positive, and missing them is no miss.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DetectionCounts:
    """True positives, false positives and false negatives summed over tiles (and classes)."""

    tp: int
    fp: int
    fn: int

    @property
    def precision(self) -> float:
        return self.tp / max(self.tp + self.fp, 1)

    @property
    def recall(self) -> float:
        return self.tp / max(self.tp + self.fn, 1)


def detection_counts(
    pred_boxes: Sequence[np.ndarray],
    pred_scores: Sequence[np.ndarray],
    pred_labels: Sequence[np.ndarray],
    true_boxes: Sequence[np.ndarray],
    true_labels: Sequence[np.ndarray],
    true_ignore: Sequence[np.ndarray] | None = None,
    iou_threshold: float = 0.5,
    per_class: bool = False,
) -> DetectionCounts | dict[int, DetectionCounts]:
    """TP/FP/FN over a set of tiles, each given as xyxy boxes in the same pixel frame.

    All predictions passed count (threshold them first). ``true_ignore[i]``
    flags truth boxes of tile i to treat as crowd (see module docstring).
    """
    labels_seen = sorted({int(v) for a in (*pred_labels, *true_labels) for v in np.asarray(a).reshape(-1)})
    cats = [{"id": c + 1, "name": str(c)} for c in labels_seen] or [{"id": 1, "name": "0"}]
    images, gts, dts = [], [], []
    for i in range(len(true_boxes)):
        images.append({"id": i + 1, "width": 0, "height": 0})
        tb = np.asarray(true_boxes[i], np.float64).reshape(-1, 4)
        ign = np.zeros(len(tb), bool) if true_ignore is None else np.asarray(true_ignore[i], bool).reshape(-1)
        for b, lab, crowd in zip(tb, np.asarray(true_labels[i]).reshape(-1), ign, strict=True):
            w, h = b[2] - b[0], b[3] - b[1]
            gts.append(
                {
                    "id": len(gts) + 1,
                    "image_id": i + 1,
                    "category_id": int(lab) + 1,
                    "bbox": [b[0], b[1], w, h],
                    "area": w * h,
                    "iscrowd": int(crowd),
                }
            )
        pb = np.asarray(pred_boxes[i], np.float64).reshape(-1, 4)
        for b, s, lab in zip(
            pb, np.asarray(pred_scores[i]).reshape(-1), np.asarray(pred_labels[i]).reshape(-1), strict=True
        ):
            w, h = b[2] - b[0], b[3] - b[1]
            dts.append(
                {
                    "id": len(dts) + 1,
                    "image_id": i + 1,
                    "category_id": int(lab) + 1,
                    "bbox": [b[0], b[1], w, h],
                    "area": w * h,
                    "score": float(s),
                }
            )
    max_dets = max(1, max((len(np.asarray(p).reshape(-1, 4)) for p in pred_boxes), default=1))
    counts = _match_counts(images, gts, dts, cats, iou_threshold, max_dets)
    if per_class:
        return {k: DetectionCounts(*v) for k, v in sorted(counts.items())}
    tot = np.sum(list(counts.values()), axis=0) if counts else np.zeros(3, int)
    return DetectionCounts(int(tot[0]), int(tot[1]), int(tot[2]))


def _match_counts(
    images: list[dict], gts: list[dict], dts: list[dict], cats: list[dict], iou_threshold: float, max_dets: int
) -> dict[int, list[int]]:
    """[TP, FP, FN] per class (0-based label) of COCO-style annotations, matched by pycocotools at
    ``iou_threshold``; crowd truth boxes and the predictions they absorb count in none."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco_gt = COCO()
        coco_gt.dataset = {"images": images, "annotations": gts, "categories": cats}
        coco_gt.createIndex()
        coco_dt = COCO()
        coco_dt.dataset = {"images": images, "annotations": dts, "categories": cats}
        coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.iouThrs = np.array([iou_threshold])
        ev.params.maxDets = [max_dets]
        ev.params.areaRng = [[0, 1e10]]
        ev.params.areaRngLbl = ["all"]
        ev.evaluate()
    counts: dict[int, list[int]] = {}
    for e in ev.evalImgs:
        if e is None:
            continue
        c = counts.setdefault(int(e["category_id"]) - 1, [0, 0, 0])
        matched = e["dtMatches"][0] > 0
        dt_ignored = e["dtIgnore"][0].astype(bool)
        gt_ignored = np.asarray(e["gtIgnore"], bool)
        c[0] += int((matched & ~dt_ignored).sum())
        c[1] += int((~matched & ~dt_ignored).sum())
        gt_matched = e["gtMatches"][0] > 0
        c[2] += int((~gt_matched & ~gt_ignored).sum())
    return counts


def dice(pred: np.ndarray, truth: np.ndarray) -> float:
    """Dice coefficient 2|A&B| / (|A|+|B|) of two boolean masks (1.0 when both are empty)."""
    pred, truth = np.asarray(pred, bool), np.asarray(truth, bool)
    denom = int(pred.sum()) + int(truth.sum())
    return 1.0 if denom == 0 else 2.0 * int((pred & truth).sum()) / denom


@dataclass(frozen=True)
class QualityReport:
    """Held-out quality of a detector card: object P/R at IoU 0.5 and region Dice per heatmap channel."""

    counts: DetectionCounts
    per_class: dict[int, DetectionCounts]
    dice: dict[str, float]
    tiles: int

    def summary(self) -> str:
        parts = [
            f"tiles {self.tiles}",
            f"precision {self.counts.precision:.4f}",
            f"recall {self.counts.recall:.4f}",
            f"(tp {self.counts.tp} fp {self.counts.fp} fn {self.counts.fn})",
        ]
        parts += [
            f"class {c}: P {v.precision:.4f} R {v.recall:.4f} (n={v.tp + v.fn})" for c, v in self.per_class.items()
        ]
        parts += [f"dice {k} {v:.4f}" for k, v in self.dice.items()]
        return ", ".join(parts)


# Scene region labels making up each heatmap channel of the shipped models.
REGION_CHANNEL_LABELS = {"tissue": (1, 2), "tumour": (2,)}


def evaluate_card(card, samples, *, backend=None, min_visible: float = 0.5, batch: int = 8) -> QualityReport:
    """Run ``card``'s model (ORT unless ``backend`` is given) on rendered ``samples`` and score it.

    ``samples`` are :class:`~.data.TileSample` tiles of the card's input
    size. Truth boxes with less than ``min_visible`` of their area inside the
    tile are crowd (ignored). A heatmap channel named in
    ``REGION_CHANNEL_LABELS`` is thresholded at 0.5 and compared with the
    tile's region labels on the heatmap grid; Dice is pooled over all tiles.
    """
    from ..inference.decoders import decode

    if backend is None:
        from ..inference.ort_backend import OrtBackend

        backend = OrtBackend(card, max_batch=batch)
    dets = []
    for i in range(0, len(samples), batch):
        chunk = samples[i : i + batch]
        dets += decode(backend.infer(np.stack([s.image for s in chunk])), card)
    args = (
        [d.boxes for d in dets],
        [d.scores for d in dets],
        [d.labels for d in dets],
        [s.boxes for s in samples],
        [s.labels for s in samples],
        [s.visible < min_visible for s in samples],
    )
    total = detection_counts(*args)
    per_class = detection_counts(*args, per_class=True)
    dice_scores = {}
    if card.heatmap is not None:
        for c, name in enumerate(card.heatmap.classes):
            if name not in REGION_CHANNEL_LABELS:
                continue
            pred = np.concatenate([d.heatmap[c].ravel() > 0.5 for d in dets])
            truth = np.concatenate([np.isin(s.regions, REGION_CHANNEL_LABELS[name]).ravel() for s in samples])
            dice_scores[name] = dice(pred, truth)
    return QualityReport(total, per_class, dice_scores, len(samples))


def main(argv: list[str] | None = None) -> int:
    """``python -m wsi_pipeline.models.evaluate CARD --kind pathology``: print held-out quality."""
    import argparse

    from ..inference.card import load_card
    from .data import heldout_tiles

    parser = argparse.ArgumentParser(prog="python -m wsi_pipeline.models.evaluate")
    parser.add_argument("card")
    parser.add_argument("--kind", choices=["pathology", "industrial"], required=True)
    parser.add_argument("--scenes", type=int, default=8)
    parser.add_argument("--tiles-per-scene", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=9000)
    parser.add_argument("--threshold", type=float, default=None, help="override the card's score threshold")
    parser.add_argument("--iou", type=float, default=None, help="override the card's NMS IoU threshold")
    args = parser.parse_args(argv)
    card = load_card(args.card)
    overrides = {k: v for k, v in (("score_threshold", args.threshold), ("iou_threshold", args.iou)) if v is not None}
    if overrides:
        import dataclasses

        card = dataclasses.replace(
            card, decoder=dataclasses.replace(card.decoder, params={**card.decoder.params, **overrides})
        )
    samples = heldout_tiles(args.kind, args.scenes, args.tiles_per_scene, first_seed=args.first_seed)
    print(evaluate_card(card, samples).summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
