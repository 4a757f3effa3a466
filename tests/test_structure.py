"""The package's shape: no import circle, no module over 600 lines, no class over 300, no function
over 80; each name imported from the module that defines it, and no private name across modules.

A module that grows past these limits is split by job; a class, by job into classes or modules it
uses; a function, into named steps. ``python tests/test_structure.py`` prints what breaks the rules
on names, with counts.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import wsi_pipeline

PACKAGE = Path(wsi_pipeline.__path__[0])
# The package's callers held to the rules on names too.
CALLERS = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks"]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module`` or ``import_module``, as called."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id == "import_module"


def _dynamic_imports(call: ast.Call, name: str, package: str, modules: dict[str, Path]) -> set[str]:
    """The modules an ``importlib.import_module(...)`` call may import: a literal name, or an f-string
    whose parts are literal, ``__name__``/``__package__``, or anything else (then every module the
    pattern matches: what a loop over names may reach); relative to its ``package`` argument.
    A name held in a variable is not followed."""
    own = {"__name__": name, "__package__": package}

    def parts(node: ast.expr) -> list[str | None] | None:
        """The name's parts: text, or None for a part not known before the call."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name) and node.id in own:
            return [own[node.id]]
        if isinstance(node, ast.JoinedStr):
            found = [parts(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values]
            return [p[0] if p is not None and len(p) == 1 else None for p in found]
        return None

    target = parts(call.args[0]) if call.args else None
    if not target or not isinstance(target[0], str):
        return set()
    if target[0].startswith("."):
        anchor = parts(call.args[1]) if len(call.args) > 1 else None
        if anchor is None or anchor[0] is None:
            return set()
        dots = len(target[0]) - len(target[0].lstrip("."))
        base = importlib.util.resolve_name("." * dots + "x", anchor[0])[: -len(".x")]
        target = [f"{base}.{target[0][dots:]}", *target[1:]]
    regex = "".join(re.escape(p) if p is not None else "[A-Za-z0-9_]+" for p in target)
    return {m for m in modules if re.fullmatch(regex, m)}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever the import stands (functions and
    ``TYPE_CHECKING`` blocks included: an import for annotations still ties the two modules), and
    those it imports through ``importlib.import_module`` with a name written in the call."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_import_module(node.func):
            found |= _dynamic_imports(node, name, package, modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_import_graph_is_read():
    graph = _graph()
    assert "wsi_pipeline.geometry" in graph["wsi_pipeline.pipeline"]
    # importlib.import_module with the name in the call: a literal, relative to __package__, and an
    # f-string over a list of names (every module it may reach).
    assert "wsi_pipeline.batch.runner" in graph["wsi_pipeline.batch"]
    assert {"wsi_pipeline.commands.run", "wsi_pipeline.commands.info"} <= graph["wsi_pipeline.cli"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _outward(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` less each module's imports of the packages it stands in: an ``__init__``
    imports its own modules (eagerly, or through ``importlib.import_module``), and a module taking a
    sibling's name through the package face would make every package one circle. The face is
    followed inwards from outside the package: a module importing it reaches what it imports."""
    return {name: {m for m in imported if not name.startswith(m + ".")} for name, imported in graph.items()}


def test_no_module_imports_itself_back_through_others():
    assert _circles(_outward(_graph())) == []


# The modules that start the command line: the package's own ``python -m wsi_pipeline`` and ``make demo``.
ENTRY_POINTS = {"wsi_pipeline.__main__", "wsi_pipeline.demo"}


def test_only_the_entry_points_import_the_command_line():
    """The command line sits on top: what it shares (``Terminated``, the errors) lives below it."""
    graph = _graph()
    assert {name for name, imported in graph.items() if "wsi_pipeline.cli" in imported} == ENTRY_POINTS


def test_no_package_forwards_names_through_getattr():
    """A package's names are imported by its ``__init__``; a module ``__getattr__`` hides what it
    imports from the structure's readers. The package's own face loads the pipeline on first use."""
    forwarding = {
        name
        for name, path in _modules().items()
        if path.name == "__init__.py"
        and any(
            isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            for node in ast.parse(path.read_text(encoding="utf-8")).body
        )
    }
    assert forwarding == {"wsi_pipeline"}


def test_a_circle_through_a_package_face_is_found():
    """A module importing a package whose ``__init__`` loads, on first use, a module that imports the
    first one back is a circle (as ``cli -> commands.run -> batch -> batch.runner -> cli`` was)."""
    graph = {
        "p.cli": {"p.commands.run"},
        "p.commands.run": {"p.batch"},
        "p.batch": {"p.batch.runner"},
        "p.batch.runner": {"p.cli", "p.batch"},
    }
    assert _circles(_outward(graph)) == [["p.batch", "p.batch.runner", "p.cli", "p.commands.run"]]


def test_no_module_is_over_the_limit():
    over = {
        str(path.relative_to(PACKAGE)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert over == {}


def test_no_function_is_over_the_limit():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert over == {}


def test_no_class_is_over_the_limit():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    over[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert over == {}


# -- names: defined where they are imported from -------------------------------------------------
#
# The rule: a name that a module takes with ``from M import name`` (M a module of the package, the
# name not a submodule of M) is defined in M (a top-level ``def``, ``class`` or assignment,
# including those under a top-level ``if``/``try``/``with``/``for``), or M is a package
# ``__init__`` that lists it in ``__all__`` (the package's declared public API). A module other
# than a package ``__init__`` lists in ``__all__`` only names it defines. A name with one leading
# underscore is taken by no other module (its tests included), nor read as an attribute of a module
# another module imported.


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (not those it imports)."""
    defined: set[str] = set()

    def targets(node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            defined.add(node.id)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                targets(e)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def body(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(s.name)
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    targets(t)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
                targets(s.target)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                targets(s.target)
                body(s.body + s.orelse)
            elif isinstance(s, (ast.If, ast.While)):
                body(s.body + s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
                body(s.body)
            elif isinstance(s, ast.Try):
                body(s.body + s.orelse + s.finalbody + [x for h in s.handlers for x in h.body])

    body(tree.body)
    return defined


def _declared_all(tree: ast.Module) -> set[str]:
    for s in tree.body:
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            names = s.targets if isinstance(s, ast.Assign) else [s.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in names):
                assert isinstance(s.value, (ast.List, ast.Tuple)), "__all__ is a list of names written out"
                return {e.value for e in s.value.elts if isinstance(e, ast.Constant)}
    return set()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _names_taken(
    path: Path, modules: dict[str, Path], package_dir: Path = PACKAGE
) -> tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """(line, module, name) for each name ``path`` takes by ``from M import name`` from a module M
    of the package other than itself, submodules left out; and for each attribute it reads of such
    a module bound by an import (``from pkg import m`` or ``import pkg.m as m``, then ``m.name``)."""
    own = _module_name(path, package_dir) if path.is_relative_to(package_dir) else None
    package = (own if path.name == "__init__.py" else own.rpartition(".")[0]) if own else None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    taken, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if package is None:
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        bound.update({a.asname or a.name: f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules})
        if module not in modules or module == own:
            continue
        taken.extend((node.lineno, module, a.name) for a in node.names if f"{module}.{a.name}" not in modules)
    read = [
        (node.lineno, bound[node.value.id], node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
        if bound[node.value.id] != own and f"{bound[node.value.id]}.{node.attr}" not in modules
    ]
    return taken, read


def name_faults(package_dir: Path = PACKAGE, callers: list[Path] = CALLERS) -> dict[str, list[str]]:
    """What breaks the rules on names in ``package_dir`` and the modules of ``callers``: ``reexported``
    (a name taken from a module that does not define it), ``private`` (a private name taken across
    modules), ``undeclared_all`` (a module's ``__all__`` naming what it does not define)."""
    modules = _modules(package_dir)
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in modules.items()}
    defined = {m: _top_level_names(t) for m, t in trees.items()}
    public = {m: _declared_all(t) if modules[m].name == "__init__.py" else set() for m, t in trees.items()}
    faults: dict[str, list[str]] = {"reexported": [], "private": [], "undeclared_all": []}
    for folder in callers:
        for path in sorted(folder.rglob("*.py")):
            where = path.relative_to(package_dir.parent)
            taken, read = _names_taken(path, modules, package_dir)
            for line, module, name in taken:
                if _is_private(name):
                    faults["private"].append(f"{where}:{line} {module}.{name}")
                if name not in defined[module] and name not in public[module]:
                    faults["reexported"].append(f"{where}:{line} {module}.{name}")
            # A module's attribute read by another: a private one is a private import by another
            # name. (Its other attributes are left alone: a test patches a module's names where
            # they are used.)
            faults["private"].extend(f"{where}:{line} {m}.{name}" for line, m, name in read if _is_private(name))
    for m, path in modules.items():
        if path.name != "__init__.py":
            faults["undeclared_all"].extend(f"{m}.{n}" for n in sorted(_declared_all(trees[m]) - defined[m]))
    return faults


def test_the_rules_on_names_are_read():
    tree = ast.parse(
        "import os\nfrom x import y\ntry:\n    A = 1\nexcept ImportError:\n    B = 2\n"
        "if True:\n    def f(): pass\nclass C: pass\n__all__ = ['A', 'y']\n"
    )
    assert _top_level_names(tree) == {"A", "B", "f", "C", "__all__"}
    assert _declared_all(tree) == {"A", "y"}
    assert _is_private("_fill") and not _is_private("__version__") and not _is_private("fill")
    taken, _ = _names_taken(PACKAGE / "pipeline.py", _modules())
    assert ("wsi_pipeline.config", "RunConfig") in {(m, n) for _, m, n in taken}
    assert not [n for _, m, n in taken if m == "wsi_pipeline.stitch" and n == "stitcher"]  # a submodule


def test_a_facade_a_private_import_and_an_undeclared_all_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub.a import A, B\n__all__ = ['A']\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("import os\nA = 1\nB = 2\n_C = 3\n")
    (pkg / "sub" / "b.py").write_text("from .a import A, os\nfrom . import a\n__all__ = ['A', 'D']\nD = 4\n")
    (pkg / "c.py").write_text("from pkg import A, B\nfrom pkg.sub.a import _C\nfrom pkg.sub import b\nb._x, b.D\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("from pkg.sub.b import A\nfrom pkg.sub.a import B\n")
    faults = name_faults(pkg, [pkg, tmp_path / "tests"])
    assert faults == {
        "reexported": ["pkg/c.py:1 pkg.B", "pkg/sub/b.py:1 pkg.sub.a.os", "tests/t.py:1 pkg.sub.b.A"],
        "private": ["pkg/c.py:2 pkg.sub.a._C", "pkg/c.py:4 pkg.sub.b._x"],
        "undeclared_all": ["pkg.sub.b.A"],
    }


def test_each_name_is_taken_from_the_module_that_defines_it():
    assert name_faults()["reexported"] == []


def test_no_private_name_is_taken_from_another_module():
    assert name_faults()["private"] == []


def test_a_module_declares_only_its_own_names():
    """Only a package's ``__init__`` hands on names it does not define (those of its ``__all__``)."""
    assert name_faults()["undeclared_all"] == []


if __name__ == "__main__":
    for kind, found in name_faults().items():
        print(f"{kind}: {len(found)} ({len({f.split()[-1] for f in found})} names)")
        for f in found:
            print("   ", f)
    print("classes over", MAX_CLASS_LINES, "lines:")
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                print(f"    {path.relative_to(PACKAGE)} {node.name}: {node.end_lineno - node.lineno + 1}")
