"""Exceptions raised by wsi-pipeline.

Every error a user can cause carries the file it concerns and what was
expected against what was found, so that the CLI can print one line and
exit non-zero without a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class Terminated(KeyboardInterrupt):
    """SIGTERM (what a scheduler sends to stop a job), handled as Ctrl-C is: the slide under way is
    marked interrupted, its partial folder removed, the child processes ended."""


class WSIPipelineError(Exception):
    """Base class of every error the pipeline raises on bad input or state."""


class SlideError(WSIPipelineError):
    """A slide cannot be opened or read.

    ``path`` is the slide file, ``reason`` says what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str] | None, reason: str):
        self.path = os.fspath(path) if path is not None else None
        self.reason = reason
        super().__init__(f"{self.path}: {reason}" if self.path else reason)

    def __reduce__(self):  # pickled whole (its type, message and fields) to cross to another process
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class SlideOpenError(SlideError):
    """A slide file cannot be opened: unknown format, damaged header, impossible geometry,
    or a size beyond what the reader may allocate."""


class RemoteReadError(SlideError):
    """A remote slide's server refused a request, failed, stopped answering or sent a short body
    (after the retries of a transient failure). ``path`` is the address without credentials."""


class SpecialFileError(WSIPipelineError):
    """A path the program would open (a slide's companion file, an output) is a FIFO, socket or
    device: opening it could wait for ever, or never end; or one of the program's own files of an
    output folder is a symbolic link: writing it would write the file it names."""

    def __init__(self, path: str | os.PathLike[str], kind: str):
        self.path = os.fspath(path)
        self.kind = kind
        super().__init__(f"{self.path}: {kind}, not a regular file (refused before opening it)")


class TileReadError(SlideError):
    """One region of a slide cannot be read or decoded (a corrupt tile)."""

    def __init__(self, path, reason: str, location=None, level=None):
        self.location = location
        self.level = level
        where = ""
        if location is not None:
            where = f" at level-0 {tuple(int(v) for v in location)}"
            if level is not None:
                where += f", level {level}"
        super().__init__(path, f"{reason}{where}")


class ModelError(WSIPipelineError):
    """A model file or its card is missing, corrupt or inconsistent."""


class InferenceError(WSIPipelineError):
    """The model failed on a batch of tiles.

    ``tile_ids``: the batch's tiles (grid indices, or the ids the caller
    gave); ``sequence``: the batch's number in its run, where it has one.
    """

    def __init__(self, reason: str, tile_ids: Sequence[int] = (), sequence: int | None = None):
        self.tile_ids = list(tile_ids)
        self.sequence = sequence
        self.reason = reason
        shown = self.tile_ids if len(self.tile_ids) <= 16 else [*self.tile_ids[:8], "...", *self.tile_ids[-4:]]
        batch = f"batch {sequence} " if sequence is not None else ""
        super().__init__(f"inference failed on {batch}(tiles {shown}): {reason}")


class ClosedError(WSIPipelineError, ValueError):
    """An object (slide, loader, executor, service, pipeline) used after it was closed."""


class ConfigError(WSIPipelineError):
    """A configuration value or file is invalid."""


class PluginError(ConfigError):
    """A plugin module that cannot be imported, or an extension registered in a way that cannot
    reach the processes a run starts (:mod:`wsi_pipeline.plugins`)."""


class BackendUnavailableError(WSIPipelineError):
    """An inference backend was asked for that this machine cannot run."""


class UsageError(WSIPipelineError):
    """The command line or its config cannot start a run (exit code 2)."""


class MissingExtraError(UsageError):
    """What was asked for needs a package of an optional extra that is not installed (exit code 2).

    ``what``: the command or function; ``module``: the package missing; ``extra``: the extra of
    ``pip install 'wsi-pipeline[EXTRA]'`` that brings it.
    """

    def __init__(self, what: str, module: str, extra: str):
        self.what, self.module, self.extra = what, module, extra
        super().__init__(f"{what} needs {module}, which is not installed: pip install 'wsi-pipeline[{extra}]'")
