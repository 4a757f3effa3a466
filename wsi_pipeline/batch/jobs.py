"""What a batch hands the processes that run its slides, and what comes back.

:class:`PipelineFactory` builds a pipeline where the slides run (a child
process, a Dask worker); :func:`process_slide` (or :func:`start_slide` and
:meth:`StartedSlide.finish`) runs one slide into its folder, atomically;
:class:`SlideOutcome` is one slide's result as the batch records it. Kept
apart from :mod:`.runner` so that the runners (:mod:`.slide_runners`,
:mod:`.distributed`) need not import the batch itself.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import BackendUnavailableError, ConfigError, ModelError, UsageError
from ..file_identity import input_identity
from ..inference.card_spec import ModelCard
from ..remote.address import is_remote, shown_address
from .folder import remove_or_warn, slide_dir, slides_dir
from .resume import RunKey

log = logging.getLogger("wsi_pipeline")
_counter = itertools.count()  # distinct partial and old folder names within a process


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
    warnings: list[str] = field(default_factory=list)  # its summary's warnings

    def as_record(self) -> dict[str, Any]:
        return {
            **path_record(self.path),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "counts": self.counts,
            "error": self.error,
            "worker": self.worker,
            "tiles": self.tiles,
            "warnings": self.warnings,
        }

    @property
    def warned(self) -> str:
        """`` (N warnings)`` where its summary has warnings, else empty."""
        n = len(self.warnings)
        return f" ({n} warning{'s' if n > 1 else ''})" if n else ""

    def describe(self) -> str:
        """One line for the log: seconds, tiles read, detections per class, warnings."""
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items()) or "no classes"
        tiles = f"{self.tiles} tiles read, " if self.tiles is not None else ""
        return f"{self.path}: done in {self.seconds:.1f} s, {tiles}{counts}{self.warned}"


def path_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """A slide's path for the manifest: absolute (``path``) and as the input gave it (``path_as_given``);
    a remote address's without credentials, both."""
    if is_remote(path):
        shown = shown_address(path)
        return {"path": shown, "path_as_given": shown}
    return {"path": os.path.abspath(path), "path_as_given": os.fspath(path)}


@dataclass(frozen=True)
class PipelineFactory:
    """Builds a batch's pipeline (picklable, so that the process that runs the slides builds its own).

    ``card``: a card read and validated, or None for ``config.model``. Its model file is checked
    against it here (:func:`~.inference.card.verify_model_file`), where the pipeline is built: the
    parent of a batch reads the card without that check, which imports ``onnx``.
    """

    config: RunConfig
    card: ModelCard | None = None

    def __call__(self) -> Any:
        from ..inference.model_signature import verify_model_file
        from ..pipeline import Pipeline

        try:
            if self.card is not None:
                verify_model_file(self.card)
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


# -- one slide ------------------------------------------------------------------


def process_slide(
    pipeline: Any,
    path: str | os.PathLike[str],
    name: str,
    out_dir: str | os.PathLike[str],
    key: RunKey,
    progress: bool | Callable[[int], None] = False,
) -> SlideOutcome:
    """Run ``pipeline`` on one slide into ``out_dir/slides/name`` (atomically); never raises for a bad
    slide, a failed write included (a full disk fails the slide)."""
    return start_slide(pipeline, path, name, out_dir, key, progress).finish()


def start_slide(
    pipeline: Any,
    path: str | os.PathLike[str],
    name: str,
    out_dir: str | os.PathLike[str],
    key: RunKey,
    progress: bool | Callable[[int], None] = False,
    wait_written: bool = True,
    plan: Any = None,
) -> StartedSlide:
    """Run ``pipeline`` on one slide into a partial folder; :meth:`StartedSlide.finish` completes it.

    With ``wait_written=False`` this returns once the slide's tiles are through the model, while its
    stitching ends and its files are written on the pipeline's threads: the next slide's inference
    can run while ``finish`` (in another thread) waits for them. ``plan``: the slide's
    :class:`~..slide_plan.SlidePlan`, made ahead (None: made now).
    Never raises for a bad slide (its ``finish`` returns the failure)."""
    folder = slides_dir(out_dir)
    started = StartedSlide(
        name,
        str(path),
        slide_dir(out_dir, name),
        folder,
        folder / f".{name}.partial-{os.getpid()}-{next(_counter)}",
        time.perf_counter(),
    )
    run_started = False
    try:
        extra = {
            "run_key": key.value,
            "run_key_parts": key.parts,
            "input": input_identity(path, key.slide_hash),
            "name": name,
        }
        folder.mkdir(parents=True, exist_ok=True)
        kwargs = {} if wait_written else {"wait_written": False}
        run_started = True  # the run closes the plan, whatever happens
        started.result = pipeline.run(
            path if plan is None else plan,
            out_dir=started.partial,
            progress=progress,
            keep_heatmap=False,
            extra_summary=extra,
            **kwargs,
        )
    except KeyboardInterrupt:
        started.discard("the outputs of an interrupted slide")
        raise
    except Exception as exc:
        started.fail(exc)
    finally:
        if plan is not None and not run_started:
            plan.close()
    return started


@dataclass
class StartedSlide:
    """A slide run into ``partial``, to be moved to ``final`` once its files are written."""

    name: str
    path: str
    final: Path
    folder: Path
    partial: Path
    t0: float
    result: Any = None
    outcome: SlideOutcome | None = None

    def fail(self, exc: BaseException) -> None:
        self.discard("the outputs of a failed slide")
        log.debug("slide %s failed", self.path, exc_info=exc)
        self.outcome = SlideOutcome(
            self.name, self.path, "failed", time.perf_counter() - self.t0, error=_describe(exc, self.path, self.folder)
        )

    def discard(self, what: str = "the outputs of a slide not asked for") -> None:
        wait = getattr(self.result, "wait_written", None)
        if wait is not None:
            with contextlib.suppress(Exception):
                wait()  # the writers let go of the folder before it goes
        remove_or_warn(self.partial, what)

    def finish(self) -> SlideOutcome:
        """Wait for the files, move the folder into place; the slide's outcome (never raises for it)."""
        if self.outcome is not None:
            return self.outcome
        try:
            wait = getattr(self.result, "wait_written", None)
            if wait is not None:
                wait()
            if os.path.lexists(self.final):
                # Whatever is there (an older result, a file, a read-only folder) gives way to the new result.
                old = self.folder / f".{self.name}.old-{os.getpid()}-{next(_counter)}"
                os.replace(self.final, old)
                os.replace(self.partial, self.final)
                remove_or_warn(old, "the slide's previous outputs")
            else:
                os.replace(self.partial, self.final)
            summary = self.result.summary
            self.outcome = SlideOutcome(
                self.name,
                self.path,
                "done",
                time.perf_counter() - self.t0,
                dict(summary["counts"]),
                tiles=(summary.get("tiles") or {}).get("read"),
                warnings=list(summary.get("warnings") or []),
            )
        except KeyboardInterrupt:
            self.discard("the outputs of an interrupted slide")
            raise
        except Exception as exc:
            self.fail(exc)
        return self.outcome


def _describe(exc: BaseException, path: Any, folder: Path) -> str:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        msg = f"out of disk space writing into {folder}: {msg}"
    text = msg if str(path) in msg else f"{path}: {msg}"
    return text if type(exc).__module__.startswith("wsi_pipeline") else f"{type(exc).__name__}: {text}"


__all__ = ["PipelineFactory", "SlideOutcome", "StartedSlide", "path_record", "process_slide", "start_slide"]
