"""The package's shape: no import circle, no module over 600 lines, no function over 80.

A module that grows past these limits is split by job; a function, into named steps.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import wsi_pipeline

PACKAGE = Path(wsi_pipeline.__path__[0])
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


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


def test_no_module_imports_itself_back_through_others():
    """A package's ``__init__`` handing on its modules' names is not a circle: it is left out
    when it imports only from below itself."""
    graph = _graph()
    # An ``__init__`` importing its own modules, and a module importing a sibling through the
    # package face, would make every package one circle; the face is followed only outwards.
    for name, path in _modules().items():
        if path.name == "__init__.py":
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert _circles(graph) == []


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
