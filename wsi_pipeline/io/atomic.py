"""Atomic output files: written under a temporary name, renamed when complete.

A reader (or a resumed batch run) never sees half a file: either the old
file, no file, or the whole new one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import SpecialFileError
from ..special_files import open_regular, special_kind


def partial_name(path: str | os.PathLike[str]) -> Path:
    """The temporary name a file is written under before its rename; :class:`SpecialFileError`
    where a FIFO, socket or device stands there (a writer opening it would wait, or never end), or a
    symbolic link (the write would land on the file it names)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.partial-{os.getpid()}")
    if kind := special_kind(tmp, follow_links=False):
        raise SpecialFileError(tmp, kind)
    return tmp


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", **open_kw: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path``; rename it to ``path`` on success.

    On an exception the temporary file is removed and ``path`` is untouched.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "out.txt")
    >>> with atomic_write(p) as f:
    ...     _ = f.write("done")
    >>> open(p).read()
    'done'
    """
    final = Path(path)
    tmp = partial_name(final)
    if "b" not in mode:
        open_kw.setdefault("encoding", "utf-8")
    try:
        # Never waits on a FIFO put there, nor writes through a link.
        with open_regular(tmp, mode, follow_links=False, **open_kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_joined(
    path: str | os.PathLike[str], parts: Sequence[str | os.PathLike[str]], head: str = "", sep: str = "", tail: str = ""
) -> None:
    """Write ``head``, the contents of the non-empty files ``parts`` separated by ``sep``, then
    ``tail`` (UTF-8) to ``path``, atomically; the parts are removed afterwards, also on failure.

    The parts' bytes are copied by the kernel (``os.copy_file_range``) where the file system
    allows it, without passing through this process.
    """
    try:
        with atomic_write(path, "wb", buffering=0) as out:
            out.write(head.encode("utf-8"))
            first = True
            for part in parts:
                size = os.path.getsize(part)
                if not size:
                    continue
                if not first:
                    out.write(sep.encode("utf-8"))
                first = False
                with open_regular(part) as src:
                    _copy_all(src, out, size)
            out.write(tail.encode("utf-8"))
    finally:
        for part in parts:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)


def _copy_all(src: IO[bytes], dst: IO[bytes], size: int) -> None:
    """Append ``size`` bytes of ``src`` (from its start) to ``dst`` (unbuffered, at its position)."""
    done = 0
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is not None:
        try:
            while done < size:
                n = copy_range(src.fileno(), dst.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError:  # a file system or kernel without it: copy through this process
            pass
    if done < size:
        src.seek(done)
        shutil.copyfileobj(src, dst)


def replace_tree(tmp: Path, final: Path) -> None:
    """Move the directory ``tmp`` to ``final``; an existing ``final`` (file or directory) is replaced.

    ``os.replace`` cannot put a directory over a non-empty one: the old output
    is renamed aside first and removed after, so ``final`` is at every moment
    either the old complete output, absent, or the new complete one.
    """
    if not final.exists() and not final.is_symlink():
        os.replace(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON atomically; a NaN or infinite float is written as ``null`` (strict JSON)."""
    try:
        text = json.dumps(obj, indent=indent, default=_json_default, allow_nan=False)
    except ValueError:  # rare: the walk below only where a non-finite float is present
        text = json.dumps(_finite_or_null(obj), indent=indent, default=_json_default, allow_nan=False)
    with atomic_write(path) as f:
        f.write(text)
        f.write("\n")


def _finite_or_null(o: Any) -> Any:
    import numpy as np

    if isinstance(o, float | np.floating):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite_or_null(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite_or_null(v) for v in o]
    if isinstance(o, np.ndarray):
        return _finite_or_null(o.tolist())
    return o


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
