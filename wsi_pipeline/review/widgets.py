"""Interactive controls for a notebook: a score slider and a region picker (needs ipywidgets).

Both return None, and say why, where ipywidgets is not installed or no
Jupyter kernel is running; the plain figures of :mod:`.figures` do the same
work non-interactively.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .results import ReviewRun

# Set in a kernel's environment by a front end that draws widgets: Jupyter Server (JupyterLab,
# Notebook 7, Voila) names the kernel's session; VS Code runs its kernels with its own variables.
FRONT_END_VARIABLES = ("JPY_SESSION_NAME", "VSCODE_PID")
WIDGETS_VARIABLE = "WSI_NB_WIDGETS"


def widgets_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a notebook should show its widgets: ``WSI_NB_WIDGETS=1`` or ``0`` where set, else
    only under a live front end (a headless run, nbclient or nbconvert, may wait on their output).
    """
    env = os.environ if environ is None else environ
    said = env.get(WIDGETS_VARIABLE, "").strip()
    if said in ("0", "1"):
        return said == "1"
    return any(env.get(v) for v in FRONT_END_VARIABLES)


def widgets_available() -> bool:
    """True where ipywidgets imports and a Jupyter kernel is live."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _unavailable(what: str) -> None:
    print(
        f"{what}: needs ipywidgets in a running Jupyter kernel (pip install 'wsi-pipeline[notebooks]'); "
        "use the figures of wsi_pipeline.review instead"
    )


def score_slider(run: ReviewRun, step: float = 0.01, **overview: Any) -> Any:
    """A score-range slider redrawing the overview and counts for the detections inside the range.

    ``overview``: keyword arguments for :func:`~.figures.plot_overview`.
    Returns the ipywidgets control, or None where widgets are unavailable.
    """
    if not widgets_available():
        _unavailable("score_slider")
        return None
    import ipywidgets as w
    import matplotlib.pyplot as plt

    from .figures import plot_counts, plot_overview

    slider = w.FloatRangeSlider(
        value=(0.0, 1.0),
        min=0.0,
        max=1.0,
        step=step,
        description="score",
        continuous_update=False,
        readout_format=".2f",
    )

    def redraw(score: tuple[float, float]) -> None:
        sub = run.filter(min_score=score[0], max_score=score[1])
        plot_overview(sub, **overview)
        plot_counts(sub)
        plt.show()

    return w.interactive(redraw, score=slider)


def region_picker(run: ReviewRun, size: int = 512, show_scores: bool = False) -> Any:
    """Sliders for a level-0 region (x0, y0, side) drawing :func:`~.figures.plot_region` at full resolution.

    Returns the ipywidgets control, or None where widgets are unavailable.
    """
    if not widgets_available():
        _unavailable("region_picker")
        return None
    import ipywidgets as w
    import matplotlib.pyplot as plt

    from .figures import plot_region

    width, height = run.dimensions
    side0 = min(size, width, height)
    x = w.IntSlider(value=0, min=0, max=max(0, width - 16), step=16, description="x0 (px)", continuous_update=False)
    y = w.IntSlider(value=0, min=0, max=max(0, height - 16), step=16, description="y0 (px)", continuous_update=False)
    s = w.IntSlider(
        value=side0,
        min=16,
        max=min(4096, max(width, height)),
        step=16,
        description="side (px)",
        continuous_update=False,
    )

    def redraw(x0: int, y0: int, side: int) -> None:
        plot_region(run, x0, y0, min(side, width - x0), min(side, height - y0), show_scores=show_scores)
        plt.show()

    return w.interactive(redraw, x0=x, y0=y, side=s)


__all__ = ["region_picker", "score_slider", "widgets_available"]
