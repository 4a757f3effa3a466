"""Batch runs: inputs to slides, one output folder per slide, a manifest, resume.

Layout of an output folder ``DIR``::

    DIR/manifest.json        every slide's status, error, counts, times
    DIR/run.log              the log of every run into DIR
    DIR/<name>/              one finished slide (see pipeline.OUTPUT_FILES)

A slide is processed into ``DIR/.<name>.partial-<pid>-<n>/`` and that folder
is renamed to ``DIR/<name>/`` only when every file is written, so a folder
with a slide's name is always complete; a killed run leaves only a
``.partial`` folder, removed by the next run. A slide counts as done when
its folder's ``summary.json`` carries the run key of the current settings
and model (:func:`run_key`): a rerun skips it (``force`` redoes it), and a
change of settings or model redoes it. The manifest is rewritten atomically
after every slide, so it is never half-written; where it and the folders
disagree (a kill between the two), the folders win.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import RunConfig
from .errors import UsageError
from .inference.card import ModelCard
from .io.atomic import write_json

log = logging.getLogger("wsi_pipeline")

# Extensions of files a folder input contributes (lower case; ".ome.tif" is covered by ".tif").
SLIDE_EXTENSIONS = (
    ".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif", ".dcm",
    ".png", ".jpg", ".jpeg", ".bmp",
)
LIST_EXTENSIONS = (".txt", ".csv")
MANIFEST = "manifest.json"
LOG_FILE = "run.log"
_counter = itertools.count()


# -- inputs ---------------------------------------------------------------------

def _is_slide_file(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(SLIDE_EXTENSIONS) and not name.startswith(".") and not name.endswith(".truth.geojson")


def _read_list(path: Path) -> list[Path]:
    """Paths in a .txt (one per line, # comments) or .csv (a ``path``/``slide`` column, else the first)."""
    base = path.parent
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the list of slides: {exc}") from exc
    rows: list[str] = []
    if path.suffix.lower() == ".csv":
        reader = list(csv.reader(text.splitlines()))
        if not reader:
            return []
        header = [h.strip().lower() for h in reader[0]]
        col = next((header.index(k) for k in ("path", "slide", "file") if k in header), None)
        body = reader[1:] if col is not None else reader
        rows = [r[col or 0].strip() for r in body if r and r[col or 0].strip()]
    else:
        rows = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(base / r) if not os.path.isabs(r) else Path(r) for r in rows]


def expand_inputs(inputs: Iterable[str | os.PathLike[str]], exclude: str | os.PathLike[str] | None = None
                  ) -> list[Path]:
    """Slide paths from files, folders (recursive, by :data:`SLIDE_EXTENSIONS`), globs and lists.

    A ``.txt``/``.csv`` input is a list of slide paths (relative to the list's
    folder); paths it names that do not exist are kept, to fail as slides.
    An input that names nothing (no such file, folder or glob match) is a
    usage error. ``exclude``: a folder whose files never count (the output
    folder). Order is kept; duplicates are dropped, and so are the other
    files of a DICOM series (:func:`one_file_per_dicom_series`).
    """
    out: list[Path] = []
    seen: set[str] = set()
    skip = str(Path(exclude).resolve()) + os.sep if exclude is not None else None

    def add(p: Path) -> None:
        key = str(p.resolve())
        if key in seen or (skip is not None and key.startswith(skip)):
            return
        seen.add(key)
        out.append(p)

    for item in inputs:
        s = os.fspath(item)
        p = Path(s)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    fp = Path(root) / f
                    if _is_slide_file(fp):
                        add(fp)
        elif p.is_file() and p.suffix.lower() in LIST_EXTENSIONS:
            for q in _read_list(p):
                add(q)
        elif p.is_file():
            add(p)
        elif glob.has_magic(s):
            matches = sorted(glob.glob(s, recursive=True))
            if not matches:
                raise UsageError(f"{s}: the pattern matches no file")
            for m in matches:
                mp = Path(m)
                if mp.is_file():
                    add(mp)
        else:
            raise UsageError(f"{s}: no such file or folder")
    return one_file_per_dicom_series(out)


def _dicom_series_uid(path: Path) -> str | None:
    """The SeriesInstanceUID in a DICOM file's header, or None when it has none or is not DICOM."""
    import pydicom

    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SeriesInstanceUID"],
                             defer_size="1 KB")
    except Exception:  # not DICOM or damaged: it stays a slide of its own, to fail as one
        return None
    uid = ds.get("SeriesInstanceUID")
    return str(uid) if uid else None


