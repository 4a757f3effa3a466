"""Extensions declared once, by an importable module, and imported in every process a run starts.

A decoder, an output format or a slide reader added outside the package is registered by a
module of its own when that module is imported (:func:`~.inference.decoder_registry.register_decoder`,
:func:`~.io.formats.register_format`, :func:`~.slide.readers.register_reader`). The module is
declared in one of two ways:

- an entry point of an installed package, in the group of its registry
  (:data:`ENTRY_POINT_GROUPS`; the entry point names the module), loaded in every process;
- the run's ``plugins`` setting (``--plugin MODULE`` at the command line).

:func:`load_plugins` imports them (a run's settings call it), and every helper process a run
starts (the slide process, writer, box-merging and JPEG processes: :mod:`.child_process`)
imports the same modules before its first slide, with the caller's ``sys.path``.

An entry a registry was given by a call in the calling process (a script's or a notebook's
``register_decoder(...)``) reaches those processes too: each registry hands its added entries to
:func:`carry`, and they are pickled for each process that starts, their functions and classes by
the name of the module that holds them. An entry that cannot be sent that way (a function of
``__main__`` or one defined inside another) is refused before the process starts, with an
error that says how to declare it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pickle
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from .errors import PluginError

# One entry point group per registry: the module an entry point names registers its entries when imported.
DECODERS_GROUP = "wsi_pipeline.decoders"
FORMATS_GROUP = "wsi_pipeline.formats"
READERS_GROUP = "wsi_pipeline.readers"
ENTRY_POINT_GROUPS = (DECODERS_GROUP, FORMATS_GROUP, READERS_GROUP)


# The plugin modules imported in this process, in order (their names: what a helper process imports).
_modules: dict[str, None] = {}
_entry_points_loaded = False
# {restore function: (added-entries function, entry point group, whole)}, one per registry imported.
_carriers: dict[Callable[[list[Any]], None], tuple[Callable[[], list[Any]], str, bool]] = {}
# The entries the plugin modules registered (kept, so that their ids stay theirs): a helper process
# imports those modules itself, so they are not sent.
_declared: list[Any] = []
_declared_ids: set[int] = set()
# Seconds a helper process may take to import the plugins (the run's slide time limit; None: no limit).
_import_limit_s: float | None = None


def load_plugins(modules: Iterable[str] = (), source: str = "plugins") -> tuple[str, ...]:
    """Import the modules of the installed packages' entry points (once per process) and ``modules``;
    returns every plugin module imported in this process so far. :class:`PluginError` naming the
    module where one cannot be imported."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        for group in ENTRY_POINT_GROUPS:
            for ep in importlib.metadata.entry_points(group=group):
                _import(_entry_point_module(ep, group), f"entry point {ep.name!r} of group {group}")
        _entry_points_loaded = True  # only once all are in: a broken one is reported every time
    for name in modules:
        _import(name, source)
    return tuple(_modules)


def set_import_limit(seconds: float | None) -> None:
    """Bound the plugin imports of every helper process started from now on (and of those they
    start) by ``seconds`` (None: no bound): one that hangs there ends that process, saying so."""
    global _import_limit_s
    _import_limit_s = seconds


def plugin_modules() -> tuple[str, ...]:
    """The plugin modules imported in this process so far, in order."""
    return tuple(_modules)


def _entry_point_module(ep: importlib.metadata.EntryPoint, group: str) -> str:
    """The module an entry point names; :class:`PluginError` naming it where its value is no
    ``module`` or ``module:attribute``."""
    try:
        return ep.module
    except Exception:  # its value does not parse: importlib.metadata finds no match
        raise PluginError(
            f"entry point {ep.name!r} of group {group}: expected a module such as my_package.my_module, "
            f"found {ep.value!r}"
        ) from None


