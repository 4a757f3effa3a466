"""The batch output folder: one run at a time, and slide folders that cannot meet the batch's files.

Layout of an output folder ``DIR``::

    DIR/manifest.json                 every slide's status, error, counts, times
    DIR/run.log                       the log of every run into DIR
    DIR/run.lock                      held (``flock``) by the run writing into DIR
    DIR/slides/<name>/                one finished slide (its summary.json lists its files)
    DIR/slides/.<name>.partial-*/     a slide being written (removed by the next run if left)

Slide folders live under ``slides/``, so no slide name can replace the
batch's own files, and :func:`output_names` makes their names unique (case
folded, leading dots replaced) whatever the input file names are.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import SpecialFileError, UsageError, WSIPipelineError
from ..special_files import open_regular, open_regular_fd, special_kind
from ..summary import read_summary
from ..text_escapes import OneLineFormatter

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]

MANIFEST = "manifest.json"
LOG_FILE = "run.log"
LOCK_FILE = "run.lock"
SLIDES_DIR = "slides"
# Longest folder name (bytes) taken from a file name; the hidden in-progress name adds about 40.
MAX_NAME_BYTES = 150

log = logging.getLogger("wsi_pipeline")


class OutputFolderError(WSIPipelineError):
    """The batch cannot record anything in its output folder (full disk, no permission): the run stops."""


def slides_dir(out_dir: str | os.PathLike[str]) -> Path:
    """The folder holding one folder per slide."""
    return Path(out_dir) / SLIDES_DIR


def slide_dir(out_dir: str | os.PathLike[str], name: str) -> Path:
    """Where the finished outputs of slide ``name`` (from :func:`output_names`) are."""
    return slides_dir(out_dir) / name


# -- names ----------------------------------------------------------------------


def _stem(p: Path) -> str:
    name = p.name
    for ext in (".ome.tiff", ".ome.tif"):
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return p.stem or name


def _stems(paths: list[Path]) -> list[str]:
    """Each slide's name before it is made safe and unique: the file's stem; for a DICOM series
    (a ``.dcm`` file standing for its series), the name of its folder where the folder holds that
    series alone, else the series' ContainerIdentifier (the slide's barcode), else the stem. A
    series' files are named after UIDs, which are not what users know a slide by."""
    dicom = [p.suffix.lower() == ".dcm" for p in paths]
    per_folder: dict[str, int] = {}
    for p, is_dicom in zip(paths, dicom, strict=True):
        if is_dicom:
            folder = os.path.dirname(os.path.realpath(p))
            per_folder[folder] = per_folder.get(folder, 0) + 1
    stems = []
    for p, is_dicom in zip(paths, dicom, strict=True):
        folder = os.path.dirname(os.path.realpath(p)) if is_dicom else ""
        if is_dicom and per_folder[folder] == 1 and os.path.basename(folder):
            stems.append(os.path.basename(folder))
        else:
            stems.append((_container_identifier(p) if is_dicom else None) or _stem(p))
    return stems


def _container_identifier(path: Path) -> str | None:
    """A DICOM file's ContainerIdentifier, or None where it has none or cannot be read."""
    from ..slide.dicom_headline import headline

    found = headline(str(path))  # read once for the series' grouping already
    return found.container if found is not None else None


def _safe(stem: str) -> str:
    """``stem`` as a plain folder name: no separators or control characters, no leading dot, not too long."""
    s = "".join("_" if ch in "/\\" or ord(ch) < 32 or ord(ch) == 127 else ch for ch in stem)
    s = "_" * (len(s) - len(s.lstrip("."))) + s.lstrip(".")
    raw = os.fsencode(s or "_")
    if len(raw) > MAX_NAME_BYTES:
        raw = raw[:MAX_NAME_BYTES]
    return os.fsdecode(raw) or "_"


def _path_hash(p: Path, digits: int) -> str:
    return hashlib.sha1(os.fsencode(os.path.realpath(p))).hexdigest()[:digits]


