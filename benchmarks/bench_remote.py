"""Local vs remote tiles/s: ``Pipeline.run`` on the CPU (ONNX Runtime, the shipped pathology model)
of the same SVS and JPEG-tiled TIFF (wsi_pipeline/synthetic/storage.py) read from disk and over
HTTP range requests, with 0 and 20 ms of round-trip latency added by a TCP proxy.

    python benchmarks/bench_remote.py [--size 6144] [--rounds 2] [--json out.json] [--smoke]

The servers are those of the tests (tests/helpers/remote_servers.py): a range-capable HTTP server
on 127.0.0.1 and a user-space proxy that holds each chunk half the added round trip in each
direction. Each run is the whole slide (open, tissue mask, tiles, stitching; no files written);
tiles/s is the tiles read over its seconds, the best of ``--rounds``, the cases
taken in turn. The remote rows also give
the requests and bytes it took to open the slide and to run it. The goals: >= 0.95 of local at
0 ms, >= 0.8 at 20 ms.
"""

from __future__ import annotations

import argparse
import sys
import time

from harness import ROOT, SMOKE_SLIDE_PX, add_common_args, log, machine, synthetic_slide, work_folder, write_json

sys.path.insert(0, str(ROOT / "tests"))

from helpers.remote_servers import LatencyProxy, RangeServer  # noqa: E402

from wsi_pipeline import Pipeline  # noqa: E402
from wsi_pipeline.slide import open_slide  # noqa: E402
from wsi_pipeline.synthetic.storage import write_storage  # noqa: E402

KINDS = {"svs": "slide.svs", "tiff-ycbcr420": "slide.tiff"}
LATENCIES_MS = (0, 20)


def one_run(pipe: Pipeline, source: str) -> tuple[float, int, dict | None]:
    """(tiles/s, tiles, the remote slide's request counts or None) of one whole run of ``source``."""
    t0 = time.perf_counter()
    with open_slide(source) as slide:
        result = pipe.run(slide)
        remote = slide.remote_info() if hasattr(slide, "remote_info") else None
    tiles = int(result.summary["tiles"]["read"])
    return tiles / (time.perf_counter() - t0), tiles, remote


def compare(pipe: Pipeline, server: RangeServer, name: str, rounds: int) -> dict:
    """The best tiles/s of each case over ``rounds``, the cases taken in turn within a round (a
    shared machine's load then weighs on each alike)."""
    proxies = {ms: LatencyProxy(server.port, ms / 2000) for ms in LATENCIES_MS}
    sources = {"local": str(server.folder + "/" + name)}
    sources.update({f"remote_{ms}ms": f"http://127.0.0.1:{p.port}/{name}" for ms, p in proxies.items()})
    best = dict.fromkeys(sources, 0.0)
    info: dict = {}
    try:
        for _ in range(rounds):
            for case, source in sources.items():
                rate, tiles, remote = one_run(pipe, source)
                best[case] = max(best[case], rate)
                info[case] = remote
    finally:
        for p in proxies.values():
            p.close()
    row = {"tiles": tiles, "local_tiles_per_s": round(best["local"], 2)}
    for ms in LATENCIES_MS:
        case = f"remote_{ms}ms"
        row[f"{case}_tiles_per_s"] = round(best[case], 2)
        row[f"ratio_{ms}ms"] = round(best[case] / best["local"], 3)
        row[f"requests_{ms}ms"] = {k: info[case][k] for k in ("open_requests", "open_bytes", "requests", "bytes")}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=6144, help="the slide's side in pixels (default 6144)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each case, the best kept (default 3)")
    ap.add_argument("--folder", help="where the slides are written (default: a temporary folder)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    size, rounds = (SMOKE_SLIDE_PX, 1) if args.smoke else (args.size, args.rounds)
    folder = work_folder("bench-remote-", args.folder)
    source = synthetic_slide(folder / "synth.tiff", size)
    with open_slide(source) as src:
        for kind, name in KINDS.items():
            write_storage(src, folder / name, kind)
    server = RangeServer(str(folder))
    rows = []
    try:
        with Pipeline("nuclei_pathology", backend="ort") as pipe:
            pipe.run(str(folder / KINDS["svs"]))  # the model's first run, untimed
            for kind, name in KINDS.items():
                row = {"kind": kind, **compare(pipe, server, name, rounds)}
                local, tiles = row["local_tiles_per_s"], row["tiles"]
                log(
                    f"{kind}: {tiles} tiles, local {local:.2f} tiles/s; "
                    + ", ".join(
                        f"{ms} ms {row[f'remote_{ms}ms_tiles_per_s']:.2f} ({row[f'ratio_{ms}ms']:.2f} of local, "
                        f"opened in {row[f'requests_{ms}ms']['open_requests']} requests, "
                        f"{row[f'requests_{ms}ms']['requests']} in all)"
                        for ms in LATENCIES_MS
                    )
                )
                rows.append(row)
    finally:
        server.close()
    result = {"size_px": size, "rounds": rounds, "smoke": args.smoke, "rows": rows, **machine()}
    print(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
