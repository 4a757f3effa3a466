"""A batch stopped by Ctrl-C or SIGTERM: the stop logged with its moment, the manifest saved.

During the set-up (the output folder cleaned, the slides planned, the slide process started) no
slide has started: the log says which step the stop came in and the manifest is saved as it stands
(slides planned stay pending). While slides run, those under way are marked interrupted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import Terminated
from .jobs import SlideOutcome
from .manifest import Manifest, now

log = logging.getLogger("wsi_pipeline")


@dataclass
class SetUp:
    """How far a batch's set-up went: the step under way, and what it has made that a stop must
    save (the manifest) or end (the slide runner)."""

    step: str = "preparing the output folder"
    manifest: Manifest | None = None
    runner: Any = None


def signal_name(stop: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(stop, Terminated) else "SIGINT (Ctrl-C)"


def was_recorded(stop: KeyboardInterrupt) -> bool:
    """Whether the batch has logged ``stop`` and saved its manifest (a caller outside records it otherwise)."""
    return getattr(stop, _RECORDED, False)


# The attribute a stop carries once recorded: a run's steps are nested, and the innermost records it.
_RECORDED = "wsi_pipeline_recorded"


def record_stop_in_set_up(out: Path, setup: SetUp, stop: KeyboardInterrupt) -> None:
    """Log a stop during the set-up with its moment, end the runner it started, save the manifest."""
    setattr(stop, _RECORDED, True)
    log.warning(
        "run stopped by %s at %s, during set-up (%s), before any slide started: no slide marked",
        signal_name(stop),
        now(),
        setup.step,
    )
    if setup.runner is not None:
        setup.runner.close()
    (setup.manifest if setup.manifest is not None else Manifest(out)).update_records({})


def record_interrupted(
    manifest: Manifest,
    todo: list[tuple[Path, str]],
    outcomes: dict[str, SlideOutcome],
    dask: str | None,
    stop: KeyboardInterrupt,
) -> None:
    """Mark the slides stopped by Ctrl-C or SIGTERM as interrupted, and log the stop: which signal,
    when, and the slides it stopped (a log that just ends would not say why)."""
    setattr(stop, _RECORDED, True)
    name = signal_name(stop)
    # Local slides run one at a time ("running"); on a cluster every unfinished one is under way.
    stopped = [
        (p, n) for p, n in todo if n not in outcomes and (dask or manifest.slides.get(n, {}).get("status") == "running")
    ]
    when = now()
    shown = ", ".join(str(p) for p, _ in stopped) or "no slide under way"
    log.warning("run stopped by %s at %s, while running %s: marked interrupted", name, when, shown)
    manifest.update_records({n: {"status": "interrupted", "finished": when, "stopped_by": name} for _, n in stopped})
