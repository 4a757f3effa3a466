"""Warnings about one slide: on stderr and in the log as any warning, and in its summary.

A run records the :func:`warn` calls made on its thread while it opens and
tiles a slide (:func:`recording`); ``summary.json`` lists them, with what the
run itself found worth a warning, under ``warnings`` (``summary.summary_warnings``).
A thread of its own per recording: a slide planned on another thread while
one runs records its own.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

from .text_escapes import printable

_local = threading.local()


@contextlib.contextmanager
def recording(into: list[str]) -> Iterator[list[str]]:
    """Append the messages of the :func:`warn` calls made on this thread meanwhile to ``into``."""
    previous = getattr(_local, "into", None)
    _local.into = into
    try:
        yield into
    finally:
        _local.into = previous


def warn(message: str, stacklevel: int = 1) -> None:
    """``warnings.warn(message)``, also recorded for the slide's summary where a run records this thread's.

    Recorded every time, even where the warnings filter shows a repeated message once.
    """
    into = getattr(_local, "into", None)
    if into is not None:
        into.append(message)
    warnings.warn(message, stacklevel=stacklevel + 1)


def format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as one line, "warning: MESSAGE" (no source location: the message names the file);
    the CLI's ``warnings.formatwarning``, and the slide process's."""
    return f"warning: {printable(str(message))}\n"


__all__ = ["format_warning", "recording", "warn"]
