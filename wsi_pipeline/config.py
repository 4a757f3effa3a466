"""Run configuration: the CLI flags as a validated dataclass, loadable from TOML.

A config file holds the same names as ``wsi-pipeline run``'s flags (with
``_`` for ``-``), at top level or under ``[run]``::

    model = "engines/nuclei_pathology.card.json"
    backend = "ort"
    tile = 512
    overlap = 64
    mpp = 0.5
    min_tissue = 0.05
    formats = ["geojson.gz", "parquet", "ome-tiff", "overlay"]
    plugins = ["my_package.my_decoder"]   # modules that register decoders, formats, readers

Relative paths in a config file (``model``, ``mask``) are relative to the
file's folder. Unknown keys, wrong types and impossible values (an overlap as
large as the tile, a NaN resolution, a batch of 100,000 tiles) are refused
with the file and key named.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, SpecialFileError
from .inference.backend import BACKEND_CHOICES
from .inference.card_spec import MAX_MPP, MAX_TILE, MIN_MPP
from .io.formats import DEFAULT_FORMATS, FORMATS, parse_formats
from .plugins import load_plugins
from .slide.damage import DAMAGED_TILE_CHOICES
from .special_files import open_regular
from .stitch.policies import MERGE_POLICIES
from .stitch.weights import KINDS as BLEND_KINDS
from .validation import is_int, is_number

TISSUE_CHOICES = ("auto", "otsu", "all", "file")
MERGE_CHOICES = tuple(MERGE_POLICIES)
BLEND_CHOICES = BLEND_KINDS
DECODE_CHOICES = ("auto", "cpu", "gpu")
# How a grid read at a resolution between stored levels is made: "area" (the finer level decoded
# whole and shrunk with OpenCV's INTER_AREA, on the CPU or the GPU), or "reduced" (JPEG tiles
# decoded at 1/2, 1/4 or 1/8 in the DCT domain where the factor allows, on the CPU reader).
RESAMPLE_CHOICES = ("area", "reduced")
# How resume fingerprints a slide file (file_identity.input_identity): sampled blocks, or its whole content.
SLIDE_HASH_CHOICES = ("sampled", "full")

# Upper bounds of the sizing settings: far above any useful value, low enough
# that a typo cannot ask for thousands of threads or a batch of gigabytes.
MAX_BATCH_SIZE = 1024
MAX_STREAMS = 32
MAX_WORKERS = 256
MAX_OVERLAY_SIZE = 16384
# A path setting longer than the system's limits cannot name a file (ENAMETOOLONG at open).
MAX_PATH_CHARS, MAX_NAME_BYTES = 4096, 255
# local:N workers, each a process holding a pipeline: at most one per CPU.
LOCAL_DASK = "local:"
# Settings that name files: a relative path in a config file is relative to that file's folder.
PATH_KEYS = ("model", "mask")


@dataclass(frozen=True)
class CliOption:
    """How a setting is given on ``wsi-pipeline run``'s command line: its help, and the part of
    ``--help`` it stands in (``section``). ``help`` may be a function, called when the parser is
    built (texts naming what plugins or the installed models add). ``exclusive``: settings of one
    name exclude each other; ``append``: a repeatable flag whose values add to the config file's."""

    section: str
    help: str | Callable[[], str]
    metavar: str | None = None
    flag: str | None = None  # default: --NAME with - for _
    exclusive: str | None = None
    append: bool = False


