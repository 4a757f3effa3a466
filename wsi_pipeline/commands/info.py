"""``wsi-pipeline info [SLIDE] [--reader R] [--json]``: what a slide file holds; without one, the shipped models."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import PluginError, UsageError
from ..inference.backend import cuda_may_be_present
from ..inference.shipped import DEFAULT_MODEL_NAME, engines_dir, shipped_names
from ..plugins import load_plugins
from ..slide import BACKENDS, Slide, open_slide, reader_may_crash
from ..slide.isolated import call_isolated
from ..slide.readers import reader_named, reader_names
from ..slide.remote_tiff import RemoteTiffSlide
from ..text_escapes import printable
from ..tiling.gpu_choice import storage_gpu_decoder


def describe(path: str, backend: str = "auto") -> dict:
    """A JSON-ready description of the slide at ``path`` (``backend``: the slide reader). A slide
    whose reader may crash the process on a damaged file (OpenSlide) is read in a helper process:
    a crash is a :class:`~wsi_pipeline.errors.SlideOpenError` naming the file and the signal."""
    reader = reader_named(backend)
    may_crash = reader.may_crash if reader is not None else backend == "auto" and reader_may_crash(path)
    if may_crash:
        return call_isolated(path, "reading it", _describe, path, backend)
    return _describe(path, backend)


def _describe(path: str, backend: str) -> dict:
    with open_slide(path, backend) as slide:
        remote = slide.remote_info() if isinstance(slide, RemoteTiffSlide) else None
        return {
            "path": slide.absolute_path,
            "format": slide.vendor,
            "backend": slide.backend,
            "dimensions": list(slide.dimensions),
            "level_count": slide.level_count,
            "levels": [
                {"level": i, "width": w, "height": h, "downsample": round(d, 4)}
                for i, ((w, h), d) in enumerate(zip(slide.level_dimensions, slide.level_downsamples, strict=True))
            ],
            "level_notes": list(slide.level_notes),
            "mpp": list(slide.mpp) if slide.mpp else None,
            "vendor": slide.vendor,
            "background_rgb": list(slide.background_rgb),
            "storage": slide.stored_tile_format(0),
            "gpu_decode": gpu_decode_info(slide),
            **({"remote": remote} if remote is not None else {}),
        }


def gpu_decode_info(slide: Slide) -> dict:
    """How a run on a CUDA backend would decode level 0's stored tiles, and whether this machine
    has CUDA (``cuda``; without it, a run decodes on the CPU)."""
    decoder, why = storage_gpu_decoder(slide.stored_tile_format(0), slide.backend, 0)
    if decoder == "nvimgcodec" and not _installed("nvidia.nvimgcodec"):
        why += " (nvImageCodec is not installed here: the CPU decodes them; pip install 'wsi-pipeline[gpu]')"
    return {"decoder": decoder, "why": why, "cuda": cuda_may_be_present()}


def _installed(module: str) -> bool:
    """Whether ``module`` can be found (without importing it: nvImageCodec loads CUDA)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def shipped_models() -> dict:
    """The shipped models: their folder, names (for ``--model NAME``) and the default."""
    return {"engines": str(engines_dir()), "models": shipped_names(), "default": DEFAULT_MODEL_NAME}


class _DeprecatedBackend(argparse.Action):
    """``--backend``: the old name of ``--reader`` here (``run --backend`` chooses the inference backend)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("wsi-pipeline info: --backend is deprecated here, use --reader", file=sys.stderr)
        namespace.reader = values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="print a slide's format, size, levels and resolution; without a slide, the shipped models",
    )
    p.add_argument(
        "slide",
        nargs="?",
        help="slide or image file, or a tiled TIFF or SVS at an https:// or s3:// address "
        "(none: list the shipped models)",
    )
    p.add_argument(
        "--reader",
        default="auto",
        help=f"slide reader: {', '.join(BACKENDS)}: tifffile (tiled TIFF), dicom (DICOM WSI of JPEG frames), "
        "openslide (vendor formats), image (PNG, JPEG ...), or one a plugin adds; "
        "auto: the fastest that reads the file (default auto)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        dest="plugins",
        metavar="MODULE",
        help="a module that registers slide readers when imported (repeatable)",
    )
    p.add_argument("--backend", choices=BACKENDS, action=_DeprecatedBackend, help="deprecated: --reader")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.slide is None:
        models = shipped_models()
        if args.json:
            print(json.dumps(models, indent=2))
            return 0
        print(f"shipped models (--model NAME), in {models['engines']}:")
        for name in models["models"]:
            print(f"  {name}" + ("  (default)" if name == models["default"] else ""))
        if not models["models"]:
            print("  none found")
        return 0
    try:
        load_plugins(args.plugins or (), "info")
    except PluginError as exc:
        raise UsageError(str(exc)) from exc
    readers = ("auto", *reader_names())
    if args.reader not in readers:
        raise UsageError(f"--reader: expected one of {', '.join(readers)}, found {args.reader!r}")
    info = describe(args.slide, args.reader)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    w, h = info["dimensions"]
    mpp = info["mpp"]
    print(printable(info["path"]))
    print(f"  format   {info['format']}  (read with {info['backend']})")
    storage = info["storage"]
    if storage is not None:
        kind = storage.get("jpeg_kind")
        print(f"  tiles    {storage['compression']}" + (f" ({kind})" if kind else ""))
    gpu = info["gpu_decode"]
    print(f"  on CUDA  {gpu['why']}" if gpu["decoder"] else f"  on CUDA  decoded on the CPU: {gpu['why']}")
    if not gpu["cuda"]:
        print("           (no CUDA GPU on this machine: a run here decodes every tile on the CPU)")
    print(f"  size     {w} x {h} px" + (f"  ({w * mpp[0] / 1000:.2f} x {h * mpp[1] / 1000:.2f} mm)" if mpp else ""))
    print(f"  mpp      {mpp[0]:.4f} x {mpp[1]:.4f} um/px" if mpp else "  mpp      unknown")
    remote = info.get("remote")
    if remote is not None:
        print(
            f"  remote   {remote['size']} bytes, ETag {remote['etag'] or '-'}; opened in {remote['open_requests']} "
            f"requests ({remote['open_bytes']} bytes)"
        )
    print(f"  levels   {info['level_count']}")
    for lv in info["levels"]:
        print(f"    {lv['level']}: {lv['width']} x {lv['height']}  downsample {lv['downsample']:g}")
    for note in info["level_notes"]:
        print(f"    note: {note}")
    return 0
