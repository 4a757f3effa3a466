"""Where ``wsi-pipeline run`` reports while it works: ``run.log`` and stderr.

``--progress``: ``bar`` draws tqdm bars (log lines go through ``tqdm.write``
so the bars stay whole), ``log`` writes a timestamped line when each slide
starts and ends, ``none`` neither; ``auto`` is ``bar`` on a terminal and
``log`` otherwise (nohup, cron, a batch scheduler). Warnings and errors
reach stderr in every mode; ``--quiet`` leaves only errors. ``run.log``
keeps everything.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..batch.folder import BatchLogHandler
from ..text_escapes import OneLineFormatter

PROGRESS_CHOICES = ("auto", "bar", "log", "none")


def progress_mode(choice: str, quiet: bool, stderr_is_terminal: bool) -> str:
    """``bar``, ``log`` or ``none``: what stderr shows while slides run (see ``--progress``)."""
    if quiet:
        return "none"
    if choice == "auto":
        return "bar" if stderr_is_terminal else "log"
    return choice


class _LineFormatter(OneLineFormatter):
    """Timestamped single lines; a captured warning loses the "warning: " prefix and newline
    that :func:`warnings.formatwarning` gives it (the level says it)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.name == "py.warnings":
            record.message = record.message.strip().removeprefix("warning: ")
        return super().formatMessage(record)


class _StderrHandler(logging.Handler):
    """Log lines on stderr, written through tqdm while its bars are drawn there."""

    def __init__(self, level: int, bars: bool):
        super().__init__(level)
        self.bars = bars
        self.setFormatter(_LineFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if self.bars:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stderr)
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


def setup_logging(log_file: Path, mode: str, quiet: bool) -> list[logging.Handler]:
    """The ``wsi_pipeline`` log and captured warnings: everything into ``log_file``; to stderr
    errors (``quiet``), else warnings, and in ``log`` mode also each slide's start and end."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = BatchLogHandler(log_file)
    to_file.setFormatter(_LineFormatter())
    level = logging.ERROR if quiet else logging.INFO if mode == "log" else logging.WARNING
    handlers = [to_file, _StderrHandler(level, bars=mode == "bar")]
    logger = logging.getLogger("wsi_pipeline")
    logger.setLevel(logging.INFO)
    logging.captureWarnings(True)
    for h in handlers:
        logger.addHandler(h)
        logging.getLogger("py.warnings").addHandler(h)
    return handlers


def remove_logging(handlers: list[logging.Handler]) -> None:
    """Detach and close what :func:`setup_logging` attached."""
    for h in handlers:
        logging.getLogger("wsi_pipeline").removeHandler(h)
        logging.getLogger("py.warnings").removeHandler(h)
        h.close()
