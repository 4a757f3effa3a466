"""The device side of a CUDA executor's decoding: a batch's outputs shrunk on the GPU before the copy back.

The card's decoder (:func:`~.decoders.decode`) stays the only definition of a
detection: on the device, outputs of a decoder registered with
``compacts_on_device`` are only compacted (the rows it keeps sorted to the
front and counted), others copied back whole; the host runs the decoder on
what comes back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .card_spec import ModelCard
from .decoder_registry import decode_names, decoder_entry, decoder_params
from .decoders import check_heatmap_shape, decode_batch
from .tile_detections import BatchDetections

COUNT = "\0rows kept"  # the compacted row count per tile, beside the model outputs


class DeviceDecoder:
    """Shrinks a batch's device outputs before the copy back; the CPU decoder does the rest.

    The card's decoder (:func:`~.decoders.decode`) is the only definition of
    what a detection is. On the device, ``centernet`` and
    ``boxes_scores_labels`` outputs are only compacted: rows below the score
    threshold (and, with ``num_detections``, rows past the count) are moved
    behind the others by a stable descending sort on the score and their
    scores set to -inf, which every decoder drops. The host then slices the
    rows up to the batch's largest count and runs the decoder on them, so
    thresholds, box formats, label offsets, per-tile NMS and
    ``max_detections`` are applied by exactly the code the CPU path runs
    (row order is kept: the decoder's own stable sort leaves sorted rows as
    they are). ``yolo`` outputs are copied back whole. The heatmap's
    activation is applied on the device (the host decoder is told so); the
    heatmap is copied back too, or, for a consumer that blends it on the
    device, left there (:meth:`finish` ``heatmaps=``).
    """

    def __init__(self, card: ModelCard):
        self.card = card
        self.kind = card.decoder.type
        self.p = decoder_params(card)
        self.compacts = decoder_entry(card).compacts_on_device
        self.host_card = _card_without_activation(card) if card.heatmap is not None else card
        self.boxes_card = dataclasses.replace(card, heatmap=None)  # what the host decodes when the heatmap stays

    def reduce(self, outs: dict[str, Any], n: int) -> dict[str, Any]:
        """Device tensors to copy back: ``{name: tensor [n, ...]}``, ``count`` when compacting."""
        import torch

        card, p = self.card, self.p
        red: dict[str, torch.Tensor] = {}
        if self.compacts:
            boxes, scores, labels = outs[p["boxes"]][:n], outs[p["scores"]][:n].float(), outs[p["labels"]][:n]
            if boxes.dim() == 2:
                boxes, scores, labels = boxes[None], scores[None], labels[None]
            # The rows the decoder keeps (decoders.detection_rows), so that the counts are its own.
            offset = int(p.get("label_offset", 0))
            keep = (
                (scores >= float(p["score_threshold"]))
                & (labels.long() + offset >= 0)
                & torch.isfinite(boxes.float()).all(dim=2)
            )
            if p.get("num_detections") is not None:
                counts = outs[p["num_detections"]][:n].reshape(-1).long()
                cols = torch.arange(scores.shape[1], device=scores.device)
                keep = keep & (cols[None, :] < counts[:, None])
            key = torch.where(keep, scores, torch.full_like(scores, -float("inf")))
            key, order = torch.sort(key, dim=1, descending=True, stable=True)
            red[p["boxes"]] = torch.gather(boxes, 1, order[:, :, None].expand(-1, -1, boxes.shape[2])).contiguous()
            red[p["scores"]] = key.contiguous()
            red[p["labels"]] = torch.gather(labels, 1, order).contiguous()
            red[COUNT] = keep.sum(dim=1).to(torch.int32)
        else:
            for name in decode_names(card):
                if card.heatmap is None or name != card.heatmap.output:
                    red[name] = outs[name][:n].contiguous()
        if card.heatmap is not None:
            hm = outs[card.heatmap.output][:n]
            if card.heatmap.activation == "sigmoid":
                hm = torch.sigmoid(hm.float())
            elif card.heatmap.activation == "softmax":
                hm = torch.softmax(hm.float(), dim=1)
            else:  # its own memory: the runner's output buffer is rewritten by the next batch
                hm = hm.to(torch.float32, copy=True)
            red[card.heatmap.output] = hm.contiguous()
        return red

    def finish(self, host: dict[str, np.ndarray], n: int, heatmaps: Any = None) -> BatchDetections:
        """Host arrays (views of reused pinned buffers: the decoder copies what it keeps) -> detections.

        ``heatmaps``: the batch's heatmaps left on the device (:meth:`reduce`'s,
        not among ``host``): the detections carry that tensor as they are.
        """
        outputs = dict(host)
        dropped = None
        if self.compacts:
            counts = outputs.pop(COUNT)[:n].astype(np.int64)
            # Past the card's cap only the count is taken: the rows are sorted, the first ones are kept.
            cap = self.card.detections_cap
            dropped = np.maximum(counts - cap, 0) if counts.max(initial=0) > cap else None
            k = max(1, min(int(counts.max(initial=0)), cap))
            for name in (self.p["boxes"], self.p["scores"], self.p["labels"]):
                outputs[name] = outputs[name][:, :k]
            if self.p.get("num_detections") is not None:
                outputs[self.p["num_detections"]] = np.full(n, k, np.int64)
        if heatmaps is None:
            batch = decode_batch(outputs, self.host_card)
        else:
            check_heatmap_shape(heatmaps.shape, self.card, n)
            batch = dataclasses.replace(decode_batch(outputs, self.boxes_card), heatmaps=heatmaps)
        return batch if dropped is None else dataclasses.replace(batch, over_cap=dropped)


def _card_without_activation(card: ModelCard) -> ModelCard:
    return dataclasses.replace(card, heatmap=dataclasses.replace(card.heatmap, activation="none"))