def output_names(paths: list[Path], held: Mapping[str, str] | None = None) -> list[str]:
    """A folder name per slide: its stem, with a hash of its path where names would meet.

    Names are compared case-folded (a case-insensitive file system would merge
    ``A`` and ``a``). ``held``: the names earlier runs gave in this output
    folder, each to the absolute path of its slide (:func:`held_names`). A
    slide that holds a name keeps it; a name held by another slide's results
    is not given again, so no run replaces another slide's results. Stems that
    occur once and are free keep their name; the others get ``-<8 hex>`` of
    their real path, longer where that still meets another name (a file named
    like another slide's hashed folder), so no two slides share a folder. The
    same inputs give the same names on every run.
    """
    held = {} if held is None else dict(held)
    earlier = {n.casefold(): (n, p) for n, p in held.items()}
    own = {os.path.realpath(p): n for n, p in held.items()}
    taken = {n.casefold() for n in held}
    names: list[str | None] = [own.get(os.path.realpath(p)) for p in paths]
    stems = [_safe(s) for s in _stems(paths)]
    counts: dict[str, int] = {}
    for s, n in zip(stems, names, strict=True):
        if n is None:
            counts[s.casefold()] = counts.get(s.casefold(), 0) + 1
    for i, s in enumerate(stems):
        if names[i] is None and counts[s.casefold()] == 1 and s.casefold() not in taken:
            names[i] = s
            taken.add(s.casefold())
    for i, (p, s) in enumerate(zip(paths, stems, strict=True)):
        if names[i] is not None:
            continue
        for digits in (8, 16, 40):
            candidate = f"{s}-{_path_hash(p, digits)}"
            if candidate.casefold() not in taken:
                break
        names[i] = candidate
        taken.add(candidate.casefold())
        if s.casefold() in earlier:
            name, other = earlier[s.casefold()]
            log.warning(
                "%s: slides/%s holds the results of %s from an earlier run, which are kept; "
                "this slide's go to slides/%s",
                p,
                name,
                other,
                candidate,
            )
    return [n for n in names if n is not None]


def held_names(out_dir: str | os.PathLike[str], records: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The slide names earlier runs gave in ``out_dir``, each to its slide's absolute path.

    From the manifest's ``records`` (every slide an earlier run named, done or
    not), and the ``slide`` of the summaries of folders it does not list (a
    manifest lost or unreadable).
    """
    held = {n: str(r["path"]) for n, r in records.items() if isinstance(r, Mapping) and r.get("path")}
    folder = slides_dir(out_dir)
    known = {n.casefold() for n in held}
    if folder.is_dir():
        for d in folder.iterdir():
            if d.name.startswith(".") or d.name.casefold() in known:
                continue
            slide = (read_summary(d) or {}).get("slide")
            if isinstance(slide, str):
                held[d.name] = slide
    return held


# -- one run at a time ------------------------------------------------------------

_held: dict[str, tuple[int, int, int]] = {}  # real path -> (fd, depth, thread)
_held_lock = threading.Lock()


@contextlib.contextmanager
def lock_output_folder(out_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``DIR/run.lock`` while writing into ``DIR``; UsageError when another run holds it.

    Re-entrant within one thread (the CLI takes it before opening the log,
    :func:`~.runner.run_batch` takes it again).
    """
    out = Path(out_dir)
    _make_output_folder(out)
    key = os.path.realpath(out)
    me = threading.get_ident()
    with _held_lock:
        if key in _held:
            fd, depth, owner = _held[key]
            if owner != me:
                raise UsageError(f"{out}: another run in this process is writing into this folder")
            _held[key] = (fd, depth + 1, owner)
        else:
            _held[key] = (_acquire(out), 1, me)
    try:
        yield
    finally:
        with _held_lock:
            fd, depth, owner = _held[key]
            if depth > 1:
                _held[key] = (fd, depth - 1, owner)
            else:
                del _held[key]
                os.close(fd)  # releases the lock; the file stays (removing it would race a new run)


