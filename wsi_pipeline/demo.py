"""``make demo``: write a small synthetic slide and run ``wsi-pipeline run`` on it.

python -m wsi_pipeline.demo [--out demo_out] [--size 4096]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .batch.folder import slide_dir
from .cli import main as cli_main
from .summary import load_summary
from .synthetic import write_synthetic_slide


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo_out")
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slide = out / "demo_slide.tiff"
    if not slide.exists():
        info = write_synthetic_slide(slide, args.size, args.size, seed=4242, kind="pathology")
        print(f"wrote {slide} ({info['object_count']} nuclei in its ground truth {info['truth_path']})")
    cli_main(["info", str(slide)])
    results = out / "results"
    print(f"\n$ wsi-pipeline run {slide} --out {results}")
    code = cli_main(["run", str(slide), "--out", str(results)])
    if code != 0:
        return code
    folder = slide_dir(results, "demo_slide").resolve()  # absolute: the notebook runs from notebooks/
    summary = load_summary(folder)
    tumour = (summary.get("heatmap_scores") or {}).get("tumour", {})
    print(
        f"\nfound {summary['detections_total']} nuclei; tissue {summary['tissue']['area_mm2']:.3f} mm2, "
        f"tumour {tumour.get('area_above_0.5_mm2', 0):.3f} mm2 "
        f"({100 * tumour.get('fraction_of_tissue_above_0.5', 0):.1f} % of tissue)"
    )
    print(f"""
outputs in {folder}{os.sep}:
  overlay.png          the slide with the tumour heatmap and the boxes: open it in any image viewer
  detections.geojson   QuPath: open {slide}, then File > Import objects (or drag the file onto the viewer)
  heatmap.ome.tif      QuPath / Fiji (Bio-Formats) / tifffile: the per-class probability pyramid
  detections.csv       x0, y0, x1, y1, score, label, class in level-0 pixels, and each box's tile: pandas, a spreadsheet
  summary.json         counts, areas, slide-level scores, timings, settings
review them in Jupyter: notebooks/02_review_results.ipynb with RUN_DIR = "{folder}"
  (or WSI_NB_RUN_DIR={folder} in the environment Jupyter starts from)
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