def option(default: Any = None, cli: CliOption | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A RunConfig field: its default, its command-line flag (None: a config-file key only) and the
    values it may take (checked by :meth:`RunConfig.validate`, offered by the flag)."""
    return field(default=default, metadata={"cli": cli, "choices": choices})


def _model_help() -> str:
    from .inference.shipped import DEFAULT_MODEL_NAME, shipped_names

    return (
        "model card, or a shipped model by name: "
        f"{', '.join(shipped_names()) or 'none found'} (default: {DEFAULT_MODEL_NAME})"
    )


def decode_help() -> str:
    """``--decode``'s help, from the table of GPU decoders by JPEG kind (tiling/gpu_choice.py)."""
    from .tiling.gpu_choice import GPU_DECODER_BY_COLOUR

    kinds = ", ".join(f"{colour} by {decoder}" for colour, decoder in GPU_DECODER_BY_COLOUR.items())
    return (
        "where stored JPEG tiles are decoded: auto (on the GPU with a CUDA backend, for baseline JPEG "
        f"tiles of a tiled TIFF, Aperio SVS or DICOM WSI: {kinds}; else on the CPU), cpu, or gpu "
        "(refuse slides it cannot take). wsi-pipeline info SLIDE says which a slide gets"
    )


def _formats_help() -> str:
    return (
        "output files of each slide, comma-separated: "
        + "; ".join(f"{f.name}: {f.filename}, {f.about}" for f in FORMATS.values())
        + f". Default {','.join(DEFAULT_FORMATS)}. "
        + "; ".join(f"{f.name} needs pip install 'wsi-pipeline[{f.extra}]'" for f in FORMATS.values() if f.extra)
        + ". docs/outputs.md says which to pick"
    )


# The sections of ``wsi-pipeline run --help`` the settings stand in, in order.
INPUT, TILING, INFERENCE, OUTPUT, DAMAGE, BATCH = "input", "tiling", "inference", "output", "damage", "batch"


@dataclass
class RunConfig:
    """Everything that decides a run's result (and so its resume key): each field is a config-file
    key, and those with a :class:`CliOption` a flag of ``wsi-pipeline run`` too."""

    model: str | None = option(None, CliOption(INPUT, _model_help, metavar="CARD"))
    backend: str = option(
        "auto",
        CliOption(INPUT, "default auto: TensorRT, torch on CUDA, ONNX Runtime; torch for a .pt2 model"),
        BACKEND_CHOICES,
    )
    # default: the model card's input size
    tile: int | None = option(None, CliOption(TILING, "tile size in pixels (must match the model's input)"))
    overlap: int = option(64, CliOption(TILING, "tile overlap in pixels (default 64)"))
    # default: the model card's mpp
    mpp: float | None = option(
        None, CliOption(TILING, "read at this resolution, um/px (default: the model's)", exclusive="resolution")
    )
    level: int | None = option(None, CliOption(TILING, "read this pyramid level as it is", exclusive="resolution"))
    # auto: otsu for models with an mpp, all for industrial ones
    tissue: str = option(
        "auto",
        CliOption(
            TILING,
            "which tiles to read: otsu (tissue found on a thumbnail), all, or file (--mask); "
            "default auto: otsu for a model with an mpp (pathology), all for one without (industrial)",
        ),
        TISSUE_CHOICES,
    )
    mask: str | None = option(
        None, CliOption(TILING, "with --tissue file: mask image or GeoJSON polygons", metavar="PATH")
    )
    min_tissue: float = option(0.05, CliOption(TILING, "minimum tissue fraction of a tile (default 0.05)"))
    batch_size: int | None = option(None, CliOption(INFERENCE, "tiles per batch (default: from device memory)"))
    # tile reader threads; default from the CPU count
    workers: int | None = option(
        None, CliOption(INFERENCE, "tile reader threads for CPU decoding (default: CPU cores - 2, 2 to 4)")
    )
    # stored tiles: auto = on the GPU where the backend and the slide allow
    decode: str = option("auto", CliOption(INFERENCE, decode_help), DECODE_CHOICES)
    resample: str = option(
        "area",
        CliOption(
            INFERENCE,
            "a grid between stored levels (--mpp): area (default: the finer level decoded whole, shrunk "
            "as OpenCV's INTER_AREA, on the CPU or GPU) or reduced (JPEG tiles decoded at 1/2, 1/4 or 1/8 in "
            "the DCT domain on the CPU: faster, within a few grey levels of area)",
        ),
        RESAMPLE_CHOICES,
    )
    streams: int | None = option(
        None,
        CliOption(
            INFERENCE,
            "concurrent inference streams / sessions (default: 4 CUDA streams on a GPU, "
            "2 ONNX Runtime sessions on the CPU)",
        ),
    )
    score_threshold: float | None = option(
        None,
        CliOption(
            INFERENCE,
            "drop detections below this score (default: keep what the model card's decoder "
            "keeps, its score_threshold, 0.3 for the shipped models)",
        ),
    )
    nms_iou: float = option(0.5, CliOption(INFERENCE, "overlap threshold of the box merge (default 0.5)"))
    nms_metric: str = option("iou", None, ("iou", "ios"))
    merge: str = option("nms", CliOption(INFERENCE, "box merge across tiles (default nms)"), MERGE_CHOICES)
    drop_edge_boxes: bool = option(True)
    blend: str = option(
        "gaussian",
        CliOption(INFERENCE, "weights that blend overlapping tiles' heatmaps (default gaussian)"),
        BLEND_CHOICES,
    )
    sigma_scale: float = option(0.125)
    # Output files (names in io/formats.py): a list, or one string "geojson.gz,parquet".
    formats: tuple[str, ...] = option(DEFAULT_FORMATS, CliOption(OUTPUT, _formats_help, metavar="NAMES"))
    overlay_size: int = option(2048, CliOption(OUTPUT, "overlay.png's longer side in pixels (default 2048)"))
    # warn: log it and list it in the summary; fail: the slide fails
    on_damaged_tile: str = option(
        "warn",
        CliOption(
            DAMAGE,
            "a stored tile that decodes with corrupt data: warn (default; logged and listed in "
            "summary.json) or fail the slide",
        ),
        DAMAGED_TILE_CHOICES,
    )
    # Modules that register decoders, formats or slide readers when imported (wsi_pipeline.plugins):
    # imported here and in every process the run starts, with the installed packages' entry points.
    plugins: tuple[str, ...] = option(
        (),
        CliOption(
            BATCH,
            "a module that registers decoders, output formats or slide readers when imported, "
            "imported here and in every process of the run (repeatable; added to the config file's plugins)",
            metavar="MODULE",
            flag="--plugin",
            append=True,
        ),
    )
    dask: str | None = option(
        None, CliOption(BATCH, "run slides on a dask cluster: local:N or a scheduler address", metavar="ADDRESS")
    )
    # Wall-clock limit of one slide in seconds; None: 1 h plus 1 h per GiB of slide file; 0: no limit.
    slide_timeout: float | None = option(
        None,
        CliOption(
            BATCH,
            "stop a slide after this long and record it as failed (default: 1 h plus 1 h per GiB "
            "of slide file; 0: no limit, slides run in this process)",
            metavar="SECONDS",
        ),
    )
    # Resume's fingerprint of a slide file: "sampled" (head, tail, 16 blocks; with its size, mtime and
    # inode), or "full" (its whole content read: for slides that an archive restores with their mtimes).
    slide_hash: str = option(
        "sampled",
        CliOption(
            BATCH,
            "how a rerun recognises an unchanged slide file: sampled (default: its size, modification "
            "time, inode and 16 sampled blocks) or full (its whole content read, slower: for slides "
            "restored from an archive with their modification times)",
        ),
        SLIDE_HASH_CHOICES,
    )
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str = "config") -> None:
        def bad(key: str, expected: str, found: Any) -> ConfigError:
            shown = repr(found)
            shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(str(found))} characters)"
            return ConfigError(f"{source}: {key}: expected {expected}, found {shown}")

        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise bad(f.name, f"one of {', '.join(choices)}", getattr(self, f.name))
        if self.tile is not None and self.tile < 16:
            raise bad("tile", "at least 16 pixels", self.tile)
        if self.overlap < 0:
            raise bad("overlap", "at least 0", self.overlap)
        if self.tile is not None and self.overlap >= self.tile:
            raise bad("overlap", f"less than the tile size {self.tile}", self.overlap)
        if self.tile is not None and self.tile > MAX_TILE:
            raise bad("tile", f"at most {MAX_TILE} pixels", self.tile)
        if self.mpp is not None and not (math.isfinite(self.mpp) and MIN_MPP <= self.mpp <= MAX_MPP):
            raise bad("mpp", f"a positive number of micrometres per pixel, {MIN_MPP:g} to {MAX_MPP:g}", self.mpp)
        if self.mpp is not None and self.level is not None:
            raise ConfigError(f"{source}: give mpp or level, not both")
        if self.level is not None and self.level < 0:
            raise bad("level", "a level index >= 0", self.level)
        if not 0 <= self.min_tissue <= 1:
            raise bad("min_tissue", "a fraction in [0, 1]", self.min_tissue)
        if self.tissue == "file" and not self.mask:
            raise ConfigError(f"{source}: tissue = 'file' needs mask = PATH")
        for key, most in (
            ("workers", MAX_WORKERS),
            ("batch_size", MAX_BATCH_SIZE),
            ("streams", MAX_STREAMS),
            ("overlay_size", MAX_OVERLAY_SIZE),
        ):
            v = getattr(self, key)
            if v is not None and not 1 <= v <= most:
                raise bad(key, f"between 1 and {most}", v)
        if not 0 <= self.nms_iou <= 1:
            raise bad("nms_iou", "a value in [0, 1]", self.nms_iou)
        if self.score_threshold is not None and not 0 <= self.score_threshold <= 1:
            raise bad("score_threshold", "a value in [0, 1]", self.score_threshold)
        if not (math.isfinite(self.sigma_scale) and self.sigma_scale > 0):
            raise bad("sigma_scale", "a positive fraction of the tile size", self.sigma_scale)
        if self.slide_timeout is not None and not (math.isfinite(self.slide_timeout) and self.slide_timeout >= 0):
            raise bad("slide_timeout", "seconds >= 0 (0: no limit)", self.slide_timeout)
        self.plugins = _plugin_names(self.plugins, source)
        load_plugins(self.plugins, source)  # before the names the plugins add (formats) are checked
        self.formats = parse_formats(self.formats, source)
        for key in PATH_KEYS + ("dask",):
            v = getattr(self, key)
            if v is not None and ("\x00" in v or not v.strip()):
                raise bad(key, "a path", v)
            if v is not None and key in PATH_KEYS and not _fits_path_limits(v):
                raise bad(key, f"a path of at most {MAX_PATH_CHARS} characters, names of {MAX_NAME_BYTES} bytes", v)
        if self.dask is not None and self.dask.startswith(LOCAL_DASK):
            n, cpus = self.dask[len(LOCAL_DASK) :], os.cpu_count() or 1
            if not (n.isdigit() and 1 <= int(n) <= cpus):
                raise bad("dask", f"local:N with N from 1 to {cpus} (this machine's CPUs)", self.dask)

    # Keys that change how a run goes but not what it produces.
    # The plugins: what they add is named by the settings (formats) and the card (decoder).
    _NOT_IN_RESULT = (
        "workers",
        "streams",
        "batch_size",
        "backend",
        "dask",
        "slide_timeout",
        "slide_hash",
        "plugins",
        "extra",
    )

    def result_key(self) -> dict[str, Any]:
        """The settings that determine the outputs (resume compares these)."""
        d = dataclasses.asdict(self)
        for k in self._NOT_IN_RESULT:
            d.pop(k, None)
        return d

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        return d

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> RunConfig:
        """Build from a mapping, checking every key and type."""
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(fields))})")
            kwargs[name] = _check_type(source, key, value, hints[name])
        cfg = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(cfg, f.name, kwargs.get(f.name, default))
        cfg.validate(source)
        return cfg

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (None values leave a setting as it is)."""
        values = self.as_dict()
        values.update({k: v for k, v in changes.items() if v is not None})
        return RunConfig.from_mapping(values, "options")


def _plugin_names(value: Any, source: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(n, str) for n in items):
        raise ConfigError(f"{source}: plugins: expected module names, found {value!r}")
    return tuple(dict.fromkeys(n.strip() for n in items if n.strip()))


def _fits_path_limits(path: str) -> bool:
    return len(path) <= MAX_PATH_CHARS and all(
        len(part.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES for part in path.split(os.sep)
    )


def _check_type(source: str, key: str, value: Any, hint: Any) -> Any:
    args = typing.get_args(hint)
    allowed = (
        [a for a in args if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{source}: {key}: expected {allowed[0].__name__}, found none")
    for t in allowed:
        if t is float and is_number(value):
            return float(value)
        if t is int and is_int(value):
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t is str and isinstance(value, str):
            return value
        if t is dict and isinstance(value, dict):
            return value
        if typing.get_origin(t) is tuple and isinstance(value, str | list | tuple):
            return value  # the names are checked by validate()
    names = " or ".join(
        "a list of names or a comma-separated string" if typing.get_origin(t) is tuple else t.__name__ for t in allowed
    )
    raise ConfigError(f"{source}: {key}: expected {names}, found {type(value).__name__} {value!r}")


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read a TOML config file (keys at top level or under ``[run]``).

    Relative paths in it (``model``, ``mask``) are relative to the file's folder.
    """
    path = os.fspath(path)
    try:
        with open_regular(path, "rb") as f:  # a FIFO would wait for a writer for ever
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except SpecialFileError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.kind}, not a regular file") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid TOML: expected UTF-8 text, found byte "
            f"0x{exc.object[exc.start]:02x} at offset {exc.start}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    if "run" in doc and isinstance(doc["run"], dict):
        extra = set(doc) - {"run"}
        if extra:
            raise ConfigError(f"{path}: unknown section or key {sorted(extra)[0]!r} beside [run]")
        doc = doc["run"]
    from .inference.shipped import is_shipped_name

    folder = os.path.dirname(os.path.abspath(path))
    for key in PATH_KEYS:
        value = doc.get(key)
        if isinstance(value, str) and value and "\x00" not in value and not os.path.isabs(value):
            beside = os.path.join(folder, os.path.expanduser(value))
            # A shipped model's name stays a name unless the folder holds a file of that name.
            if key != "model" or os.path.exists(beside) or not is_shipped_name(value):
                doc[key] = beside
    return RunConfig.from_mapping(doc, path)
