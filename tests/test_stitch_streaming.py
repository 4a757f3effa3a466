"""Streaming merge equals one global pass over the whole slide."""

import numpy as np
import pytest

from wsi_pipeline.stitch import global_nms, merge_boxes
from wsi_pipeline.stitch.streaming import StreamingMerger, connected_components


def _tile_rows(seed: int, rows: int = 6, cols: int = 5, tile: int = 512, step: int = 448, per_tile: int = 60):
    """Boxes per tile, in grid order, as a detector over overlapping tiles gives them (dense clusters)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rows):
        for c in range(cols):
            x0, y0 = c * step, r * step
            centres = rng.uniform(0, tile, (per_tile, 2))
            centres[: per_tile // 3] = centres[0] + rng.normal(0, 6, (per_tile // 3, 2))  # a chain-prone clump
            size = rng.uniform(6, 30, (per_tile, 2))
            b = np.concatenate([centres - size / 2, centres + size / 2], axis=1).clip(0, tile)
            b[:, [0, 2]] += x0
            b[:, [1, 3]] += y0
            out.append((r, y0, b, rng.random(per_tile), rng.integers(0, 2, per_tile)))
    return out


def _sorted_rows(b, s, lab):
    key = np.round(np.c_[b, s, lab], 4)
    return key[np.lexsort(key.T[::-1])]


@pytest.mark.parametrize("method", ["nms", "nmm", "wbf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_global(method, seed):
    tiles = _tile_rows(seed)
    m = StreamingMerger(method, 0.3, "iou" if method == "nms" else "ios")
    row = -1
    for r, y0, b, s, lab in tiles:
        if r != row:
            m.flush(float(y0))
            row = r
        m.add(b, s, lab)
    got = m.finish()
    b = np.concatenate([t[2] for t in tiles])
    s = np.concatenate([t[3] for t in tiles])
    lab = np.concatenate([t[4] for t in tiles])
    if method == "nms":
        keep = global_nms(b, s, lab, 0.3, "iou")
        want = (b[keep], s[keep], lab[keep])
    else:
        want = merge_boxes(b, s, lab, 0.3, "ios", method)
    np.testing.assert_allclose(_sorted_rows(*got), _sorted_rows(*want), atol=1e-3)
    assert m.peak_pending < len(b) / 2  # it held open rows only, not the slide


@pytest.mark.parametrize("method", ["nms", "wbf"])
def test_boxes_taken_while_running_and_the_rest_at_finish_are_finish_alone(method):
    """What the box-merging process sends as rows are decided, then at the end, in that order."""
    merged = []
    for take in (False, True):
        m = StreamingMerger(method, 0.3, "iou")
        parts, row = [], -1
        for r, y0, b, s, lab in _tile_rows(3):
            if r != row:
                m.flush(float(y0))
                row = r
                got = m.take_decided() if take else None
                if got is not None:
                    parts.append(got)
            m.add(b, s, lab)
        parts.append(m.finish())
        assert (len(parts) > 2) == take
        merged.append(tuple(np.concatenate(p) for p in zip(*parts, strict=True)))
        assert m.take_decided() is None
    for a, b in zip(*merged, strict=True):
        np.testing.assert_array_equal(a, b)  # the same boxes in the same order


def test_connected_components():
    lab = connected_components(6, np.array([0, 3, 4]), np.array([1, 4, 5]))
    assert lab.tolist() == [0, 0, 2, 3, 3, 3]
