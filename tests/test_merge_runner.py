"""The box merge in the pipeline's merging process gives what it gives on a thread; its failures reach the caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from wsi_pipeline.errors import WSIPipelineError
from wsi_pipeline.geometry import TilingGeometry
from wsi_pipeline.inference.tile_detections import TileDetections
from wsi_pipeline.stitch.merge_runner import MergeProcess, ThreadedMerge
from wsi_pipeline.stitch.policies import CrossTileMerge, merge_policy
from wsi_pipeline.stitch.stitcher import Stitcher
from wsi_pipeline.tiling.grid import TileGrid


class _Slide:
    path = "a 3,000 x 2,600 image"
    dimensions = (3000, 2600)
    mpp = (0.5, 0.5)
    level_count = 1
    level_downsamples = (1.0,)

    def best_level_for_downsample(self, downsample: float) -> int:
        return 0


class _FailsOnThirdAdd(CrossTileMerge):
    """A policy whose third ``add`` raises (module level: the merging process unpickles it)."""

    def __init__(self) -> None:
        super().__init__("nms")
        self.adds = 0

    def add(self, boxes_level0, scores, labels):
        self.adds += 1
        if self.adds == 3:
            raise ValueError("the third row of boxes")
        super().add(boxes_level0, scores, labels)


class _FailsToFinish(CrossTileMerge):
    """A policy whose ``finish`` raises (it runs while the stitcher closes the heatmap)."""

    def __init__(self) -> None:
        super().__init__("nms")

    def finish(self):
        raise ValueError("the slide's last merge step")


@pytest.fixture(scope="module")
def merging():
    m = MergeProcess()
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiles_and_results():
    geometry = TilingGeometry.for_slide(_Slide(), 512, 64)
    grid = TileGrid(_Slide(), geometry=geometry)
    tiles = [t for t in grid if (t.row + t.col) % 5 != 0]  # gaps, as tiles without tissue leave
    rng = np.random.default_rng(3)
    results = []
    for _ in tiles:
        # Clusters of overlapping boxes, some across the tile's edges and overlap zones.
        centres = rng.uniform(-10, 520, (12, 2)).repeat(3, axis=0) + rng.normal(0, 2, (36, 2))
        half = rng.uniform(6, 14, (36, 1))
        boxes = np.concatenate([centres - half, centres + half], 1).astype(np.float32)
        results.append(TileDetections(boxes, rng.uniform(0.2, 1, 36).astype(np.float32), rng.integers(0, 2, 36), None))
    return geometry, tiles, results


def _stitch(geometry, tiles, results, policy, merge):
    stitcher = Stitcher(geometry, policy, 0.3, merge=merge)
    for i in range(0, len(tiles), 7):  # batches of 7 tiles: row runs split across batches
        stitcher.add_batch(tiles[i : i + 7], results[i : i + 7])
    return stitcher.finish()


@pytest.mark.parametrize("name", ["nms", "nmm", "wbf", "ownership"])
def test_the_merging_process_gives_the_boxes_a_thread_gives(merging, tiles_and_results, name):
    geometry, tiles, results = tiles_and_results
    on_thread = merge_policy(name)
    expected = _stitch(geometry, tiles, results, on_thread, ThreadedMerge(on_thread, 8))
    policy = merge_policy(name)
    got = _stitch(geometry, tiles, results, policy, merging.merge(policy))
    assert len(expected[0]) > 100
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_failed_call_there_is_raised_by_finish_and_the_next_slide_merges(merging, tiles_and_results):
    geometry, tiles, results = tiles_and_results
    policy = _FailsOnThirdAdd()
    with pytest.raises(ValueError, match="the third row of boxes"):
        _stitch(geometry, tiles, results, policy, merging.merge(policy))
    ok = merge_policy("nms")
    assert len(_stitch(geometry, tiles, results, ok, merging.merge(ok))[0]) > 100


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_failing_last_merge_step_is_raised_by_the_stitchers_finish(merging, tiles_and_results, where):
    geometry, tiles, results = tiles_and_results
    policy = _FailsToFinish()
    merge = ThreadedMerge(policy, 8) if where == "thread" else merging.merge(policy)
    with pytest.raises(ValueError, match="the slide's last merge step"):
        _stitch(geometry, tiles, results, policy, merge)


def test_a_killed_merging_process_fails_its_slide_and_a_new_one_takes_the_next(merging, tiles_and_results):
    geometry, tiles, results = tiles_and_results
    policy = merge_policy("nms")
    stitcher = Stitcher(geometry, policy, merge=merging.merge(policy))
    stitcher.add_batch(tiles[:7], results[:7])
    os.kill(merging.pid, signal.SIGKILL)
    with pytest.raises(WSIPipelineError, match="the box-merging process ended"):
        stitcher.add_batch(tiles[7:], results[7:])
        stitcher.finish()
    ok = merge_policy("nms")
    assert len(_stitch(geometry, tiles, results, ok, merging.merge(ok))[0]) > 100


def test_the_merging_process_ends_with_the_process_that_started_it(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from wsi_pipeline.stitch.merge_runner import MergeProcess

        if __name__ == "__main__":
            m = MergeProcess()
            m.start()
            print(m.pid, flush=True)
            time.sleep(600)
        """
    )
    (tmp_path / "starts_merging.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "starts_merging.py")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    # It checks for its parent every second: waited for without a clock of the test's own (the
    # suite's time limit per test ends a wait for one that never goes, and the finally kills it).
    try:
        while _alive(pid):
            time.sleep(0.2)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
