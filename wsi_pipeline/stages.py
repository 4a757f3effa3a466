"""Per-stage wall time and peak memory of a run."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator


class StageTimer:
    """Accumulates seconds per named stage.

    >>> t = StageTimer()
    >>> with t("read"):
    ...     pass
    >>> sorted(t.seconds)
    ['read']
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - t

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.seconds.items()}


def peak_host_memory_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def peak_gpu_memory_mb() -> float | None:
    """Peak CUDA memory allocated by torch in this process (MB), or None without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20
