"""The library's modules import each other without cycles.

A cycle hides even when Python tolerates it: behind ``if TYPE_CHECKING:``, in a
function-level import, or in an order of imports that happens to work today.
Each one means two modules that cannot be read, tested or moved apart, so this
builds the import graph from the source (every ``import`` and ``from ...
import`` anywhere in a file, by the module's real package path) and fails on
any strongly connected component of more than one module.

Folders map to packages through ``[tool.setuptools.package-dir]`` of
pyproject.toml (``consumer/`` is ``outboxkit.consumer``). An import names the
module it loads: ``from pkg import name`` is ``pkg.name`` when that is a module,
else ``pkg``; a parent package is not counted as imported, or every module of a
package whose ``__init__`` re-exports would be one cycle with it.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

#: Cycles tolerated for now: none. Should one ever have to be listed, the test
#: also fails once it no longer exists, so the list only shrinks.
ALLOWED: frozenset[frozenset[str]] = frozenset()


def package_dirs() -> dict[str, Path]:
    """Each package of the distribution and its folder, as pyproject.toml maps them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {package: REPO / folder for package, folder in mapping.items()}


def modules() -> dict[str, tuple[Path, str]]:
    """Every module of the library: its dotted name, its file and its package.

    A package's folder holds its own modules only; a subfolder that is a
    package is listed in pyproject.toml on its own.
    """
    found: dict[str, tuple[Path, str]] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = (path, package)
    return found


def imported(tree: ast.Module, package: str, known: set[str]) -> Iterator[str]:
    """The library modules a file imports, wherever the import stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _deepest(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:  # from pkg import module
                    yield f"{source}.{alias.name}"
                else:
                    yield from _deepest(source, known)


def _deepest(dotted: str, known: set[str]) -> Iterator[str]:
    """``a.b.c`` names the deepest of ``a.b.c``, ``a.b``, ``a`` that is a module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in known:
            yield name
            return


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in found.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set(imported(tree, package, known)) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
    return found


def _names(components: set[frozenset[str]]) -> list[str]:
    return sorted(" <-> ".join(sorted(c)) for c in components)


def test_the_graph_covers_every_package() -> None:
    """A mapping or a parse that went wrong would find no cycle in an empty graph."""
    graph = import_graph()
    for package in package_dirs():
        assert package in graph, package
    assert "outboxkit.consumer.drain" in graph["outboxkit.consumer.base"]  # from pkg import mod
    assert "outboxkit.consumer.base" in graph["outboxkit.consumer.cli"]


def test_the_library_has_no_import_cycle_but_the_allowed_ones() -> None:
    found = cycles(import_graph())
    new = found - ALLOWED
    assert not new, f"import cycles: {_names(new)}"
    gone = ALLOWED - found
    assert not gone, f"no longer cycles, remove them from ALLOWED: {_names(gone)}"


def test_cycles_are_found_whatever_hides_them(tmp_path: Path) -> None:
    """The graph sees imports under ``TYPE_CHECKING``, in functions, relative ones."""
    source = """
from typing import TYPE_CHECKING
from . import b
if TYPE_CHECKING:
    from .c import Thing
def later():
    import pkg.d
"""
    tree = ast.parse(source)
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    assert set(imported(tree, "pkg", known)) == {"pkg.b", "pkg.c", "pkg.d"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == {frozenset({"a", "b", "c"})}
