"""docs/architecture.md stays true: every module and name in its tables exists.

The tables map a concern to a module and the function or class to start reading
at. A move or a rename that forgets the page fails here, naming the row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
ROW = re.compile(
    r"^\|\s*(?P<concern>[^|`]+?)\s*\|\s*`(?P<path>[^`]+)`\s*\|\s*`(?P<name>[^`]+)`\s*\|$"
)
SEVEN = (
    "claiming",
    "publishing",
    "finalizing",
    "draining",
    "shard ownership",
    "offset committing",
    "dead-lettering",
)


def rows() -> list[tuple[str, str, str]]:
    found = []
    for line in PAGE.read_text().splitlines():
        m = ROW.match(line.strip())
        if m:
            found.append((m["concern"], m["path"], m["name"]))
    return found


def defined(tree: ast.Module, dotted: str) -> bool:
    """``name`` or ``Class.member`` defined at the top of the module (a function, a
    class, an assignment, or an import re-exported under that name)."""
    scope: list[ast.stmt] = list(tree.body)
    for part in dotted.split("."):
        found = None
        for node in scope:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == part:
                    found = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = list(found.body) if isinstance(found, ast.ClassDef) else []
    return True


def test_the_page_has_both_tables() -> None:
    assert len(rows()) >= len(SEVEN) + 10, "the tables were not found; did the format change?"


def test_each_of_the_seven_concerns_points_at_one_module() -> None:
    by_concern: dict[str, set[str]] = {}
    for concern, path, _ in rows():
        by_concern.setdefault(concern, set()).add(path)
    for concern in SEVEN:
        assert len(by_concern.get(concern, set())) == 1, concern
    modules = [next(iter(by_concern[c])) for c in SEVEN]
    assert len(set(modules)) == len(SEVEN), "two concerns share a module"
    for concern, module in zip(SEVEN, modules, strict=True):
        assert named_for(concern, Path(module)), f"{concern}: {module} is not named for it"


def named_for(concern: str, module: Path) -> bool:
    """``claim`` for claiming, ``dlq`` for dead-lettering; a module of a package
    named for it, such as ``ownership/base`` for shard ownership."""
    if module.stem == "dlq":
        return concern == "dead-lettering"
    names = (module.stem, module.parent.name)
    return any(word[:4] == name[:4] for word in re.split(r"[\s-]+", concern) for name in names)


@pytest.mark.parametrize(("concern", "path", "name"), rows())
def test_row_names_an_existing_module_and_name(concern: str, path: str, name: str) -> None:
    file = REPO / path
    assert file.is_file(), f"{concern}: {path} does not exist"
    tree = ast.parse(file.read_text(), filename=str(file))
    assert defined(tree, name), f"{concern}: {path} defines no {name}"


#: The size from which a module must be listed, with its size, in the page's
#: "Modules over 500 lines" section; and the size no library module may reach.
LISTED_FROM, LIMIT = 500, 700
LISTED = re.compile(r"^- `(?P<path>[^`]+)` \(about (?P<lines>\d+) lines\)", re.MULTILINE)


def library_sizes() -> dict[str, int]:
    """Lines of every library module (the packages the distribution installs)."""
    sizes = {}
    for folder in ("relay", "consumer", "schema", "outboxkit"):
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                sizes[str(path.relative_to(REPO))] = len(path.read_text().splitlines())
    return sizes


def test_no_library_module_reaches_the_limit() -> None:
    over = {p: n for p, n in library_sizes().items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"


def test_every_large_module_is_listed_with_its_real_size() -> None:
    section = PAGE.read_text().split("## Modules over 500 lines", 1)[1]
    listed = {m["path"]: int(m["lines"]) for m in LISTED.finditer(section)}
    sizes = library_sizes()
    large = {p for p, n in sizes.items() if n > LISTED_FROM}
    assert large <= set(listed), f"not listed: {sorted(large - set(listed))}"
    for path, said in listed.items():
        assert path in sizes, f"{path} is listed but is no library module"
        real = sizes[path]
        assert abs(real - said) <= real / 10, f"{path}: the page says about {said}, it has {real}"