def _make_output_folder(out: Path) -> None:
    """``out`` made where missing; :class:`UsageError` where it names a file or cannot be made."""
    if os.path.lexists(out) and not out.is_dir():
        kind = special_kind(out) or ("a symbolic link to nothing" if out.is_symlink() else "a file")
        raise UsageError(f"{out}: the output folder is {kind}, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{out}: cannot make the output folder: {exc.strerror or exc}") from None


def _acquire(out: Path) -> int:
    path = out / LOCK_FILE
    try:
        fd = open_regular_fd(path, os.O_RDWR | os.O_CREAT, 0o644, follow_links=False)
    except SpecialFileError as exc:
        raise UsageError(f"{exc}; the output folder's lock file must be a file of its own") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot create the output folder's lock file: {exc.strerror}") from None
    if fcntl is None:  # pragma: no cover
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UsageError(
            f"{out}: another run (process {holder}) is writing into this folder; "
            "wait for it to end or give another --out"
        ) from None
    with contextlib.suppress(OSError):  # the pid is for the message above only
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# -- removal ----------------------------------------------------------------------


def remove_path(path: str | os.PathLike[str]) -> None:
    """Remove a file, link or folder tree, read-only folders included; OSError when it cannot."""
    p = os.fspath(path)
    if os.path.islink(p) or not os.path.isdir(p):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
        return
    try:
        shutil.rmtree(p)
    except FileNotFoundError:
        return
    except OSError:
        # A folder without write (or read) permission keeps its entries: open it up, then retry.
        _make_writable(p)
        shutil.rmtree(p)


def _make_writable(root: str) -> None:
    os.chmod(root, os.stat(root).st_mode | stat.S_IRWXU)
    for folder, subdirs, _ in os.walk(root):
        for d in subdirs:
            sub = os.path.join(folder, d)
            if not os.path.islink(sub):
                os.chmod(sub, os.stat(sub).st_mode | stat.S_IRWXU)


def remove_or_warn(path: str | os.PathLike[str], what: str) -> None:
    """:func:`remove_path`, logging a warning (not raising) when it fails."""
    try:
        remove_path(path)
    except OSError as exc:
        log.warning("%s: cannot remove %s: %s", path, what, exc.strerror or exc)


def clean_leftovers(out_dir: str | os.PathLike[str]) -> None:
    """Remove what a killed or failed run left behind: in-progress and replaced slide folders, and
    a half-written manifest or log file of the batch (killed while writing it)."""
    folder = slides_dir(out_dir)
    for pattern in (".*.partial-*", ".*.old-*"):
        for p in folder.glob(pattern):
            remove_or_warn(p, "a left-over folder of an earlier run")
    for p in Path(out_dir).glob(".*.partial-*"):
        if p.is_file() or p.is_symlink():
            remove_or_warn(p, "a half-written file of an earlier run")


# -- the log file -------------------------------------------------------------------


class BatchLogHandler(logging.FileHandler):
    """``DIR/run.log``: any file name is written (undecodable bytes escaped), and a failed write
    (a full disk) is said once on stderr instead of a traceback per record. A FIFO, device or
    symbolic link there is refused (:class:`SpecialFileError`): appending to a FIFO would wait
    for a reader, through a link would write the file it names."""

    def __init__(self, path: str | os.PathLike[str]):
        if kind := special_kind(path, follow_links=False):
            raise SpecialFileError(path, kind)
        super().__init__(path, encoding="utf-8", errors="backslashreplace")
        self.setFormatter(OneLineFormatter())
        self._failed = False

    def _open(self) -> Any:
        return open_regular(
            self.baseFilename, self.mode, follow_links=False, encoding=self.encoding, errors=self.errors
        )

    def handleError(self, record: logging.LogRecord) -> None:
        if not self._failed:
            self._failed = True
            exc = sys.exc_info()[1]
            print(f"warning: {self.baseFilename}: cannot write the log: {exc}", file=sys.stderr)
