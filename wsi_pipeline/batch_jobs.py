"""What a batch hands the processes that run its slides, and what comes back.

:class:`PipelineFactory` builds a pipeline where the slides run (a child
process, a Dask worker); :class:`SlideOutcome` is one slide's result as the
batch records it. Kept apart from :mod:`.batch` so that the runners
(:mod:`.slide_worker`, :mod:`.distributed`) need not import the batch itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .config import RunConfig
from .errors import BackendUnavailableError, ConfigError, ModelError, UsageError
from .inference.card import ModelCard


@dataclass
class SlideOutcome:
    """What became of one slide: ``status`` is done, skipped (already done) or failed."""

    name: str
    path: str
    status: str
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    worker: str | None = None
    tiles: int | None = None  # tiles read (None when not run)

    def as_record(self) -> dict[str, Any]:
        return {
            **path_record(self.path),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "counts": self.counts,
            "error": self.error,
            "worker": self.worker,
            "tiles": self.tiles,
        }

    def describe(self) -> str:
        """One line for the log: seconds, tiles read, detections per class."""
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items()) or "no classes"
        tiles = f"{self.tiles} tiles read, " if self.tiles is not None else ""
        return f"{self.path}: done in {self.seconds:.1f} s, {tiles}{counts}"


def path_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """A slide's path for the manifest: absolute (``path``) and as the input gave it (``path_as_given``)."""
    return {"path": os.path.abspath(path), "path_as_given": os.fspath(path)}


@dataclass(frozen=True)
class PipelineFactory:
    """Builds a batch's pipeline (picklable, so that the process that runs the slides builds its own).

    ``card``: a validated card, or None for ``config.model``.
    """

    config: RunConfig
    card: ModelCard | None = None

    def __call__(self) -> Any:
        from .pipeline import Pipeline

        try:
            return Pipeline(self.card or self.config.model, backend=self.config.backend, config=self.config)
        except (ConfigError, ModelError) as exc:
            raise UsageError(str(exc)) from exc
        except BackendUnavailableError as exc:
            if self.config.backend == "auto":
                raise
            raise UsageError(
                f"backend {self.config.backend}: {exc}; --backend ort runs on the CPU, "
                "--backend auto takes the best this machine has"
            ) from exc


__all__ = ["PipelineFactory", "SlideOutcome", "path_record"]
