"""The box merging alone, on a real run's boxes: how much of a run the merge policy's own work is.

    python benchmarks/bench_merge_replay.py SLIDE [--rounds 3] [--backend ort] [--json out.json]
    python benchmarks/bench_merge_replay.py --smoke      # seconds: a tiny synthetic slide, one replay

Runs ``Pipeline.run(SLIDE)`` once (no outputs) recording every call the stitcher makes to its
merge policy (the mapped boxes of each row's run of tiles, each row's start), then replays those
calls on a fresh policy of the same settings, in this thread, ``--rounds`` times. Prints the boxes
handed over, the boxes kept and each replay's seconds. A side path: no reading, no model, no other
thread competing for the interpreter.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from harness import SMOKE_ROUNDS, SMOKE_SLIDE_PX, add_common_args, machine, synthetic_slide, work_folder, write_json

from wsi_pipeline import Pipeline
from wsi_pipeline.config import RunConfig
from wsi_pipeline.stitch.policies import MergePolicy, merge_policy


class _Recording(MergePolicy):
    """Passes every call to ``inner`` and keeps a copy of it."""

    def __init__(self, inner: MergePolicy, calls: list):
        self.inner, self.calls = inner, calls

    def keep_in_tile(self, boxes_tile, rows, cols, geometry):
        return self.inner.keep_in_tile(boxes_tile, rows, cols, geometry)

    def row_started(self, y0_level0: float) -> None:
        self.calls.append(("row", y0_level0))
        self.inner.row_started(y0_level0)

    def add(self, boxes_level0, scores, labels) -> None:
        self.calls.append(("add", np.array(boxes_level0), np.array(scores), np.array(labels)))
        self.inner.add(boxes_level0, scores, labels)

    def finish(self):
        return self.inner.finish()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide", nargs="?", help="the slide (with --smoke: a tiny synthetic one when left out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="ort")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds = SMOKE_ROUNDS
        args.slide = args.slide or str(synthetic_slide(work_folder("bench_merge_") / "s.tiff", SMOKE_SLIDE_PX))
    elif args.slide is None:
        ap.error("the slide is needed (or --smoke)")
    cfg = RunConfig()
    calls: list = []

    def recording_policy(*a, **k) -> MergePolicy:
        return _Recording(merge_policy(*a, **k), calls)

    import wsi_pipeline.slide_run as slide_run

    slide_run.merge_policy = recording_policy  # the run's stitcher gets the recording policy
    with Pipeline.from_card(backend=args.backend, config=cfg) as pipe:
        result = pipe.run(args.slide)
    added = sum(len(c[1]) for c in calls if c[0] == "add")
    n_det = len(result.detections)
    print(f"run: {n_det:,} detections; {added:,} boxes handed to the merge policy in {len(calls)} calls")
    replays = []
    for _ in range(args.rounds):
        policy = merge_policy(cfg.merge, cfg.nms_iou, cfg.nms_metric, cfg.drop_edge_boxes)
        t0 = time.perf_counter()
        for c in calls:
            if c[0] == "add":
                policy.add(c[1], c[2], c[3])
            else:
                policy.row_started(c[1])
        kept = len(policy.finish()[0])
        replays.append(time.perf_counter() - t0)
        print(f"replay: {replays[-1]:.3f} s, {kept:,} kept")
    write_json(
        args.json,
        {**machine(), "smoke": args.smoke, "detections": n_det, "boxes_added": added, "replay_seconds": replays},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
