"""``wsi-pipeline run INPUT... --out DIR``: detect over slides, resumable."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from pathlib import Path

from ..batch import expand_inputs, run_batch, run_key
from ..batch.folder import LOCK_FILE, LOG_FILE, MANIFEST, SLIDES_DIR, lock_output_folder
from ..batch.jobs import PipelineFactory
from ..config import (
    BLEND_CHOICES,
    DECODE_CHOICES,
    MERGE_CHOICES,
    RESAMPLE_CHOICES,
    SLIDE_HASH_CHOICES,
    TISSUE_CHOICES,
    RunConfig,
    load_config,
)
from ..errors import ConfigError, ModelError, UsageError
from ..inference.backend import BACKEND_CHOICES
from ..inference.shipped import DEFAULT_MODEL_NAME, shipped_names
from ..io.formats import DEFAULT_FORMATS, FORMATS
from ..slide.damage import DAMAGED_TILE_CHOICES
from ..text_escapes import printable
from .run_log import PROGRESS_CHOICES, progress_mode, remove_logging, setup_logging

DESCRIPTION = """\
Detect over slides into DIR, one folder per slide, resumable.

Exit code 0 when every slide succeeded (or was already done), 1 when some
failed, 2 when the command line or config cannot start a run.
"""
# CLI flag -> RunConfig field, for the flags that mirror the config file.
CONFIG_FLAGS = (
    "model",
    "backend",
    "tile",
    "overlap",
    "mpp",
    "level",
    "tissue",
    "mask",
    "min_tissue",
    "batch_size",
    "workers",
    "decode",
    "resample",
    "streams",
    "score_threshold",
    "nms_iou",
    "merge",
    "blend",
    "overlay_size",
    "on_damaged_tile",
    "dask",
    "slide_timeout",
    "formats",
    "slide_hash",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="detect over slides into an output folder (resumable batch)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(p)
    _add_tiling_arguments(p)
    _add_inference_arguments(p)
    _add_output_arguments(p)
    _add_batch_arguments(p)
    _add_feedback_arguments(p)
    p.set_defaults(func=run)


def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    """The slides, the output folder and the model."""
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="slide files, folders (recursive), globs, .txt/.csv lists of paths, or https:// and s3:// "
        "addresses of tiled TIFF or SVS slides",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (one sub-folder per slide)")
    p.add_argument(
        "--model",
        metavar="CARD",
        help="model card, or a shipped model by name: "
        f"{', '.join(shipped_names()) or 'none found'} (default: {DEFAULT_MODEL_NAME})",
    )
    p.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        help="default auto: TensorRT, torch on CUDA, ONNX Runtime; torch for a .pt2 model",
    )


def _add_tiling_arguments(p: argparse.ArgumentParser) -> None:
    """Where the slide is read: tile, overlap, resolution, tissue selection."""
    p.add_argument("--tile", type=int, help="tile size in pixels (must match the model's input)")
    p.add_argument("--overlap", type=int, help="tile overlap in pixels (default 64)")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--mpp", type=float, help="read at this resolution, um/px (default: the model's)")
    res.add_argument("--level", type=int, help="read this pyramid level as it is")
    p.add_argument(
        "--tissue",
        choices=TISSUE_CHOICES,
        help="which tiles to read: otsu (tissue found on a thumbnail), all, or file (--mask); "
        "default auto: otsu for a model with an mpp (pathology), all for one without (industrial)",
    )
    p.add_argument("--mask", metavar="PATH", help="with --tissue file: mask image or GeoJSON polygons")
    p.add_argument("--min-tissue", type=float, help="minimum tissue fraction of a tile (default 0.05)")


def _add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """How tiles run through the model and their boxes and heatmaps merge."""
    p.add_argument("--batch-size", type=int, help="tiles per batch (default: from device memory)")
    p.add_argument("--workers", type=int, help="tile reader threads for CPU decoding (default: CPU cores - 2, 2 to 4)")
    p.add_argument(
        "--decode",
        choices=DECODE_CHOICES,
        help=decode_help(),
    )
    p.add_argument(
        "--resample",
        choices=RESAMPLE_CHOICES,
        help="a grid between stored levels (--mpp): area (default: the finer level decoded whole, shrunk "
        "as OpenCV's INTER_AREA, on the CPU or GPU) or reduced (JPEG tiles decoded at 1/2, 1/4 or 1/8 in "
        "the DCT domain on the CPU: faster, within a few grey levels of area)",
    )
    p.add_argument(
        "--streams",
        type=int,
        help="concurrent inference streams / sessions (default: 4 CUDA streams on a GPU, "
        "2 ONNX Runtime sessions on the CPU)",
    )
    p.add_argument(
        "--score-threshold",
        type=float,
        help="drop detections below this score (default: keep what the model card's decoder "
        "keeps, its score_threshold, 0.3 for the shipped models)",
    )
    p.add_argument("--nms-iou", type=float, help="overlap threshold of the box merge (default 0.5)")
    p.add_argument("--merge", choices=MERGE_CHOICES, help="box merge across tiles (default nms)")
    p.add_argument(
        "--blend", choices=BLEND_CHOICES, help="weights that blend overlapping tiles' heatmaps (default gaussian)"
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Each slide's output files."""
    p.add_argument(
        "--formats",
        metavar="NAMES",
        help="output files of each slide, comma-separated: "
        + "; ".join(f"{f.name}: {f.filename}, {f.about}" for f in FORMATS.values())
        + f". Default {','.join(DEFAULT_FORMATS)}. "
        + "; ".join(f"{f.name} needs pip install 'wsi-pipeline[{f.extra}]'" for f in FORMATS.values() if f.extra)
        + ". docs/outputs.md says which to pick",
    )
    p.add_argument("--overlay-size", type=int, help="overlay.png's longer side in pixels (default 2048)")


