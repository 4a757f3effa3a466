"""The grid's edge policy: a detector never sees an edge made of padding.

Every frame size 448 + r (r = 1 .. 511, every residual of the 512/64 grid)
in height and width, on both shipped cards' geometries: the last tile ends at
the border (no padding without a heatmap; fewer pixels than the heatmap
stride with one); frames smaller than a tile are one tile filled by
reflection. The model check runs the last tile of a frame with known defects
once per padding the grid can produce, in one batch per card.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wsi_pipeline import Pipeline
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.inference import load_card
from wsi_pipeline.inference.decoders import decode
from wsi_pipeline.inference.ort_backend import OrtBackend
from wsi_pipeline.slide.image import ImageSlide
from wsi_pipeline.synthetic import SyntheticScene
from wsi_pipeline.tiling import TileGrid

ENGINES = Path(__file__).resolve().parents[1] / "engines"
CARDS = {"defects_industrial": ("industrial", None), "nuclei_pathology": ("pathology", 0.25)}
SIZES = range(448 + 1, 448 + 512)


def _stride(card_name: str) -> int | None:
    card = load_card(ENGINES / f"{card_name}.card.json")
    return card.heatmap.stride if card.heatmap else None


def _padding(g: TilingGeometry) -> tuple[int, int]:
    """Grid pixels the last column and row reach past the slide."""
    x1 = int(g.col_x0_grid(g.n_cols - 1)) + g.tile
    y1 = int(g.row_y0_grid(g.n_rows - 1)) + g.tile
    return x1 - g.width_grid, y1 - g.height_grid


@pytest.mark.parametrize("card_name", CARDS)
def test_every_size_is_covered_and_tiles_past_the_border_only_by_less_than_the_stride(card_name):
    stride = _stride(card_name)
    for size in [*SIZES, *range(2 * 448 + 1, 2 * 448 + 512)]:
        for w, h in ((size, 700), (700, size)):
            g = TilingGeometry(w, h, 512, 64, heatmap_stride=stride)
            pad_x, pad_y = _padding(g)
            for pad, extent in ((pad_x, w), (pad_y, h)):
                assert pad >= 0
                assert pad == 512 - extent if extent < 512 else pad < (stride or 1)
            for origin, n in ((g.col_x0_grid, g.n_cols), (g.row_y0_grid, g.n_rows)):
                x0 = origin(np.arange(n))
                assert x0[0] == 0 and (np.diff(x0) > 0).all() and (np.diff(x0) <= 448).all()  # no gap


@pytest.mark.parametrize("card_name", CARDS)
def test_edge_tiles_give_no_box_of_padding_and_no_false_box_at_the_edge(card_name):
    kind, mpp = CARDS[card_name]
    card = load_card(ENGINES / f"{card_name}.card.json")
    stride = card.heatmap.stride if card.heatmap else None
    scene = SyntheticScene(4096, 4096, 9001, kind=kind, mpp=mpp)
    # One square frame per padding the grid produces over every residual (its last tile is
    # padded right and below alike).
    by_padding: dict[int, int] = {}
    for size in SIZES:
        pad = _padding(TilingGeometry(size, size, 512, 64, heatmap_stride=stride))[0]
        if pad:
            by_padding[pad] = size
    assert by_padding, "no size is padded"
    # Every frame is the top-left corner of one rendered 512 px square.
    whole = scene.render(1024, 1024, 512, 512)
    truth, truth_labels = scene.objects_in(1024, 1024, 512, 512)
    truth -= 1024
    tiles, cases = [], []
    for size in by_padding.values():
        grid = TileGrid(ImageSlide.from_array(np.ascontiguousarray(whole[:size, :size])), 512, 64)
        last = grid[len(grid) - 1]
        tiles.append(grid.read(last))
        cases.append((size, last, truth, truth_labels))
    backend = OrtBackend(card, max_batch=len(tiles))
    try:
        results = decode(backend.infer(np.stack(tiles)), card)
    finally:
        backend.close()
    for dets, (size, last, truth, truth_labels) in zip(results, cases, strict=True):
        boxes = dets.boxes + [last.x0_level0, last.y0_level0, last.x0_level0, last.y0_level0]
        # As the stitcher does: boxes centred past the border dropped, the rest clipped.
        kept = ((boxes[:, 0] + boxes[:, 2]) / 2 < size) & ((boxes[:, 1] + boxes[:, 3]) / 2 < size)
        boxes, labels = np.minimum(boxes[kept], size), dets.labels[kept]
        assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all(), f"{size}: a box of padding"
        at_edge = boxes[:, 2:].max(axis=1) >= size - 4
        for box, label in zip(boxes[at_edge], labels[at_edge], strict=True):
            t = truth[truth_labels == label]
            overlaps = (np.minimum(box[2], t[:, 2]) > np.maximum(box[0], t[:, 0])) & (
                np.minimum(box[3], t[:, 3]) > np.maximum(box[1], t[:, 1])
            )
            assert overlaps.any(), f"{card_name} {size} x {size}: a false box at the edge: {box}"


@pytest.mark.parametrize("w,h", [(511, 511), (512, 959), (1407, 600)])
def test_a_frame_with_one_defect_gives_one_box(w, h):
    """A plain surface with one spot: nothing else, at whatever size (448k + 510/511 included)."""
    frame = np.full((h, w, 3), 128, np.uint8)
    yy, xx = np.mgrid[:h, :w]
    frame[(yy - h // 3) ** 2 + (xx - w // 3) ** 2 < 12**2] = 40
    with Pipeline.from_card(str(ENGINES / "defects_industrial.card.json"), backend="ort") as p:
        dets = p.run(frame).detections
    assert len(dets) == 1, dets
