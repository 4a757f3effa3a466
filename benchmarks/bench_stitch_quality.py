"""Detection quality of the stitched slide against the synthetic truth, per box-merge setting.

Writes a synthetic pathology slide (default 4096 x 4096, seed 4242, the demo's), runs the shipped
pathology model over it with each setting, and matches the slide's detections to the truth
(COCO matching at IoU 0.5, :mod:`wsi_pipeline.models.evaluate`). Also the industrial model over
four synthetic 2048 x 2048 camera images with the default setting.

    python benchmarks/bench_stitch_quality.py [--size 4096] [--json out.json]
    python benchmarks/bench_stitch_quality.py --smoke      # seconds: a tiny slide and image
"""

from __future__ import annotations

import argparse

from harness import (
    ROOT,
    SMOKE_SLIDE_PX,
    add_common_args,
    machine,
    require,
    synthetic_slide,
    work_folder,
    write_json,
)

from wsi_pipeline import Pipeline
from wsi_pipeline.io.detections import detection_boxes
from wsi_pipeline.models.evaluate import detection_counts
from wsi_pipeline.synthetic import SyntheticScene, load_truth

SETTINGS = [
    ("nms, iou (default)", {}),
    ("nms, iou, cut boxes kept", {"drop_edge_boxes": False}),
    ("nms, ios, cut boxes kept", {"drop_edge_boxes": False, "nms_metric": "ios"}),
    ("nmm, ios", {"merge": "nmm", "nms_metric": "ios"}),
    ("wbf, iou", {"merge": "wbf"}),
    ("ownership", {"merge": "ownership"}),
]


def _counts(preds, truths):
    return detection_counts(
        [detection_boxes(d) for d in preds],
        [d["score"] for d in preds],
        [d["label"] for d in preds],
        [t[0] for t in truths],
        [t[1] for t in truths],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    add_common_args(ap)
    args = ap.parse_args()
    require("bench_stitch_quality.py", "pycocotools")  # detection_counts matches with it
    image_px, seeds = (SMOKE_SLIDE_PX, (2,)) if args.smoke else (2048, (2, 4, 8, 10))
    if args.smoke:
        args.size = SMOKE_SLIDE_PX
    path = str(synthetic_slide(work_folder("bench_quality_") / "slide.tiff", args.size, seed=4242))
    record: dict = {**machine(), "smoke": args.smoke, "size": args.size, "pathology": {}}
    truth = load_truth(path.replace(".tiff", ".truth.geojson"))
    print(f"pathology, {args.size} x {args.size}, {len(truth.boxes)} nuclei in the truth")
    print(f"{'setting':<28}{'detections':>11}{'TP':>7}{'FP':>6}{'FN':>6}{'precision':>11}{'recall':>8}")
    for name, kw in SETTINGS:
        with Pipeline.from_card(backend="ort", **kw) as pipe:
            d = pipe.run(path).detections
        c = _counts([d], [(truth.boxes, truth.labels)])
        print(f"{name:<28}{len(d):>11}{c.tp:>7}{c.fp:>6}{c.fn:>6}{c.precision:>11.4f}{c.recall:>8.4f}")
        record["pathology"][name] = {"detections": len(d), "precision": c.precision, "recall": c.recall}

    preds, truths = [], []
    with Pipeline.from_card(ROOT / "engines" / "defects_industrial.card.json", backend="ort") as pipe:
        for seed in seeds:
            scene = SyntheticScene(image_px, image_px, seed=seed, kind="industrial")
            preds.append(pipe.run(scene.render(0, 0, image_px, image_px)).detections)
            truths.append(scene.objects_in(0, 0, image_px, image_px))
    c = _counts(preds, truths)
    print(
        f"industrial, {len(seeds)} images of {image_px} x {image_px}, {c.tp + c.fn} defects: TP {c.tp} FP {c.fp} "
        f"FN {c.fn}, precision {c.precision:.4f}, recall {c.recall:.4f}"
    )
    record["industrial"] = {"images": len(seeds), "precision": c.precision, "recall": c.recall}
    write_json(args.json, record)


if __name__ == "__main__":
    main()
