"""The tree keeps the shape docs/architecture.md draws: every module on the map, packages
with their docstrings, no god module, a short top level, and no import circle at run time.

The layers themselves are import-linter contracts in pyproject.toml (``lint-imports``, run
by scripts/test); these tests hold what a contract cannot say.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "phalanx"
MAP = REPO / "docs" / "architecture.md"

# Modules are split by concept, never to meet a line count; this is only a ceiling
# against god modules (several concepts grown into one file), not a size to aim under.
MAX_LINES = 1000
MAX_TOP_LEVEL_MODULES = 15


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    """``controller/group.py``, or ``controller/`` for a package's ``__init__.py``."""
    relative = path.relative_to(PACKAGE)
    if relative.name == "__init__.py":
        return f"{relative.parent.as_posix()}/" if relative.parent.parts else "__init__.py"
    return relative.as_posix()


def test_the_map_names_every_module():
    text = MAP.read_text()
    missing = [_name(p) for p in _modules() if f"`{_name(p)}`" not in text]
    assert not missing, (
        f"docs/architecture.md does not name {', '.join(missing)}: add each to the map "
        "(written as `package/module.py`, or `package/` for a package)"
    )


def test_the_map_names_no_module_that_is_gone():
    names = {_name(p) for p in _modules()}
    mentioned = set(re.findall(r"`([a-z_][a-z0-9_/]*(?:\.py|/))`", MAP.read_text()))
    elsewhere = ("tests/", "bench/", "examples/", "docs/", "scripts/", ".ci/", "setup.py")
    stale = sorted(m for m in mentioned if not m.startswith(elsewhere) and m not in names)
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_every_subpackage_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(REPO)} has no docstring"
        if init.parent != PACKAGE:
            assert "import" in doc, f"{init.relative_to(REPO)}: say what it may import"


def test_no_god_module():
    """No module over MAX_LINES (the ceiling against god modules)."""
    sizes = {_name(p): len(p.read_text().splitlines()) for p in _modules()}
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, (
        f"modules over {MAX_LINES:,} lines: {over}; split each along the concepts it holds "
        "(not at a line number)"
    )


def test_the_top_level_is_short():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_import_circle_at_run_time():
    """Every import that runs (at module level or inside a function; not those under
    ``TYPE_CHECKING``) goes one way: an import moved into a function to dodge a circle
    is still a circle."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (phalanx[test])")
    graph = grimp.build_graph("phalanx", exclude_type_checking_imports=True)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_worker_group_is_made_of_parts_not_mixins():
    """Its one base is the call forms it shares with its slices and options views (a
    path, a scope and an options record); every other part is held, not inherited."""
    from phalanx.controller.callforms import CallForms, CallView
    from phalanx.controller.group import WorkerGroup
    from phalanx.controller.slices import GroupSlice

    assert WorkerGroup.__mro__ == (WorkerGroup, CallForms, object), WorkerGroup.__mro__
    assert GroupSlice.__mro__ == (GroupSlice, CallForms, object)
    assert CallView.__mro__ == (CallView, CallForms, object)


def test_a_rank_has_one_state_and_health_keeps_its_words():
    from phalanx.controller.ranks import RankState

    assert {state.health for state in RankState} == {"starting", "ready", "unresponsive",
                                                     "dead"}
