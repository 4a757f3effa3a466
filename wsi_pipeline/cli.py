"""The ``wsi-pipeline`` command line.

Each sub-command lives in :mod:`wsi_pipeline.commands` as a module with
``register(subparsers)``; this file only dispatches and turns the pipeline's
own errors into one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
import threading
import warnings
from collections.abc import Iterator

from .errors import Terminated, UsageError, WSIPipelineError
from .extras import missing_extra
from .slide_warnings import format_warning
from .text_escapes import printable

# Sub-command modules, in the order ``--help`` lists them.
COMMANDS = ["run", "synth", "info", "quantize", "train", "build_engine", "card"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="wsi-pipeline",
        description="Whole-slide image tiling inference.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f".commands.{name}", __package__)
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = format_warning
    # The readers report a bad file as one error of their own; the TIFF
    # library's log lines about the same damage would only repeat it.
    logging.getLogger("tifffile").setLevel(logging.CRITICAL)
    # pydicom logs an encoder's or decoder's failure with its traceback before raising it: the
    # slide's one-line failure already says it (the slide process copies this level).
    logging.getLogger("pydicom").setLevel(logging.CRITICAL)
    command = "wsi-pipeline"
    try:
        with sigterm_as_interrupt():
            # Building the parser imports every command's module: Ctrl-C there is an interruption too.
            args = build_parser().parse_args(argv)
            command = f"wsi-pipeline {args.command}"
            return int(args.func(args) or EXIT_OK)
    except UsageError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        # An optional package a command reached without asking extras.require first: the same
        # one line naming the extra; any other missing module is a broken install, shown as it is.
        missing = missing_extra(command, exc)
        if missing is None:
            raise
        print(f"error: {printable(missing)}", file=sys.stderr)
        return EXIT_USAGE
    except WSIPipelineError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except Terminated:
        print("terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, MemoryError) as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
