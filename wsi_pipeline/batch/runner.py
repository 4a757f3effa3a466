"""Batch runs: inputs to slides, one output folder per slide, a manifest, resume.

The output folder's layout is in :mod:`.folder`: ``DIR/manifest.json``,
``DIR/run.log`` and one folder per slide under ``DIR/slides/``. One run at a
time writes into a folder (``DIR/run.lock``).

A slide is processed into ``DIR/slides/.<name>.partial-<pid>-<n>/`` and that
folder is renamed to ``DIR/slides/<name>/`` only when every file is written,
so a folder with a slide's name is always complete; a killed run leaves only a
``.partial`` folder, removed by the next run. Slides run in a child process,
each under a wall-clock limit (:mod:`.slide_runners`). A slide counts as done
when its folder's ``summary.json`` carries the current run key (settings,
model card, model, mask: :class:`.resume.RunKey`) and its slide file's
identity: a rerun skips it (``force`` redoes it); otherwise it is redone and
the log says why. The manifest is rewritten atomically after every change,
so it is never half-written; where it and the folders disagree (a kill
between the two), the folders win. When the manifest cannot be written (a
full disk), the run stops with an :class:`~.folder.OutputFolderError`.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import itertools
import logging
import os
import unicodedata
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import UsageError
from ..file_identity import input_identity
from ..inference.card_spec import ModelCard
from ..remote.address import RemoteAddress, is_remote
from ..slide.readers import lists_slide
from ..special_files import link_loops, special_kind
from ..summary import read_summary
from ..text_escapes import printable
from .dicom_series import one_file_per_dicom_series
from .folder import (
    OutputFolderError,
    clean_leftovers,
    held_names,
    lock_output_folder,
    output_names,
    slide_dir,
    slides_dir,
)
from .jobs import SlideOutcome, path_record
from .manifest import Manifest, now
from .resume import RunKey, why_redo
from .slide_runners import PLAN_AHEAD, RUN_AHEAD, make_runner, slide_time_limit
from .stops import SetUp, record_interrupted, record_stop_in_set_up

log = logging.getLogger("wsi_pipeline")

LIST_EXTENSIONS = (".txt", ".csv")
_counter = itertools.count()
__all__ = ["BatchReport", "expand_inputs", "run_batch", "run_key"]


# -- inputs ---------------------------------------------------------------------


def _has_slide_extension(path: Path) -> bool:
    # Which files are slides is the readers' answer (each reader's suffixes), as for a file named directly.
    return lists_slide(path)


def _is_slide_file(path: Path) -> bool:
    return _has_slide_extension(path) and not path.name.startswith(".")


def _read_list(path: Path) -> list[Path]:
    """Paths in a .txt (one per line, # comments) or .csv (a ``path``/``slide`` column, else the first)."""
    base = path.parent
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the list of slides: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{path}: the list of slides is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise UsageError(f"{path}: line {line}: the list of slides holds a NUL byte (expected text)")
    rows: list[str] = []
    if path.suffix.lower() == ".csv":
        try:
            reader = list(csv.reader(text.splitlines()))
        except csv.Error as exc:
            raise UsageError(f"{path}: not a readable CSV list of slides: {exc}") from None
        if not reader:
            return []
        header = [h.strip().lower() for h in reader[0]]
        col = next((header.index(k) for k in ("path", "slide", "file") if k in header), None)
        body = reader[1:] if col is not None else reader
        rows = [r[col or 0].strip() for r in body if len(r) > (col or 0) and r[col or 0].strip()]
    else:
        rows = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [RemoteAddress(r) if is_remote(r) else (base / r) if not os.path.isabs(r) else Path(r) for r in rows]


def expand_inputs(
    inputs: Iterable[str | os.PathLike[str]], exclude: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Slide paths from files, folders (recursive: the files a slide reader lists,
    :func:`~wsi_pipeline.slide.readers.lists_slide`), globs and lists, and remote addresses
    (``https://``, ``http://``, ``s3://``: a :class:`~..remote.address.RemoteAddress` each).

    A ``.txt``/``.csv`` input is a list of slide paths (relative to the list's
    folder); paths it names that do not exist are kept, to fail as slides, and
    so are a folder's entries that cannot be read (a sub-folder without
    permission, a symbolic link that loops): each fails as a slide of its own,
    saying why, and the others run. An input that names nothing (no such file,
    folder or glob match) and a list that is not UTF-8 text are usage errors.
    ``exclude``: a folder whose files never count (the output folder). Order
    is kept; duplicates are dropped, and so are the other files of a DICOM
    series and the DICOM files of a folder that are no whole-slide image
    (:func:`one_file_per_dicom_series`).
    """
    out: list[Path] = []
    named: list[Path] = []  # files named one by one (on the command line, in a list)
    seen: set[str] = set()
    skip = os.path.realpath(exclude) + os.sep if exclude is not None else None

    def add(p: Path, by_name: bool = False) -> None:
        key = os.path.abspath(p) if link_loops(p) else os.path.realpath(p)  # a loop resolves to no file
        if key in seen or (skip is not None and key.startswith(skip)):
            return
        seen.add(key)
        out.append(p)
        if by_name:
            named.append(p)

    for item in inputs:
        s = os.fspath(item)
        if is_remote(s):  # kept as given: a path would fold the address's "//"
            add(RemoteAddress(s), by_name=True)
            continue
        p = Path(s)
        if p.is_dir():
            for fp in _folder_slides(p):
                add(fp)
        elif p.is_file() and p.suffix.lower() in LIST_EXTENSIONS:
            for q in _read_list(p):
                add(q, by_name=True)
        elif p.is_file() or special_kind(p):  # a FIFO or device fails as a slide, saying what it is
            add(p, by_name=True)
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
    return one_file_per_dicom_series(out, named)


def _folder_slides(folder: Path) -> list[Path]:
    """The slide files under ``folder`` (recursive, by name), and each entry that cannot be read: a
    sub-folder that cannot be listed (it fails as a slide, naming the folder and why; its slides would
    otherwise never run, unseen) and a symbolic link that loops (whatever its name)."""
    found: list[Path] = []

    def unreadable(exc: OSError) -> None:
        found.append(Path(exc.filename))

    for root, dirs, files in os.walk(folder, onerror=unreadable):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            fp = Path(root) / f
            if _is_slide_file(fp) or link_loops(fp):
                found.append(fp)
            elif _has_slide_extension(fp):  # a hidden file
                log.warning("%s: skipped: a hidden file (its name starts with '.'); name it to run it", fp)
    return found


# -- resume key -----------------------------------------------------------------


def run_key(config: RunConfig, card: ModelCard) -> RunKey:
    """The key of everything besides the slide that decides its outputs (see :mod:`.resume`)."""
    return RunKey.of(config, card)


def resume_state(folder: Path, key: RunKey, path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(summary, why the slide at ``path`` needs running) for its outputs ``folder``; the reason is None
    when they are its result under ``key``."""
    from ..outputs import OUTPUT_FILES

    if not folder.is_dir():
        return None, "not run yet"
    summary = read_summary(folder)
    required = (summary or {}).get("files")  # what the run wrote (the run key covers the formats asked for)
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        # A summary from before the files were listed: the default set.
        required = [
            n for n in OUTPUT_FILES if n != "heatmap.ome.tif" or (summary or {}).get("heatmap_scores") is not None
        ]
    missing = [n for n in required if not (folder / n).exists()]  # files, and the folders of ome-zarr and dicom-heatmap
    return summary, why_redo(summary, key, input_identity(path, key.slide_hash), missing)


# -- the batch ------------------------------------------------------------------


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide and full-width characters take two,
    combining marks none."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


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
            status = ("done earlier" if o.status == "skipped" else o.status) + o.warned
            rows.append((printable(o.name), status, counts, f"{o.seconds:.1f}"))
        widths = [max(display_width(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(c + " " * (w - display_width(c)) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for o in self.failed:
            lines.append(printable(f"failed: {o.name}: {o.error}"))
        for o in self.outcomes:
            lines.extend(printable(f"warning: {o.name}: {w}") for w in o.warnings)
        return "\n".join(lines)


def plan(
    slides: list[Path],
    out_dir: Path,
    key: RunKey,
    force: bool,
    names: list[str] | None = None,
    earlier: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[tuple[Path, str]], list[SlideOutcome]]:
    """Split slides into (to run, already done) by their folders' run keys and input identities;
    log why each slide that has outputs, or that an earlier run left unfinished, is redone.
    ``names``: the slides' folder names (:func:`output_names` of the slides alone by default);
    ``earlier``: the manifest's records by name."""
    todo: list[tuple[Path, str]] = []
    done: list[SlideOutcome] = []
    for path, name in zip(slides, output_names(slides) if names is None else names, strict=True):
        summary, reason = (None, "--force") if force else resume_state(slide_dir(out_dir, name), key, path)
        if reason is None:
            summary = summary or {}
            done.append(
                SlideOutcome(
                    name, str(path), "skipped", counts=summary.get("counts", {}), warnings=summary.get("warnings") or []
                )
            )
            continue
        if reason == "not run yet":
            reason = _unfinished((earlier or {}).get(name, {}))
        if reason is not None:
            log.info("%s: redone: %s", path, reason)
        todo.append((path, name))
    return todo, done


def _unfinished(record: dict[str, Any]) -> str | None:
    """Why a slide without outputs is redone, from its manifest record: None where no run started it."""
    status, when = record.get("status"), record.get("finished") or record.get("started") or "?"
    if status == "interrupted":
        return f"interrupted in an earlier run ({record.get('stopped_by', 'stopped')} at {when})"
    if status == "failed":
        return f"failed in an earlier run (at {when}): {record.get('error', 'no error recorded')}"
    if status == "running":
        return f"an earlier run stopped while it ran (started at {when}, the run killed or its machine down)"
    return None


def run_batch(
    slides: list[Path],
    out_dir: str | os.PathLike[str],
    pipeline_factory: Callable[[], Any],
    config: RunConfig,
    key: RunKey,
    force: bool = False,
    progress: bool = True,
    dask: str | None = None,
    on_outcome: Callable[[SlideOutcome], None] | None = None,
) -> BatchReport:
    """Run every slide not already done; record each in the manifest as it ends.

    ``pipeline_factory`` builds the pipeline (once, and only when a slide
    needs running) in the process that runs the slides: a child process
    (:mod:`.slide_runners`; the factory must then be picklable, as
    :class:`PipelineFactory` is), or this one with ``config.slide_timeout =
    0``. With ``dask`` the slides run as tasks on a cluster instead
    (:mod:`.distributed`), each worker building its own pipeline from
    ``config``. Raises UsageError when another run writes into ``out_dir``,
    :class:`OutputFolderError` when the manifest cannot be written; Ctrl-C
    records the slides in progress as interrupted.
    """
    out = Path(out_dir)
    if dask:
        from .distributed import check_address

        check_address(dask)
    with lock_output_folder(out):
        setup = SetUp()
        try:
            names, todo, done = _set_up(slides, out, pipeline_factory, config, key, force, progress, dask, setup)
        except KeyboardInterrupt as stop:
            record_stop_in_set_up(out, setup, stop)
            raise
        manifest, runner = setup.manifest, setup.runner
        outcomes: dict[str, SlideOutcome] = {o.name: o for o in done}

        def record(o: SlideOutcome) -> None:
            outcomes[o.name] = o
            _record_outcome(manifest, key, o)
            if on_outcome is not None:
                on_outcome(o)

        bar = None
        try:
            if progress and todo:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(todo), desc="slides", unit="slide", position=0)
            results = _slide_outcomes(todo, out, runner, config, key, manifest, dask)
            with contextlib.closing(results):  # a stop ends the slide runner too
                for o in results:
                    record(o)
                    if bar is not None:
                        bar.update(1)
        except KeyboardInterrupt as stop:
            record_interrupted(manifest, todo, outcomes, dask, stop)
            raise
        finally:
            if bar is not None:
                bar.close()
            if runner is not None:
                runner.close()  # again after the loop's own close: a no-op then
        # Once more at the end: the slide process of an earlier run killed just before this one began
        # notices its parent's end within a second (child_process.watch_parent) and may have started a
        # slide folder after the first clean; this run's own are all renamed or removed by now.
        clean_leftovers(out)
    order = names
    return BatchReport([outcomes[n] for n in order if n in outcomes], out)


def _set_up(
    slides: list[Path],
    out: Path,
    pipeline_factory: Callable[[], Any],
    config: RunConfig,
    key: RunKey,
    force: bool,
    progress: bool,
    dask: str | None,
    setup: SetUp,
) -> tuple[list[str], list[tuple[Path, str]], list[SlideOutcome]]:
    """The steps before the first slide, each named in ``setup`` as it runs: (the slides' names,
    those to run, those done); ``setup`` holds the manifest and the slide runner started."""
    _make_slides_folder(out)
    clean_leftovers(out)
    setup.manifest = manifest = Manifest(out)
    setup.step = "planning: which slides are done"
    # Names earlier runs gave stay theirs: a slide of the same stem gets another one.
    names = output_names(slides, held_names(out, manifest.slides))
    todo, done = plan(slides, out, key, force, names, manifest.slides)
    for o in done:
        log.info("%s: already done with these settings, skipped", o.path)
    if todo and not dask:
        setup.step = "starting the slide process"
        setup.runner = _start_runner(pipeline_factory, config, progress)
    setup.step = "recording the plan"
    _record_planned(manifest, key, done, todo)
    return names, todo, done


def _make_slides_folder(out: Path) -> None:
    try:
        slides_dir(out).mkdir(exist_ok=True)
    except OSError as exc:
        raise OutputFolderError(
            f"{slides_dir(out)}: cannot make the folder of the slides' outputs: {exc.strerror or exc}"
        ) from None


def _start_runner(pipeline_factory: Callable[[], Any], config: RunConfig, progress: bool) -> Any:
    """The slide runner, its pipeline built before any slide is marked pending: a model or backend
    that cannot start is the command's usage error, not every slide's failure."""
    runner = make_runner(pipeline_factory, config, progress)
    try:
        runner.prepare()
    except BaseException:
        runner.close()
        raise
    return runner


def _record_planned(manifest: Manifest, key: RunKey, done: list[SlideOutcome], todo: list[tuple[Path, str]]) -> None:
    """The manifest's records of the slides already done and of those to run (pending)."""
    manifest.update_records(
        {
            **{
                o.name: dict(
                    **path_record(o.path), status="done", run_key=key.value, counts=o.counts, warnings=o.warnings
                )
                for o in done
            },
            **{
                name: dict(**path_record(path), status="pending", run_key=key.value, error=None, warnings=[])
                for path, name in todo
            },
        }
    )


def _record_outcome(manifest: Manifest, key: RunKey, o: SlideOutcome) -> None:
    """A slide's end, logged and recorded in the manifest."""
    if o.status == "failed":
        log.error("%s: failed: %s", o.path, o.error)
    else:
        log.info("%s", o.describe())
    manifest.update(o.name, **o.as_record(), run_key=key.value, finished=now())


def _slide_outcomes(
    todo: list[tuple[Path, str]],
    out: Path,
    runner: Any,
    config: RunConfig,
    key: RunKey,
    manifest: Manifest,
    dask: str | None,
) -> Generator[SlideOutcome, None, None]:
    """The slides' outcomes as they end: from the cluster at ``dask``, else from the local ``runner``."""
    if dask and todo:
        from .distributed import run_on_dask

        return run_on_dask(dask, todo, out, config, key)
    return _run_local(todo, out, runner, config, key, manifest)


def _run_local(
    todo: list[tuple[Path, str]], out: Path, runner: Any, config: RunConfig, key: RunKey, manifest: Manifest
) -> Generator[SlideOutcome, None, None]:
    if not todo:
        return
    try:
        for i, (path, name) in enumerate(todo, 1):
            runner.prepare()  # the model loads before the slide counts as running, and outside its limit
            manifest.update(name, status="running", started=now())
            log.info("%s: started (%d of %d)", path, i, len(todo))
            next_slides = todo[i : i + RUN_AHEAD + PLAN_AHEAD]
            yield runner.run(path, name, out, key, slide_time_limit(config, path), next_slides=next_slides)
    finally:
        runner.close()
