"""No import cycle among kvdi's modules, counting every import that can run.

Every module under ``kvdi/`` is parsed with :mod:`ast` and every ``import`` statement at any
depth is an edge: top-level ones, lazy ones inside functions and methods, relative and
absolute. ``from kvdi.x import y`` is an edge to ``kvdi.x.y`` when ``y`` is a submodule,
else to ``kvdi.x``. Imports under ``if TYPE_CHECKING:`` never run, so they are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvdi"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """``kvdi.a.b`` -> its file, for every module and package of ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(other)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports(child)


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvdi modules that module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin for alias in node.names
            ]
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of mutually importing modules (strongly connected component)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    cycles, grouped = [], set()
    for node in sorted(graph):
        if node in grouped or node not in reach[node]:
            continue
        group = {other for other in reach[node] if node in reach[other]}
        grouped |= group
        cycle = find_cycle({n: graph[n] & group for n in group})
        assert cycle is not None
        cycles.append(cycle)
    return cycles


def test_the_walker_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "kvdi"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from kvdi import top\n")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvdi.sub\nimport os\nfrom .sub.leaf import f\n"
    )
    modules = module_names(pkg)
    known = set(modules)
    graph = {name: imported_modules(name, path, known) for name, path in modules.items()}
    assert graph == {"kvdi": set(), "kvdi.sub": {"kvdi.sub.leaf"}, "kvdi.sub.leaf": {"kvdi.top"},
                     "kvdi.top": {"kvdi.sub.leaf"}}  # fmt: skip
    assert find_cycle(graph) == ["kvdi.sub.leaf", "kvdi.top", "kvdi.sub.leaf"]
    assert all_cycles(graph) == [["kvdi.sub.leaf", "kvdi.top", "kvdi.sub.leaf"]]


def test_kvdi_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 30 and "kvdi.connectors.store" in graph["kvdi.connectors.multi"]
    cycles = all_cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