def decode_help() -> str:
    """``--decode``'s help, from the table of GPU decoders by JPEG kind (tiling/gpu_choice.py)."""
    from ..tiling.gpu_choice import GPU_DECODER_BY_COLOUR

    kinds = ", ".join(f"{colour} by {decoder}" for colour, decoder in GPU_DECODER_BY_COLOUR.items())
    return (
        "where stored JPEG tiles are decoded: auto (on the GPU with a CUDA backend, for baseline JPEG "
        f"tiles of a tiled TIFF, Aperio SVS or DICOM WSI: {kinds}; else on the CPU), cpu, or gpu "
        "(refuse slides it cannot take). wsi-pipeline info SLIDE says which a slide gets"
    )


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """How the batch treats its slides: damaged tiles, settings file, cluster, time limit, resume."""
    p.add_argument(
        "--on-damaged-tile",
        choices=DAMAGED_TILE_CHOICES,
        help="a stored tile that decodes with corrupt data: warn (default; logged and listed in "
        "summary.json) or fail the slide",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with the same settings")
    p.add_argument(
        "--plugin",
        action="append",
        dest="plugins",
        metavar="MODULE",
        help="a module that registers decoders, output formats or slide readers when imported, "
        "imported here and in every process of the run (repeatable; added to the config file's plugins)",
    )
    p.add_argument("--dask", metavar="ADDRESS", help="run slides on a dask cluster: local:N or a scheduler address")
    p.add_argument(
        "--slide-timeout",
        type=float,
        metavar="SECONDS",
        help="stop a slide after this long and record it as failed (default: 1 h plus 1 h per GiB "
        "of slide file; 0: no limit, slides run in this process)",
    )
    p.add_argument(
        "--slide-hash",
        choices=SLIDE_HASH_CHOICES,
        help="how a rerun recognises an unchanged slide file: sampled (default: its size, modification "
        "time, inode and 16 sampled blocks) or full (its whole content read, slower: for slides "
        "restored from an archive with their modification times)",
    )
    p.add_argument("--force", action="store_true", help="redo slides already done")


def _add_feedback_arguments(p: argparse.ArgumentParser) -> None:
    """What stderr shows while the slides run."""
    p.add_argument(
        "--progress",
        choices=PROGRESS_CHOICES,
        default="auto",
        help="what stderr shows while slides run: bar (progress bars), log (a line when each slide "
        "starts and ends), none; auto: bar on a terminal, log otherwise (scheduler, nohup, "
        "cron). Warnings and errors reach stderr in every mode (default %(default)s)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="only errors on stderr: no progress and no warnings (run.log keeps everything); "
        "the results table still goes to stdout",
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_const", const="none", default="auto", help=argparse.SUPPRESS
    )  # the earlier spelling of --progress none


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
        values["plugins"] = [*values.get("plugins", ()), *(args.plugins or ())]
        return RunConfig.from_mapping(values, "options")
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    from ..inference.card import load_card
    from ..pipeline import DEFAULT_MODEL, check_card_config

    config = build_config(args)
    if config.dask:
        from ..batch.distributed import check_address

        check_address(config.dask)
    out = Path(args.out)
    slides = expand_inputs(args.inputs, exclude=out)
    if not slides:
        raise UsageError(f"no slides found in {' '.join(args.inputs)}")
    if config.model is None:
        config = config.replace(model=str(DEFAULT_MODEL))
    try:
        # The model file is checked where the pipeline is built (PipelineFactory), not here.
        card = load_card(config.model, verify_model=False)
        check_card_config(card, config)  # the settings against the model, before anything is written
    except (ConfigError, ModelError) as exc:
        raise UsageError(str(exc)) from exc
    key = run_key(config, card)
    made = [p for p in (out, out / LOCK_FILE, out / LOG_FILE, out / SLIDES_DIR) if not p.exists()]
    with lock_output_folder(out):
        try:
            report = _run_logged(args, slides, out, config, card, key)
        except UsageError:
            # Found once the slides' process started (a backend this machine lacks, a model file
            # that does not match its card): what this run made goes, as for one found earlier,
            # unless it recorded slides (a manifest: the run did start), whose log then stays.
            if not (out / MANIFEST).exists():
                remove_made(made)
            raise
    print(report.table())
    n_failed = len(report.failed)
    print()
    print(
        printable(
            f"{len(report.outcomes) - n_failed} of {len(report.outcomes)} slides done; outputs in "
            f"{out}/slides/ ({LOG_FILE} and manifest.json in {out}/)"
        )
    )
    return report.exit_code


def _run_logged(args: argparse.Namespace, slides: list, out: Path, config: RunConfig, card, key):
    """The batch, with its log in ``out/run.log`` and on stderr."""
    mode = progress_mode(args.progress, args.quiet, sys.stderr.isatty())
    handlers = setup_logging(out / LOG_FILE, mode, args.quiet)
    log = logging.getLogger("wsi_pipeline")
    log.info("run: %d slides into %s, run key %s, config %s", len(slides), out, key.value, config.as_dict())
    try:
        with warnings.catch_warnings():
            # Per-slide warnings (unknown resolution ...) go through the log handlers, once per slide.
            warnings.simplefilter("default")
            return run_batch(
                slides,
                out,
                PipelineFactory(config, card),
                config,
                key,
                force=args.force,
                progress=mode == "bar",
                dask=config.dask,
            )
    finally:
        remove_logging(handlers)


def remove_made(made: list[Path]) -> None:
    """Remove the paths of ``made`` (files, or folders left empty), last first: what a run that
    stopped on a usage error had created. The lock file goes while it is still held, so no other
    run can take it meanwhile."""
    for path in reversed(made):
        with contextlib.suppress(OSError):  # a folder another process wrote into stays
            path.rmdir() if path.is_dir() else path.unlink()