def one_file_per_dicom_series(paths: list[Path]) -> list[Path]:
    """Keep the first ``.dcm`` file of each DICOM series (SeriesInstanceUID) in a folder.

    A DICOM whole-slide image is a series of files in one folder (a file per
    pyramid level, thumbnail, label...); OpenSlide opens the whole slide from
    any of them, so the series is one slide. Other paths pass unchanged.
    """
    kept: list[Path] = []
    first: dict[tuple[str, str], Path] = {}
    for p in paths:
        uid = _dicom_series_uid(p) if p.suffix.lower() == ".dcm" and p.is_file() else None
        if uid is None:
            kept.append(p)
            continue
        key = (str(p.resolve().parent), uid)
        if key in first:
            log.info("%s: DICOM series %s, the same slide as %s", p, uid, first[key])
            continue
        first[key] = p
        kept.append(p)
    return kept


def output_names(paths: list[Path]) -> list[str]:
    """A folder name per slide: its stem, with a short hash of the path where stems collide."""
    def stem(p: Path) -> str:
        name = p.name
        for ext in (".ome.tiff", ".ome.tif"):
            if name.lower().endswith(ext):
                return name[: -len(ext)]
        return p.stem or name

    stems = [stem(p) for p in paths]
    counts: dict[str, int] = {}
    for s in stems:
        counts[s] = counts.get(s, 0) + 1
    names = []
    for p, s in zip(paths, stems, strict=True):
        if counts[s] > 1:
            s = f"{s}-{hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:8]}"
        names.append(s)
    return names


# -- resume key -----------------------------------------------------------------

