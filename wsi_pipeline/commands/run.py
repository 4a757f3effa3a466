"""``wsi-pipeline run INPUT... --out DIR``: detect over slides, resumable.

Exit code 0 when every slide succeeded (or was already done), 1 when some
failed, 2 when the command line or config cannot start a run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from ..batch import LOG_FILE, PipelineFactory, expand_inputs, run_batch, run_key
from ..batch_folder import BatchLogHandler, lock_output_folder, printable
from ..config import BACKEND_CHOICES, MERGE_CHOICES, TISSUE_CHOICES, RunConfig, load_config
from ..errors import ConfigError, ModelError, UsageError

# CLI flag -> RunConfig field, for the flags that mirror the config file.
CONFIG_FLAGS = ("model", "backend", "tile", "overlap", "mpp", "level", "tissue", "mask", "min_tissue",
                "batch_size", "workers", "streams", "score_threshold", "nms_iou", "merge", "blend",
                "overlay_size", "dask", "slide_timeout")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="detect over slides into an output folder (resumable batch)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="slide files, folders (recursive), globs, or .txt/.csv lists of paths")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (one sub-folder per slide)")
    p.add_argument("--model", metavar="CARD", help="model card (default: the shipped pathology model)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, help="default auto: TensorRT, torch on CUDA, ONNX Runtime")
    p.add_argument("--tile", type=int, help="tile size in pixels (must match the model's input)")
    p.add_argument("--overlap", type=int, help="tile overlap in pixels (default 64)")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--mpp", type=float, help="read at this resolution, um/px (default: the model's)")
    res.add_argument("--level", type=int, help="read this pyramid level as it is")
    p.add_argument("--tissue", choices=TISSUE_CHOICES,
                   help="which tiles to read: otsu (tissue found on a thumbnail), all, or file (--mask); "
                        "default auto: otsu for a model with an mpp (pathology), all for one without (industrial)")
    p.add_argument("--mask", metavar="PATH", help="with --tissue file: mask image or GeoJSON polygons")
    p.add_argument("--min-tissue", type=float, help="minimum tissue fraction of a tile (default 0.05)")
    p.add_argument("--batch-size", type=int, help="tiles per batch (default: from device memory)")
    p.add_argument("--workers", type=int, help="tile reader threads (default: CPU cores - 2, 2 to 12)")
    p.add_argument("--streams", type=int, help="concurrent inference streams / sessions")
    p.add_argument("--score-threshold", type=float, help="drop detections below this score")
    p.add_argument("--nms-iou", type=float, help="overlap threshold of the box merge (default 0.5)")
    p.add_argument("--merge", choices=MERGE_CHOICES, help="box merge across tiles (default nms)")
    p.add_argument("--blend", choices=("gaussian", "hann", "linear", "constant"), help="heatmap blending weights")
    p.add_argument("--overlay-size", type=int, help="overlay.png's longer side in pixels")
    p.add_argument("--config", metavar="FILE", help="TOML file with the same settings")
    p.add_argument("--dask", metavar="ADDRESS", help="run slides on a dask cluster: local:N or a scheduler address")
    p.add_argument("--slide-timeout", type=float, metavar="SECONDS",
                   help="stop a slide after this long and record it as failed (default: 1 h plus 1 h per GiB "
                        "of slide file; 0: no limit, slides run in this process)")
    p.add_argument("--force", action="store_true", help="redo slides already done")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the config file, then the flags given."""
    try:
        config = load_config(args.config) if args.config else RunConfig()
        given = {k: getattr(args, k) for k in CONFIG_FLAGS if getattr(args, k, None) is not None}
        values = config.as_dict()
        # --mpp and --level exclude each other (argparse checks); either replaces the file's choice.
        if "mpp" in given:
            values["level"] = None
        if "level" in given:
            values["mpp"] = None
        values.update(given)
        return RunConfig.from_mapping(values, "options")
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _setup_logging(out: Path) -> logging.Handler:
    handler = BatchLogHandler(out / LOG_FILE)
    logger = logging.getLogger("wsi_pipeline")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(handler)
    return handler


def run(args: argparse.Namespace) -> int:
    from ..inference.card import load_card
    from ..pipeline import DEFAULT_MODEL

    config = build_config(args)
    if config.dask:
        from ..distributed import check_address

        check_address(config.dask)
    out = Path(args.out)
    slides = expand_inputs(args.inputs, exclude=out)
    if not slides:
        raise UsageError(f"no slides found in {' '.join(args.inputs)}")
    if config.model is None:
        config = config.replace(model=str(DEFAULT_MODEL))
    try:
        card = load_card(config.model)
    except (ConfigError, ModelError) as exc:
        raise UsageError(str(exc)) from exc
    key = run_key(config, card)
    with lock_output_folder(out):
        handler = _setup_logging(out)
        log = logging.getLogger("wsi_pipeline")
        log.info("run: %d slides into %s, run key %s, config %s", len(slides), out, key.value, config.as_dict())
        try:
            with warnings.catch_warnings():
                # Per-slide warnings (unknown resolution ...) go to run.log; the bars stay readable.
                warnings.simplefilter("default")
                report = run_batch(slides, out, PipelineFactory(config, card), config, key, force=args.force,
                                   progress=not args.no_progress and sys.stderr.isatty(), dask=config.dask)
        finally:
            logging.getLogger("wsi_pipeline").removeHandler(handler)
            logging.getLogger("py.warnings").removeHandler(handler)
            handler.close()
    print(report.table())
    n_failed = len(report.failed)
    print(printable(f"\n{len(report.outcomes) - n_failed} of {len(report.outcomes)} slides done; outputs in "
                    f"{out}/slides/ ({LOG_FILE} and manifest.json in {out}/)"))
    return report.exit_code
