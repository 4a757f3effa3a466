"""The demo detector: a small CenterNet with a region head, sized for CPU.

Input and output contract of :class:`DetectorWithDecode` (what the exported
ONNX graph does):

- ``image``: ``[B, 512, 512, 3] uint8`` RGB, NHWC, tile pixels. Cast to float,
  permuted to NCHW and normalised with the card's mean/std inside the graph.
- ``boxes``: ``[B, K, 4] float32`` tile pixels ``x0, y0, x1, y1`` (origin
  top-left of the tile, x right, y down), clipped to the tile.
- ``scores``: ``[B, K] float32`` peak heights of the object-centre heatmap,
  sorted descending; entries past the real objects have low scores.
- ``labels``: ``[B, K] int32`` object class index.
- ``heatmap``: ``[B, C_regions, 512/8, 512/8] float32`` region probabilities
  (sigmoid applied), one channel per region class.

The trunk works at strides 2..32 (receptive field about 300 px); the object heads read a stride-4 feature
map (nuclei are 8-20 px, so stride 8 would merge neighbours) and the region
head a stride-8 map. Channel widths are chosen for about 30+ tiles/s with
ONNX Runtime on two CPU cores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

OBJECT_STRIDE = 4
REGION_STRIDE = 8
IMAGENET_MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class CenterNetSmall(nn.Module):
    """Fully convolutional trunk + CenterNet heads + region head.

    ``forward(x)`` takes a normalised ``[B, 3, H, W] float32`` image (H, W
    multiples of 32) and returns raw head outputs:
    ``center_logits [B, C_obj, H/4, W/4]``, ``size_px [B, 2, H/4, W/4]``
    (box width, height in input pixels), ``offset [B, 2, H/4, W/4]`` (centre
    offset within the stride cell, in cells) and
    ``region_logits [B, C_reg, H/8, W/8]`` (None without region classes).
    """

    def __init__(self, num_object_classes: int, num_region_classes: int, widths: Sequence[int] = (16, 32, 64, 96)):
        super().__init__()
        w1, w2, w3, w4 = widths
        self.num_object_classes = num_object_classes
        self.num_region_classes = num_region_classes
        self.stem = nn.Sequential(_conv_bn_relu(3, w1, 2))  # /2
        self.stage4 = nn.Sequential(_conv_bn_relu(w1, w2, 2), _conv_bn_relu(w2, w2))  # /4
        self.stage8 = nn.Sequential(_conv_bn_relu(w2, w3, 2), _conv_bn_relu(w3, w3))  # /8
        self.stage16 = nn.Sequential(_conv_bn_relu(w3, w4, 2), _conv_bn_relu(w4, w4))  # /16
        # Stride 32 context: the centre cell of a 200 px scratch must see its ends.
        self.stage32 = nn.Sequential(_conv_bn_relu(w4, w4, 2), _conv_bn_relu(w4, w4))  # /32
        self.lat32 = nn.Conv2d(w4, w4, 1)
        self.fuse16 = _conv_bn_relu(w4, w4)
        self.lat16 = nn.Conv2d(w4, w3, 1)
        self.fuse8 = _conv_bn_relu(w3, w3)
        self.lat8 = nn.Conv2d(w3, w2, 1)
        self.fuse4 = _conv_bn_relu(w2, w2)
        self.center_head = nn.Conv2d(w2, num_object_classes, 1)
        self.size_head = nn.Conv2d(w2, 2, 1)
        self.offset_head = nn.Conv2d(w2, 2, 1)
        self.region_head = (
            nn.Sequential(_conv_bn_relu(w3, w3), nn.Conv2d(w3, num_region_classes, 1)) if num_region_classes else None
        )
        # CenterNet's prior: start with a low centre probability everywhere.
        nn.init.constant_(self.center_head.bias, -2.19)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        f4 = self.stage4(self.stem(x))
        f8 = self.stage8(f4)
        f16 = self.stage16(f8)
        f32 = self.stage32(f16)
        p16 = self.fuse16(f16 + F.interpolate(self.lat32(f32), scale_factor=2.0, mode="nearest"))
        p8 = self.fuse8(f8 + F.interpolate(self.lat16(p16), scale_factor=2.0, mode="nearest"))
        p4 = self.fuse4(f4 + F.interpolate(self.lat8(p8), scale_factor=2.0, mode="nearest"))
        center_logits = self.center_head(p4)
        # Sizes are regressed in log space of pixels: always positive, and
        # the 8..200 px range of the objects becomes a small numeric range.
        size_px = torch.exp(self.size_head(p4).clamp(-4.0, 7.0)) * 16.0
        offset = torch.sigmoid(self.offset_head(p4))
        region_logits = self.region_head(p8) if self.region_head is not None else None
        return center_logits, size_px, offset, region_logits


class DetectorWithDecode(nn.Module):
    """The exported graph: uint8 NHWC in, fixed-size boxes/scores/labels + heatmap out.

    Peak extraction is CenterNet's: a 3x3 max-pool keeps local maxima of the
    centre heatmap, TopK over all classes and positions picks ``top_k`` of
    them. Every op maps to one TensorRT's ONNX parser supports (Cast,
    Transpose, Sub, Div, Conv, Relu, Resize, Sigmoid, MaxPool, Equal, TopK,
    Floor, GatherElements, Clip, Concat).
    """

    def __init__(
        self,
        net: CenterNetSmall,
        top_k: int = 256,
        mean_rgb: Sequence[float] = IMAGENET_MEAN_RGB,
        std_rgb: Sequence[float] = IMAGENET_STD_RGB,
        tile_size_px: int = 512,
    ):
        super().__init__()
        self.net = net
        self.top_k = top_k
        self.tile_size_px = tile_size_px
        self.register_buffer("mean", torch.tensor(mean_rgb, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std_rgb, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = image.to(torch.float32).permute(0, 3, 1, 2)
        x = (x - self.mean) / self.std
        center_logits, size_px, offset, region_logits = self.net(x)
        b, c, h, w = center_logits.shape
        heat = torch.sigmoid(center_logits)
        peaks = F.max_pool2d(heat, 3, stride=1, padding=1)
        heat = heat * (peaks == heat).to(heat.dtype)
        scores, index = torch.topk(heat.reshape(b, c * h * w), self.top_k, dim=1)
        # Class and cell from the flat index, in float: h*w and w are powers
        # of two for 512 px tiles, so these divisions are exact, and float
        # Floor avoids int64 arithmetic that TensorRT handles poorly.
        index_f = index.to(torch.float32)
        label_f = torch.floor(index_f / float(h * w))
        cell_f = index_f - label_f * float(h * w)
        cy = torch.floor(cell_f / float(w))
        cx = cell_f - cy * float(w)
        cell = cell_f.to(torch.int64)
        geometry = torch.cat([size_px, offset], dim=1).reshape(b, 4, h * w)
        picked = torch.gather(geometry, 2, cell.unsqueeze(1).expand(b, 4, self.top_k))
        bw, bh, ox, oy = picked[:, 0], picked[:, 1], picked[:, 2], picked[:, 3]
        center_x = (cx + ox) * OBJECT_STRIDE
        center_y = (cy + oy) * OBJECT_STRIDE
        boxes = torch.stack([center_x - bw / 2, center_y - bh / 2, center_x + bw / 2, center_y + bh / 2], dim=2).clamp(
            0.0, float(self.tile_size_px)
        )
        labels = label_f.to(torch.int32)
        if region_logits is None:
            return boxes, scores, labels
        return boxes, scores, labels, torch.sigmoid(region_logits)