def run_key(config: RunConfig, card: ModelCard) -> str:
    """A hash of everything that decides a slide's outputs: the settings and the model's SHA-256."""
    key = config.result_key()
    key.pop("model", None)  # the path does not matter, the weights do
    doc = {"config": key, "model_sha256": card.sha256, "model_name": card.name, "format": 1}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def done_summary(folder: Path, key: str) -> dict[str, Any] | None:
    """The summary of a finished slide of run key ``key`` in ``folder``, or None when it is not one."""
    from .pipeline import OUTPUT_FILES

    try:
        with open(folder / "summary.json", encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    required = [n for n in OUTPUT_FILES if n != "heatmap.ome.tif" or summary.get("heatmap_scores") is not None]
    done = summary.get("run_key") == key and all((folder / n).is_file() for n in required)
    return summary if done else None


# -- manifest -------------------------------------------------------------------

class Manifest:
    """``DIR/manifest.json``: one record per slide name, saved atomically on every change."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / MANIFEST
        self._lock = threading.Lock()
        self.slides: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                with open(self.path, encoding="utf-8") as f:
                    self.slides = dict(json.load(f).get("slides", {}))
            except (OSError, json.JSONDecodeError, AttributeError):
                log.warning("%s: unreadable, starting a new manifest (finished slide folders are kept)", self.path)

    def update(self, name: str, **fields: Any) -> None:
        with self._lock:
            rec = self.slides.setdefault(name, {})
            rec.update(fields)
            write_json(self.path, {"format": 1, "updated": _now(), "slides": self.slides})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# -- one slide ------------------------------------------------------------------

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

    def as_record(self) -> dict[str, Any]:
        return {**path_record(self.path), "status": self.status, "seconds": round(self.seconds, 3),
                "counts": self.counts, "error": self.error, "worker": self.worker, "tiles": self.tiles}

    def describe(self) -> str:
        """One line for the log: seconds, tiles read, detections per class."""
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items()) or "no classes"
        tiles = f"{self.tiles} tiles read, " if self.tiles is not None else ""
        return f"{self.path}: done in {self.seconds:.1f} s, {tiles}{counts}"


def path_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """A slide's path for the manifest: absolute (``path``) and as the input gave it (``path_as_given``)."""
    return {"path": os.path.abspath(path), "path_as_given": os.fspath(path)}


def _remove_tree(path: Path) -> None:
    """Remove a folder with its contents, or a file (a manifest's ``.partial`` left by a kill)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def process_slide(pipeline: Any, path: str | os.PathLike[str], name: str, out_dir: str | os.PathLike[str],
                  key: str, progress: bool | Callable[[int], None] = False) -> SlideOutcome:
    """Run ``pipeline`` on one slide into ``out_dir/name`` (atomically); never raises for a bad slide."""
    out = Path(out_dir)
    final = out / name
    partial = out / f".{name}.partial-{os.getpid()}-{next(_counter)}"
    t0 = time.perf_counter()
    try:
        result = pipeline.run(path, out_dir=partial, progress=progress, keep_heatmap=False,
                              extra_summary={"run_key": key, "name": name})
        if final.exists():
            old = out / f".{name}.old-{os.getpid()}-{next(_counter)}"
            os.replace(final, old)
            os.replace(partial, final)
            _remove_tree(old)
        else:
            os.replace(partial, final)
        return SlideOutcome(name, str(path), "done", time.perf_counter() - t0, dict(result.summary["counts"]),
                            tiles=result.summary["tiles"]["read"])
    except KeyboardInterrupt:
        _remove_tree(partial)
        raise
    except Exception as exc:
        _remove_tree(partial)
        log.debug("slide %s failed", path, exc_info=True)
        return SlideOutcome(name, str(path), "failed", time.perf_counter() - t0, error=_describe(exc, path))


def _describe(exc: BaseException, path: Any) -> str:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == 28:
        msg = f"out of disk space: {msg}"
    text = msg if str(path) in msg else f"{path}: {msg}"
    return text if type(exc).__module__.startswith("wsi_pipeline") else f"{type(exc).__name__}: {text}"


# -- the batch ------------------------------------------------------------------

def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide and full-width characters take two,
    combining marks none."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


@dataclass
class BatchReport:
    """Every slide's outcome, in input order."""

    outcomes: list[SlideOutcome]
    out_dir: Path

    @property
    def failed(self) -> list[SlideOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def table(self) -> str:
        """A plain-text table: slide, status, detections per class, seconds."""
        rows = [("slide", "status", "detections", "seconds")]
        for o in self.outcomes:
            counts = ", ".join(f"{k} {v}" for k, v in o.counts.items()) if o.counts else "-"
            status = "done earlier" if o.status == "skipped" else o.status
            rows.append((o.name, status, counts, f"{o.seconds:.1f}"))
        widths = [max(display_width(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c + " " * (w - display_width(c)) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for o in self.failed:
            lines.append(f"failed: {o.name}: {o.error}")
        return "\n".join(lines)


def clean_partials(out_dir: Path) -> None:
    """Remove the ``.partial``/``.old`` folders a killed run left behind."""
    for p in out_dir.glob(".*.partial-*"):
        _remove_tree(p)
    for p in out_dir.glob(".*.old-*"):
        _remove_tree(p)


def plan(slides: list[Path], out_dir: Path, key: str, force: bool) -> tuple[list[tuple[Path, str]],
                                                                            list[SlideOutcome]]:
    """Split slides into (to run, already done) by their folders' run keys."""
    todo: list[tuple[Path, str]] = []
    done: list[SlideOutcome] = []
    for path, name in zip(slides, output_names(slides), strict=True):
        summary = None if force else done_summary(out_dir / name, key)
        if summary is not None:
            done.append(SlideOutcome(name, str(path), "skipped", counts=summary.get("counts", {})))
        else:
            todo.append((path, name))
    return todo, done


def run_batch(slides: list[Path], out_dir: str | os.PathLike[str], pipeline_factory: Callable[[], Any],
              config: RunConfig, key: str, force: bool = False, progress: bool = True,
              dask: str | None = None, on_outcome: Callable[[SlideOutcome], None] | None = None) -> BatchReport:
    """Run every slide not already done; record each in the manifest as it ends.

    ``pipeline_factory`` builds the local pipeline (called once, and only
    when a slide needs running); with ``dask`` the slides run as tasks on a
    cluster instead (:mod:`.distributed`), each worker building its own
    pipeline from ``config``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clean_partials(out)
    manifest = Manifest(out)
    todo, done = plan(slides, out, key, force)
    outcomes: dict[str, SlideOutcome] = {o.name: o for o in done}
    for o in done:
        manifest.update(o.name, **path_record(o.path), status="done", run_key=key, counts=o.counts)
        log.info("%s: already done with these settings, skipped", o.path)
    # Built (or connected) before any slide is marked pending: a model, backend or cluster that
    # cannot start is the command's error, not every slide's.
    pipeline = connection = None
    if todo and dask:
        from .distributed import connect, run_on_dask

        connection = connect(dask)
    elif todo:
        pipeline = pipeline_factory()
    for path, name in todo:
        manifest.update(name, **path_record(path), status="pending", run_key=key, error=None)

    def record(o: SlideOutcome) -> None:
        outcomes[o.name] = o
        manifest.update(o.name, **o.as_record(), run_key=key, finished=_now())
        if o.status == "failed":
            log.error("%s: failed: %s", o.path, o.error)
        else:
            log.info("%s", o.describe())
        if on_outcome is not None:
            on_outcome(o)

    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="slides", unit="slide", position=0)
    try:
        if connection is not None:
            for o in run_on_dask(connection, todo, out, config, key):
                record(o)
                if bar is not None:
                    bar.update(1)
        elif todo:
            for o in _run_local(todo, out, pipeline, key, progress, manifest):
                record(o)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    order = output_names(slides)
    return BatchReport([outcomes[n] for n in order if n in outcomes], out)


def _run_local(todo: list[tuple[Path, str]], out: Path, pipeline: Any, key: str, progress: bool,
               manifest: Manifest) -> Iterator[SlideOutcome]:
    try:
        for i, (path, name) in enumerate(todo, 1):
            manifest.update(name, status="running", started=_now())
            log.info("%s: started (%d of %d)", path, i, len(todo))
            yield process_slide(pipeline, path, name, out, key, progress=progress)
    finally:
        pipeline.close()
