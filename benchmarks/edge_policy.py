"""False and missed detections in the last tile row for each edge policy.

For every frame height ``448 + r`` (r = 1 .. 511: every residual a 512/64
grid meets) the last tile row is run under three policies: ``background``
(the tile's part past the frame filled with the slide background, white),
``reflect`` (that part filled by mirroring the frame, cv2's
BORDER_REFLECT_101) and ``shift`` (the grid's policy: the last tile moved up
to end at the frame's edge, rounded up to the heatmap stride, the few pixels
left and frames lower than a tile filled by reflection). Detections centred past the edge are dropped and
the rest clipped, as the stitcher does; a detection is false when no truth
object of its class overlaps it at IoU >= 0.1, missed when a truth object
half or more inside the tile's frame part has no detection at IoU >= 0.1.

    python benchmarks/edge_policy.py [--axis y|x] [--seeds 9001,9002]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np

from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.inference import load_card
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.ort_backend import OrtBackend
from wsi_pipeline.synthetic.scene import SyntheticScene
from wsi_pipeline.tiling.grid import fill_past_edge

ENGINES = Path(__file__).resolve().parents[1] / "engines"
TILE, STEP = 512, 448


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = lambda c: (c[:, 2] - c[:, 0]) * (c[:, 3] - c[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def edge_tiles(frame: np.ndarray, policy: str, stride: int) -> tuple[np.ndarray, int]:
    """The last tile row's tile (one column) and its top in frame pixels."""
    h = frame.shape[0]
    if policy == "shift":  # as the grid places it (TilingGeometry), the rest as read_tile fills it
        g = TilingGeometry(TILE, h, TILE, TILE - STEP, heatmap_stride=stride if stride > 1 else None)
        y0 = int(g.row_y0_grid(g.n_rows - 1))
        tile = np.zeros((TILE, TILE, 3), np.uint8)
        tile[: h - y0] = frame[y0 : y0 + TILE]
        return fill_past_edge(tile, 0, y0, TILE, h), y0
    n_rows = max(1, -(-max(h - (TILE - STEP), 1) // STEP))
    y0 = (n_rows - 1) * STEP
    part = frame[y0:]
    pad = TILE - part.shape[0]
    if pad <= 0:
        return part, y0
    if policy == "background":
        return cv2.copyMakeBorder(part, 0, pad, 0, 0, cv2.BORDER_CONSTANT, value=(255, 255, 255)), y0
    return cv2.copyMakeBorder(part, 0, pad, 0, 0, cv2.BORDER_REFLECT_101), y0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="9001")
    p.add_argument("--axis", choices=["y", "x"], default="y")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args()
    for card_name, kind, mpp in (("defects_industrial", "industrial", None), ("nuclei_pathology", "pathology", 0.25)):
        card = load_card(ENGINES / f"{card_name}.card.json")
        backend = OrtBackend(card, max_batch=16)
        totals = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            scene = SyntheticScene(4096, 4096, seed, kind=kind, mpp=mpp)
            x_frame, y_frame = 1024, 1024
            for policy in ("background", "reflect", "shift"):
                fp = fn = edge_fp = n = 0
                for r0 in range(1, 512, 16):
                    tiles, meta = [], []
                    for r in range(r0, min(r0 + 16, 512)):
                        h = STEP + r
                        if args.axis == "y":
                            frame = scene.render(x_frame, y_frame, TILE, h)
                        else:  # the right edge, seen transposed: frame rows are scene columns
                            frame = scene.render(x_frame, y_frame, h, TILE).transpose(1, 0, 2)
                        tile, y0 = edge_tiles(frame, policy, card.heatmap.stride if card.heatmap else 1)
                        tiles.append(np.ascontiguousarray(tile))
                        meta.append((h, y0))
                    for d, (h, y0) in zip(decode(backend.infer(np.stack(tiles)), card), meta, strict=True):
                        b = d.boxes.astype(np.float64).copy()
                        b[:, [1, 3]] += y0
                        keep = (b[:, 1] + b[:, 3]) / 2 < h
                        b, lab = b[keep], d.labels[keep]
                        b[:, 3] = np.minimum(b[:, 3], h)
                        if args.axis == "y":
                            tb, tl = scene.objects_in(x_frame, y_frame + y0, TILE, h - y0)
                            tb = tb.astype(np.float64) - [x_frame, y_frame, x_frame, y_frame]
                        else:
                            tb, tl = scene.objects_in(x_frame + y0, y_frame, h - y0, TILE)
                            tb = tb.astype(np.float64)[:, [1, 0, 3, 2]] - [y_frame, x_frame, y_frame, x_frame]
                        area = (tb[:, 2] - tb[:, 0]) * (tb[:, 3] - tb[:, 1])
                        tc = tb.copy()
                        tc[:, [1, 3]] = np.clip(tc[:, [1, 3]], y0, h)
                        tc[:, [0, 2]] = np.clip(tc[:, [0, 2]], 0, TILE)
                        vis = (tc[:, 2] - tc[:, 0]) * (tc[:, 3] - tc[:, 1]) / np.maximum(area, 1e-9)
                        m = iou(b, tc) * (lab[:, None] == tl[None, :]) if len(tc) else np.zeros((len(b), 0))
                        false = m.max(axis=1, initial=0) < 0.1
                        fp += int(false.sum())
                        edge_fp += int((false & (b[:, 3] >= h - 8)).sum())
                        missed = (m.max(axis=0, initial=0) < 0.1) & (vis >= 0.5)
                        fn += int(missed.sum())
                        if args.debug and (missed.any() or false.any()):
                            print(
                                card_name,
                                policy,
                                h,
                                y0,
                                "missed",
                                tb[missed].round(1).tolist(),
                                "false",
                                b[false].round(1).tolist(),
                            )
                        n += 1
                t = totals.setdefault(policy, [0, 0, 0, 0])
                for i, v in enumerate((n, fp, edge_fp, fn)):
                    t[i] += v
        for policy, (n, fp, edge_fp, fn) in totals.items():
            print(
                f"{card_name} axis {args.axis} {policy:10s}: {n} frames, false {fp} "
                f"(within 8 px of the edge {edge_fp}), missed {fn}"
            )


if __name__ == "__main__":
    main()
