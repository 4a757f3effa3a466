"""Probe (2026-12-06), fed benchmarks/HISTORY.md "2026-12-06 07:xx UTC: objects alive at a pipeline's build
kept out of full collections".

``Pipeline.run`` with the objects alive when the pipeline was built frozen (``wsi_pipeline.long_lived``,
as now) and handed back to the collector before the run (as before), interleaved in one process::

    python benchmarks/probes/ab_gc_freeze.py SLIDE[@MPP] [SLIDE[@MPP] ...] [--rounds 5] [--backend torch]

Prints, per slide and setting, the median tiles/s, its ratio to the first setting's, and the median
count and seconds of the full (generation 2) collections during a run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from wsi_pipeline import Pipeline

_full: list[float] = []
_started: list[float] = []


def _on_gc(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        _full.append(time.perf_counter() - _started[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slides", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args()
    settings = ("before: collector walks everything", "now: frozen at the build")
    gc.callbacks.append(_on_gc)
    pipes: dict[float, Pipeline] = {}
    try:
        for spec in args.slides:
            slide, _, mpp_text = spec.partition("@")
            mpp = float(mpp_text or 0)
            if mpp not in pipes:
                pipes[mpp] = Pipeline.from_card(backend=args.backend, **({"mpp": mpp} if mpp else {}))
            pipe = pipes[mpp]
            pipe.run(slide)  # warm-up
            seen: dict[str, list[tuple[float, int, float]]] = {name: [] for name in settings}
            for _ in range(args.rounds):
                for name in settings:
                    frozen = gc.get_freeze_count()
                    if name.startswith("before"):
                        gc.unfreeze()
                    _full.clear()
                    t0 = time.perf_counter()
                    r = pipe.run(slide)
                    rate = r.summary["tiles"]["read"] / (time.perf_counter() - t0)
                    seen[name].append((rate, len(_full), sum(_full)))
                    if name.startswith("before") and frozen:
                        gc.freeze()  # as the pipeline's build left it
            base = statistics.median(s[0] for s in seen[settings[0]])
            for name, runs in seen.items():
                med = statistics.median(s[0] for s in runs)
                count = statistics.median(s[1] for s in runs)
                secs = statistics.median(s[2] for s in runs)
                rates = " ".join(f"{s[0]:.0f}" for s in runs)
                print(
                    f"{spec} | {name:36} | {med:7.0f} tiles/s | {med / base:.3f}x | "
                    f"full collections {count:.0f} in {secs * 1000:.0f} ms | runs {rates}"
                )
    finally:
        for pipe in pipes.values():
            pipe.close()
        gc.callbacks.remove(_on_gc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
