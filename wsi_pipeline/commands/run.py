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
from ..batch.stops import SetUp, record_stop_in_set_up, was_recorded
from ..config import BATCH, DAMAGE, INFERENCE, INPUT, OUTPUT, TILING, RunConfig, load_config
from ..errors import ConfigError, ModelError, UsageError
from ..text_escapes import printable
from .run_log import PROGRESS_CHOICES, progress_mode, remove_logging, setup_logging
from .run_options import add_setting_flags, apply_flags

DESCRIPTION = """\
Detect over slides into DIR, one folder per slide, resumable.

Exit code 0 when every slide succeeded (or was already done), 1 when some
failed, 2 when the command line or config cannot start a run.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="detect over slides into an output folder (resumable batch)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(p)
    for section in (TILING, INFERENCE, OUTPUT):
        add_setting_flags(p, section)
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
    add_setting_flags(p, INPUT)


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """How the batch treats its slides: damaged tiles, settings file, cluster, time limit, resume."""
    add_setting_flags(p, DAMAGE)
    p.add_argument("--config", metavar="FILE", help="TOML file with the same settings")
    add_setting_flags(p, BATCH)
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
        values = apply_flags(config.as_dict(), args)
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
    try:
        log.info("run: %d slides into %s, run key %s, config %s", len(slides), out, key.value, config.as_dict())
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
    except KeyboardInterrupt as stop:
        if not was_recorded(stop):  # before the batch took the folder
            record_stop_in_set_up(out, SetUp("opening the log"), stop)
        raise
    finally:
        remove_logging(handlers)


def remove_made(made: list[Path]) -> None:
    """Remove the paths of ``made`` (files, or folders left empty), last first: what a run that
    stopped on a usage error had created. The lock file goes while it is still held, so no other
    run can take it meanwhile."""
    for path in reversed(made):
        with contextlib.suppress(OSError):  # a folder another process wrote into stays
            path.rmdir() if path.is_dir() else path.unlink()
