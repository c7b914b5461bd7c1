"""The house rules on the shape of the code, checked over the product packages.

* No product module (``agent/``, ``relay/``, ``traceml_daemon/``, ``traceml_wire/``)
  is over 500 lines; tests, benchmarks and examples are not product.
* No import cycle between product files. Only imports that run when a module loads
  count as edges: statements at module level, including those inside a top-level
  ``if``/``try``/``with`` or a class body, but not those inside a function (a lazy
  import in a function is the deliberate way to break a load-order dependency) nor
  those under ``if TYPE_CHECKING:`` (never executed). An import names the module
  it loads: ``from pkg import name`` points at ``pkg/name.py`` when that file
  exists, else at ``pkg/__init__.py``; the parent packages an import also
  initialises are not edges (a module importing its sibling through a package
  whose ``__init__`` imports it back is how packages work, not a cycle).
* The daemon's top level ``traceml_daemon/`` holds only ``__init__.py``,
  ``__main__.py`` and subpackages (every module lives in a room).
* README.md stays a user's guide: at most 12 KiB.

Each test lists every offender, not just the first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("agent", "relay", "traceml_daemon", "traceml_wire")
MAX_LINES = 500
README_MAX_BYTES = 12 * 1024


def _product_files() -> list[Path]:
    return sorted(
        path for package in PRODUCT for path in (ROOT / package).rglob("*.py") if "__pycache__" not in path.parts
    )


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_product_module_over_the_line_limit() -> None:
    sizes = {_rel(path): len(path.read_text(encoding="utf-8").splitlines()) for path in _product_files()}
    over = [f"{name}: {lines} lines" for name, lines in sorted(sizes.items()) if lines > MAX_LINES]
    assert not over, f"product modules over {MAX_LINES} lines:\n" + "\n".join(over)


# ---------------------------------------------------------------- import graph


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _load_time_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module loads (see the module docstring)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _load_time_imports(node.body)
            yield from _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _load_time_imports(block)
        elif isinstance(node, ast.With | ast.AsyncWith | ast.ClassDef | ast.For | ast.While):
            yield from _load_time_imports(node.body)
            yield from _load_time_imports(getattr(node, "orelse", []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, files: dict[str, Path]) -> set[str]:
    """The product modules ``node`` loads, among ``files`` (module name -> file)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in files}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(filter(None, [*package, base]))
    out: set[str] = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in files:
            out.add(submodule)
        elif base in files:
            out.add(base)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Product file -> the product files it loads, as paths from the repository root."""
    files = {_module_name(path): path for path in _product_files()}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _load_time_imports(tree.body):
            edges |= {_rel(files[name]) for name in _targets(node, module, is_package, files)}
        graph[_rel(path)] = edges - {_rel(path)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"  {', '.join(component)}:\n" + "\n".join(edges)


def test_no_import_cycle_between_product_files() -> None:
    graph = _import_graph()
    cycles = _cycles(graph)
    assert not cycles, "load-time import cycles (files, then their edges within the cycle):\n" + "\n".join(
        _describe(component, graph) for component in cycles
    )


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_only_load_time_imports_are_edges() -> None:
    tree = ast.parse(
        "import x\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden\nelse:\n    import shown\n"
        "try:\n    import tried\nexcept ImportError:\n    import fallback\n"
        "def f():\n    import lazy\n"
        "class C:\n    import in_class\n"
    )
    names = {a.name for node in _load_time_imports(tree.body) if isinstance(node, ast.Import) for a in node.names}
    assert names == {"x", "shown", "tried", "fallback", "in_class"}


# ---------------------------------------------------------------- rooms and README


def test_daemon_top_level_holds_only_its_entry_points_and_rooms() -> None:
    top = ROOT / "traceml_daemon"
    stray = [
        entry.name
        for entry in sorted(top.iterdir())
        if entry.name not in ("__init__.py", "__main__.py", "__pycache__")
        and not (entry.is_dir() and (entry / "__init__.py").is_file())
    ]
    assert not stray, "traceml_daemon/ should hold only __init__.py, __main__.py and subpackages; also:\n" + "\n".join(
        stray
    )


def test_readme_stays_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES} (12 KiB)"
