"""`Pipeline.run` on the same pixels stored as scanners store them, in one process, with a peer.

    python benchmarks/bench_storage_kinds.py [--slide-px 32768] [--rounds 3] [--json out.json]
    python benchmarks/bench_storage_kinds.py --backend ort --slide-px 8192      # the CPU machine
    python benchmarks/bench_storage_kinds.py --smoke      # seconds: synth and SVS, tiny, one round
    python benchmarks/bench_storage_kinds.py --slides DIR [--kinds ""]   # your own slides beside synth

Writes a synthetic pathology slide (``wsi-pipeline synth``, seed 7; YCbCr 4:2:0 JPEG in 256 px
tiles) and copies its pixels into each storage kind of :mod:`wsi_pipeline.synthetic.storage`
(tiled TIFF 4:2:0 / 4:2:2 / 4:4:4 / RGB JPEG in 240 px tiles, the 4:4:4 and RGB ones with their
pyramid in page 0's SubIFDs, the 4:4:4 one with level 0 alone, Aperio SVS) and, where pydicom is
there, a DICOM WSI series. Each is run through ``Pipeline.run`` (no outputs) with the shipped
pathology model at the card's resolution, and the SVS and synth's TIFF again at ``--coarse-mpp``
(a 20x model on a 40x scan: tiles read from level 0 and resampled). For each it prints the
reader, where and how the stored tiles were decoded (``summary.json``'s ``slide_reader`` and
``tile_decode``), tiles/s (median and best of ``--rounds`` after a warm-up), and the detections'
agreement with synth's TIFF at the same resolution (counts, share matched at IoU >= 0.5).

``--corpus`` adds the same pixels in layouts other writers make (tests/helpers/slide_corpus.py:
e.g. ``aperio-reduced-flagged``, an SVS of RGB JPEG tiles with JPEGTables and component ids 0, 1,
2 whose reduced pages are flagged NewSubfileType 1; ``aperio-no-thumbnail``; an Aperio layout
in another stream flavour: ``aperio-classic@ycbcr-jfif+tables``, YCbCr 4:2:0), and ``--slides``
runs each slide file or DICOM folder given (a folder of them: each entry) as its own row, named by
its file name; both are run again at ``--coarse-mpp``. Their detections are compared with synth's
only where they hold synth's pixels (the corpus rows).

Peers and ceilings: the model alone on device (or host) data; with ``--monai`` (GPU, MONAI
installed), MONAI's ``sliding_window_inference`` over synth's level 0 read whole. On the CPU
(``--backend ort``) each row also gives the ratio to the model alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from harness import (
    ROOT,
    SMOKE_ROUNDS,
    SMOKE_SLIDE_PX,
    add_common_args,
    log,
    machine,
    synthetic_slide,
    work_folder,
    write_json,
)

from wsi_pipeline import Pipeline
from wsi_pipeline.slide import open_slide
from wsi_pipeline.synthetic.storage import STORAGE_KINDS, write_storage

CARD = ROOT / "engines" / "nuclei_pathology.card.json"
# A smoke run's kinds: one tiled TIFF the writer makes and the vendor layout most slides have.
SMOKE_KINDS = "svs"


def match_share(a: np.ndarray, b: np.ndarray, iou_min: float = 0.5) -> float:
    """Share of boxes ``a`` (``N x 4`` x0, y0, x1, y1, level 0) with a box of ``b`` at IoU >= ``iou_min``."""
    if len(a) == 0:
        return 1.0 if len(b) == 0 else 0.0
    if len(b) == 0:
        return 0.0
    cell = 64.0
    cb = np.floor((b[:, :2] + b[:, 2:]) / 2 / cell).astype(np.int64)
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, (x, y) in enumerate(cb.tolist()):
        buckets.setdefault((x, y), []).append(i)
    ca = np.floor((a[:, :2] + a[:, 2:]) / 2 / cell).astype(np.int64)
    matched = 0
    for i, (x, y) in enumerate(ca.tolist()):
        near = [j for dx in (-1, 0, 1) for dy in (-1, 0, 1) for j in buckets.get((x + dx, y + dy), ())]
        if not near:
            continue
        c = b[near]
        ix = np.clip(np.minimum(c[:, 2], a[i, 2]) - np.maximum(c[:, 0], a[i, 0]), 0, None)
        iy = np.clip(np.minimum(c[:, 3], a[i, 3]) - np.maximum(c[:, 1], a[i, 1]), 0, None)
        inter = ix * iy
        union = (a[i, 2] - a[i, 0]) * (a[i, 3] - a[i, 1]) + (c[:, 2] - c[:, 0]) * (c[:, 3] - c[:, 1]) - inter
        if (inter / np.maximum(union, 1e-9) >= iou_min).any():
            matched += 1
    return matched / len(a)


def boxes_of(result) -> np.ndarray:
    d = result.detections
    return np.stack([d["x0"], d["y0"], d["x1"], d["y1"]], axis=1).astype(np.float64)


def sync() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except ImportError:
        pass


def run_kind(pipe: Pipeline, path: str, rounds: int) -> dict:
    pipe.run(path)  # warm-up: the reader's first open, graphs, allocator
    speeds, last = [], None
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        last = pipe.run(path)
        sync()
        speeds.append(last.summary["tiles"]["read"] / (time.perf_counter() - t0))
    s = last.summary
    seconds = s.get("seconds") or {}
    return {
        "tiles": s["tiles"]["read"],
        # The tissue mask's share of the run's seconds, and where its thumbnail came from.
        "mask_share": round(seconds.get("tissue_mask", 0.0) / max(seconds.get("total", 0.0), 1e-9), 3),
        "mask_source": (s.get("tissue") or {}).get("source"),
        "tiles_per_s": [round(v, 1) for v in speeds],
        "median": round(statistics.median(speeds), 1),
        "best": round(max(speeds), 1),
        "slide_reader": s.get("slide_reader"),
        "tile_decode": s.get("tile_decode"),
        "stage_seconds": s.get("seconds"),
        "detections": int(len(last.detections)),
        "_boxes": boxes_of(last),
    }


def _mask_how(source: dict | None) -> str:
    if not source:
        return "none"
    return f"level {source['level']}, {source['decode']}, {source['stored_tiles_decoded']} stored tiles"


def model_alone(pipe: Pipeline) -> float:
    """Tiles/s of the pipeline's backend on tiles already in memory: on CUDA ``bench_gpu``'s
    measure (device data), on the CPU ``bench_cpu_pipeline``'s (the pipeline's own sessions)."""
    backend = pipe.executor.backend
    batch = pipe.batch_size
    if str(getattr(backend, "device", "")).startswith("cuda"):
        from bench_gpu import bench_model_alone

        return bench_model_alone(backend, batch)
    from bench_cpu_pipeline import model_alone as cpu_model_alone

    tiles = np.random.default_rng(0).integers(0, 256, (8 * batch, 512, 512, 3), dtype=np.uint8)
    cpu_model_alone(pipe, tiles[:batch], batch)  # warm-up
    return cpu_model_alone(pipe, tiles, batch)


def monai_sliding_window(pipe: Pipeline, slide_path: str) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_product_gpu import monai_sliding_window as monai

    return monai(slide_path, pipe.executor.backend)


def write_kinds(work: Path, synth: str, kinds: list[str]) -> dict[str, str]:
    paths = {"synth": synth}
    with open_slide(synth) as src:
        for kind in kinds:
            if kind == "dicom":
                # A VL Whole Slide Microscopy series of JPEG Baseline frames (YBR_FULL_422, 256 px),
                # as the tests write them (level 0 held whole: a benchmark-sized slide fits), with
                # synth's levels: with fewer (it had at most 4), the tissue mask of a 32k slide read
                # a 4,096 px level where synth's read a 1,024 px one.
                sys.path.insert(0, str(ROOT / "tests"))
                from helpers import write_dicom_wsi

                t0 = time.perf_counter()
                folder = work / "dicom"
                folder.mkdir(exist_ok=True)
                image = src.read_region((0, 0), 0, src.dimensions)
                levels = len(src.level_dimensions)
                write_dicom_wsi(folder, "slide", image, levels=levels, mpp=src.mpp[0], jpeg="YBR_FULL_422")
                del image
                paths[kind] = str(folder)
            else:
                t0 = time.perf_counter()
                ext = "svs" if kind.startswith("svs") else "tiff"
                paths[kind] = write_storage(src, work / f"{kind}.{ext}", kind)["path"]
            log(f"{kind}: written in {time.perf_counter() - t0:.1f} s")
    return paths


def write_corpus(work: Path, synth: str, names: list[str]) -> dict[str, str]:
    """Synth's pixels in the corpus layouts ``names`` (other writers' layouts, not the project's).

    ``NAME@FLAVOUR`` writes an Aperio layout's tiles in another of the corpus's JPEG stream flavours
    (``aperio-classic@ycbcr-jfif+tables``: YCbCr 4:2:0 with JPEGTables, as many scanners write them;
    the default is the layouts' RGB JPEG)."""
    if not names:
        return {}
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.slide_corpus import FLAVOURS, aperio_layouts, generic_layouts, write_layout

    with open_slide(synth) as src:
        image = src.read_region((0, 0), 0, src.dimensions)
    h, w = image.shape[:2]
    paths = {}
    for name in names:
        layout_name, _, flavour = name.partition("@")
        if flavour and flavour not in FLAVOURS:
            raise SystemExit(f"--corpus {name}: expected a flavour among {', '.join(FLAVOURS)}, found {flavour!r}")
        aperio = aperio_layouts(flavour, width=w, height=h) if flavour else aperio_layouts(width=w, height=h)
        layouts = {lay.name: lay for lay in aperio + ([] if flavour else generic_layouts())}
        if layout_name not in layouts:
            raise SystemExit(f"--corpus {name}: expected a layout among {', '.join(layouts)}, found {layout_name!r}")
        t0 = time.perf_counter()
        paths[f"corpus:{name}"] = str(work / f"{name.replace('@', '.').replace('+', '-')}.svs")
        write_layout(paths[f"corpus:{name}"], layouts[layout_name], image)
        log(f"corpus:{name}: written in {time.perf_counter() - t0:.1f} s")
    return paths


def user_slides(given: list[str]) -> dict[str, str]:
    """Each slide file or DICOM folder of ``given`` (a folder of slides: each of its entries)."""
    out = {}
    for g in given:
        p = Path(g)
        one = p.is_file() or any(p.glob("*.dcm"))
        entries = [p] if one else sorted(e for e in p.iterdir() if not e.name.startswith("."))
        out.update((e.name, str(e)) for e in entries)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slide-px", type=int, default=32768)
    ap.add_argument("--slide", help="a synthetic slide to use instead of writing one")
    # JPEG 2000 is left out by default: encoding a large slide takes minutes; its reads are measured
    # by bench_cpu_pipeline.py --storage svs-j2k.
    ap.add_argument("--kinds", default=",".join([*(k for k in STORAGE_KINDS if k != "svs-j2k"), "dicom"]))
    ap.add_argument("--coarse-mpp", type=float, default=0.5, help="the resampled runs' mpp (0: none)")
    ap.add_argument(
        "--reduced", action="store_true", help="also run the resampled kinds with resample = reduced (CPU reader)"
    )
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--monai", action="store_true")
    ap.add_argument("--work", help="folder for the slides (default: a new temporary one)")
    ap.add_argument("--corpus", default="", help="corpus layouts to write synth's pixels in (comma-separated)")
    ap.add_argument("--slides", nargs="*", default=[], help="slide files, DICOM folders or folders of slides to run")
    add_common_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.slide_px, args.rounds, args.kinds = SMOKE_SLIDE_PX, SMOKE_ROUNDS, SMOKE_KINDS
    work = work_folder("bench_storage_", args.work)
    res: dict = {**machine(gpu=args.backend != "ort"), "smoke": args.smoke}
    synth = args.slide
    if synth is None:
        synth = str(synthetic_slide(work / "synth.tiff", args.slide_px))
    paths = write_kinds(work, synth, [k for k in args.kinds.split(",") if k])
    paths.update(write_corpus(work, synth, [k for k in args.corpus.split(",") if k]))
    extra = user_slides(args.slides)
    paths.update(extra)
    runs = [(kind, None, "area") for kind in paths]
    if args.coarse_mpp:
        coarse = [k for k in ("synth", "svs", *(k for k in paths if k.startswith("corpus:")), *extra) if k in paths]
        runs += [(kind, args.coarse_mpp, "area") for kind in coarse]
        if args.reduced:
            runs += [(kind, args.coarse_mpp, "reduced") for kind in coarse if kind != "synth"]
    pipes: dict = {}
    rows = []
    for kind, mpp, resample in runs:
        if (mpp, resample) not in pipes:
            pipes[mpp, resample] = Pipeline.from_card(
                CARD, backend=args.backend, resample=resample, **({"mpp": mpp} if mpp else {})
            )
        pipe = pipes[mpp, resample]
        kind_label = kind if resample == "area" else f"{kind} (reduced)"
        try:
            row = run_kind(pipe, paths[kind], args.rounds)
        except Exception as exc:  # one kind failing is a finding, not the end of the table
            log(f"{kind} mpp={mpp}: failed: {type(exc).__name__}: {exc}")
            rows.append({"kind": kind, "mpp": mpp, "error": f"{type(exc).__name__}: {exc}"})
            continue
        row.update(kind=kind_label, slide=kind, mpp=mpp, resample=resample)
        rows.append(row)
        log(
            f"{kind_label:14} mpp={mpp or 'card'}: {row['median']:8.1f} tiles/s (best {row['best']:.1f}, "
            f"{row['tiles']} tiles) stages={row['stage_seconds']} reader={row['slide_reader']} "
            f"decode={row['tile_decode']}"
        )
    for (mpp, resample), pipe in pipes.items():
        if resample == "area":
            res[f"model_alone_tiles_per_s_mpp_{mpp or 'card'}"] = round(model_alone(pipe), 1)
    ref = {r["mpp"]: r for r in rows if r["kind"] == "synth" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        alone = res[f"model_alone_tiles_per_s_mpp_{r['mpp'] or 'card'}"]
        r["over_model_alone"] = round(r["median"] / alone, 3)
        if r["mpp"] not in ref or r["slide"] in extra:  # only rows of synth's pixels are compared
            continue
        a, b = r["_boxes"], ref[r["mpp"]]["_boxes"]  # synth's own row is compared too: its boxes stay
        r["count_vs_synth"] = round(len(a) / max(len(b), 1), 4)
        r["matched_vs_synth"] = round(match_share(a, b), 4)
    for r in rows:
        r.pop("_boxes", None)
    if args.monai and "gpu" in res:
        try:
            res["monai"] = monai_sliding_window(pipes[None, "area"], synth)
        except Exception as exc:
            res["monai"] = f"not run: {type(exc).__name__}: {exc}"
    res["rows"] = rows
    synth_median = ref[None]["median"] if None in ref else None
    log(
        "\n| storage | mpp | reader | decode | tiles/s median (best) | vs synth | / model alone "
        "| count, matched vs synth | mask share (source) |"
    )
    log("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            log(f"| {r['kind']} | {r['mpp'] or 'card'} | failed: {r['error']} | | | | | | |")
            continue
        dec = r["tile_decode"] or {}
        how = dec.get("where", "?") + (f" ({dec['decoder']})" if dec.get("decoder") else "")
        vs = f"{r['median'] / synth_median:.2f}" if synth_median and not r["mpp"] else ""
        log(
            f"| {r['kind']} | {r['mpp'] or 'card'} | {(r['slide_reader'] or {}).get('name', '?')} | {how} | "
            f"{r['median']:.0f} ({r['best']:.0f}) | {vs} | {r.get('over_model_alone', '')} | "
            f"{r.get('count_vs_synth', '')}, {r.get('matched_vs_synth', '')} | {r['mask_share']} "
            f"({_mask_how(r['mask_source'])}) |"
        )
    log(f"model alone: { {k: v for k, v in res.items() if k.startswith('model_alone')} }; MONAI: {res.get('monai')}")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