def _import(name: str, source: str) -> None:
    if name in _modules:
        return
    if not all(part.isidentifier() for part in name.split(".")):
        raise PluginError(f"{source}: plugin: expected a module name such as my_package.my_module, found {name!r}")
    try:
        importlib.import_module(name)
    except ImportError as exc:
        raise PluginError(f"{source}: plugin {name!r}: cannot import it: {exc}") from exc
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:  # sys.exit() at import would end the run as if it were done
        raise PluginError(
            f"{source}: plugin {name!r}: importing it called sys.exit({exc.code!r}); a plugin only registers"
        ) from None
    except BaseException as exc:  # the module's own code failed while registering its entries
        raise PluginError(f"{source}: plugin {name!r}: importing it failed: {type(exc).__name__}: {exc}") from exc
    _modules[name] = None
    for added, _, _ in _carriers.values():
        for entry in added():
            if id(entry) not in _declared_ids:
                _declared.append(entry)
                _declared_ids.add(id(entry))


def carry(
    added: Callable[[], list[Any]], restore: Callable[[list[Any]], None], group: str, whole: bool = False
) -> None:
    """A registry's hand-over to the processes a run starts: ``added()`` lists the entries it holds
    beyond the package's own, ``restore(entries)`` (a module-level function, sent by name) puts
    them into the same registry there; ``group``: its entry point group (named in errors).

    Only the entries registered other than by a plugin module are sent (the helper process imports
    those modules itself), or with ``whole`` (a registry whose order matters) every entry ``added()``
    gives, where one of them is such an entry."""
    _carriers[restore] = (added, group, whole)


class _EntryPickler(pickle.Pickler):
    """Refuses what a helper process could not load back: objects of ``__main__``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in the main script, which they do not import")
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    _EntryPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _describe(entry: Any) -> str:
    name = getattr(entry, "name", None)
    if isinstance(entry, type):
        return f"{entry.__qualname__} ({name})" if name else entry.__qualname__
    return repr(name) if name else repr(entry)


def child_state() -> dict[str, Any]:
    """What a helper process needs to hold the same extensions as this one (:func:`apply_child_state`):
    this process's ``sys.path``, its plugin modules and each registry's added entries, pickled.
    :class:`PluginError` where an added entry cannot be sent, saying how to declare it instead."""
    carried = []
    for restore, (added, group, whole) in list(_carriers.items()):
        entries = added()
        undeclared = [e for e in entries if id(e) not in _declared_ids]
        if not undeclared:
            continue
        if not whole:
            entries = undeclared
        blobs = []
        for entry in entries:
            try:
                blobs.append(_dumps(entry))
            except Exception as exc:
                raise PluginError(
                    f"{group}: {_describe(entry)} was registered by a call in this process and cannot reach "
                    f"the processes the run starts ({exc}); declare it in an importable module: name the "
                    f"module in the plugins setting (--plugin MODULE) or in the entry point group {group}"
                ) from None
        carried.append((restore, blobs))
    return {
        "path": list(sys.path) if carried or _modules else [],
        "modules": list(_modules),
        "entry_points": _entry_points_loaded,
        "carried": carried,
        "import_limit_s": _import_limit_s,
    }


def apply_child_state(state: dict[str, Any]) -> None:
    """In a helper process: import the modules and put back the entries :func:`child_state` gave."""
    global _entry_points_loaded
    sys.path.extend(p for p in state["path"] if p not in sys.path)
    # The parent's entry point modules are among its modules: not looked up again.
    _entry_points_loaded = _entry_points_loaded or state["entry_points"]
    set_import_limit(state.get("import_limit_s"))
    watchdog = _import_watchdog(state["modules"], _import_limit_s)
    try:
        for name in state["modules"]:
            _import(name, "plugins")
        for restore, blobs in state["carried"]:
            restore([pickle.loads(b) for b in blobs])
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _import_watchdog(modules: list[str], limit_s: float | None) -> threading.Timer | None:
    """A timer that ends this process, in one line on stderr, where the imports pass ``limit_s``:
    an import cannot be stopped from inside Python, and the process waiting for this one would wait
    as long as it hangs."""
    if not modules or not limit_s:
        return None

    def give_up() -> None:
        process = os.path.basename(sys.argv[0]) or "a helper process"
        print(
            f"error: plugins {', '.join(modules)}: not imported within {limit_s:g} s (the slide time limit) "
            f"in {process}; stopped",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(limit_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


__all__ = [
    "DECODERS_GROUP",
    "ENTRY_POINT_GROUPS",
    "FORMATS_GROUP",
    "READERS_GROUP",
    "apply_child_state",
    "carry",
    "child_state",
    "load_plugins",
    "plugin_modules",
    "set_import_limit",
]
