"""Probe (2026-12-03), fed benchmarks/HISTORY.md "2026-12-03 15:4x–16:1x UTC: JPEG helper processes beside nvJPEG".

``Pipeline.run`` tiles/s on one slide for GPU-decoding settings, in interleaved rounds.

Usage: ``python benchmarks/probes/sweep_gpu_decode.py SLIDE [--rounds 3] [--loader] [--helpers 0,4:7,6]
[--combos 4x3@8:10]``.
One process, one pipeline; each round runs every setting once, so machine drift spreads over all
of them. Prints the median tiles/s per setting and each setting's last ``tile_decode`` record.

``--loader``: ``GPU_DECODE_BATCHES`` executor batches per loader batch x ``GPU_DECODE_THREADS``
loader batches assembled at once. ``--helpers``: libjpeg-turbo helper processes decoding a share
of the stored tiles while nvJPEG decodes the rest (``N`` or ``N:SHARE``, the share out of 16;
``0``: none; :mod:`wsi_pipeline.tiling.jpeg_processes`). ``--combos``: both at once, ``BxT@N:SHARE``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from wsi_pipeline import Pipeline
from wsi_pipeline.tiling import jpeg_processes, slide_loader
from wsi_pipeline.tiling.jpeg_processes import JpegHelpers

LOADER_SETTINGS = [(4, 2), (8, 2), (16, 2), (4, 1), (4, 3), (8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slide")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loader", action="store_true", help="sweep the loader's batches and threads")
    ap.add_argument("--helpers", default=None, help="comma-separated N or N:SHARE")
    ap.add_argument("--combos", default=None, help="comma-separated BxT@N:SHARE (loader and helpers together)")
    args = ap.parse_args()
    helpers: dict[str, JpegHelpers | None] = {}
    combos = [c for c in (args.combos or "").split(",") if c]
    for spec in [*(args.helpers or "").split(","), *(c.partition("@")[2] for c in combos)]:
        if spec and spec not in helpers:
            n, _, share = spec.partition(":")
            helpers[spec] = JpegHelpers(int(n), int(share) if share else None) if int(n) else None
    for h in helpers.values():
        if h is not None:
            h.start_processes()
    settings: list[tuple[str, tuple]] = []
    if args.loader:
        settings += [(f"loader {b}x{t}", ("loader", b, t)) for b, t in LOADER_SETTINGS]
    settings += [
        (f"helpers {k}" + (f" (share {h.tile_share}/16)" if h else ""), ("helpers", h))
        for k, h in helpers.items()
        if args.helpers and k in args.helpers.split(",")
    ]
    for c in combos:
        loader, _, spec = c.partition("@")
        b, _, t = loader.partition("x")
        settings.append((f"loader {loader}, helpers {spec}", ("combo", int(b), int(t), helpers[spec])))
    rates: dict[str, list[float]] = {name: [] for name, _ in settings}
    records: dict[str, dict] = {}
    with Pipeline.from_card(backend="torch", jpeg_helpers=0) as pipe:
        pipe.run(args.slide)  # warm-up: CUDA graphs, cuDNN
        for _ in range(args.rounds):
            for name, setting in settings:
                if setting[0] == "loader":
                    slide_loader.GPU_DECODE_BATCHES, slide_loader.GPU_DECODE_THREADS = setting[1:]
                    pipe.jpeg_helpers = None
                elif setting[0] == "combo":
                    slide_loader.GPU_DECODE_BATCHES, slide_loader.GPU_DECODE_THREADS = setting[1:3]
                    jpeg_processes.KEPT_STAGING = max(2, setting[2])  # a staging buffer per loader thread
                    pipe.jpeg_helpers = setting[3]
                else:
                    slide_loader.GPU_DECODE_BATCHES, slide_loader.GPU_DECODE_THREADS = 4, 2
                    jpeg_processes.KEPT_STAGING = 2
                    pipe.jpeg_helpers = setting[1]
                t0 = time.perf_counter()
                r = pipe.run(args.slide)
                rates[name].append(round(r.summary["tiles"]["read"] / (time.perf_counter() - t0), 1))
                records[name] = r.summary["tile_decode"]
        pipe.jpeg_helpers = None
    for h in helpers.values():
        if h is not None:
            h.close()
    out = {k: {"median": statistics.median(v), "runs": v, "tile_decode": records[k]} for k, v in rates.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
