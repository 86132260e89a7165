"""The public API is written three times in phalanx/__init__.py, and the three agree:
``__all__`` (what ``from phalanx import *`` and the docs name), ``_EXPORTS`` (the lazy
table, name -> defining module, that ``phalanx.<name>`` loads on first use) and the
``if TYPE_CHECKING:`` imports (what a type checker reads instead of the table). Everything
here is read from the file itself, so the tests follow whatever it says; that the names
resolve as attributes of ``phalanx`` is tests/unit/test_errors.py's
``test_public_errors_are_exported``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import phalanx

INIT = Path(phalanx.__file__)
EXPORTS: dict[str, str] = dict(phalanx._EXPORTS)  # the table under test
NOT_IN_TABLE = {"__version__"}  # in __all__, defined in __init__.py itself


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _type_checking_imports() -> dict[str, str]:
    """name -> module, as the module-level ``if TYPE_CHECKING:`` blocks import them."""
    blocks = [node for node in ast.parse(INIT.read_text()).body
              if isinstance(node, ast.If) and _is_type_checking(node.test)]
    assert blocks, f"{INIT} has no module-level `if TYPE_CHECKING:` block"
    imported: dict[str, str] = {}
    for block in blocks:
        for statement in block.body:
            assert isinstance(statement, ast.ImportFrom) and statement.level == 0, (
                f"line {statement.lineno}: the TYPE_CHECKING block holds only absolute "
                f"`from module import name` statements, not {ast.unparse(statement)!r}"
            )
            for alias in statement.names:
                assert alias.asname in (None, alias.name), (
                    f"line {statement.lineno}: {alias.name} imported as {alias.asname}: "
                    "the public name must be the one its module defines"
                )
                assert alias.name not in imported, (
                    f"line {statement.lineno}: {alias.name} imported twice (from "
                    f"{imported[alias.name]} and {statement.module})"
                )
                imported[alias.name] = statement.module or ""
    return imported


def test_all_is_the_table_and_the_version():
    names = phalanx.__all__
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"__all__ names {twice} more than once"
    not_in_table = sorted(set(names) - set(EXPORTS) - NOT_IN_TABLE)
    not_in_all = sorted((set(EXPORTS) | NOT_IN_TABLE) - set(names))
    assert not not_in_table, f"__all__ names {not_in_table}, which _EXPORTS does not load"
    assert not not_in_all, f"_EXPORTS loads {not_in_all}, which __all__ does not name"


@pytest.mark.parametrize(("name", "module"), sorted(EXPORTS.items()), ids=sorted(EXPORTS))
def test_each_name_is_defined_where_the_table_says(name, module):
    """Defined there, not only re-exported: a class or function moved to another module
    leaves its old home importing it, and the table pointing at the old home."""
    found = importlib.import_module(module)
    assert hasattr(found, name), f"_EXPORTS says {name} is in {module}, which has no {name}"
    defined_in = getattr(getattr(found, name), "__module__", module)
    assert defined_in == module, (
        f"_EXPORTS says {name} is defined in {module}, but it is defined in {defined_in}: "
        "point _EXPORTS (and the TYPE_CHECKING import) at the defining module"
    )


def test_the_type_checking_block_imports_the_table():
    imported = _type_checking_imports()
    missing = sorted(set(EXPORTS) - set(imported))
    extra = sorted(set(imported) - set(EXPORTS))
    elsewhere = sorted(f"{name} from {imported[name]} (_EXPORTS: {EXPORTS[name]})"
                       for name in set(imported) & set(EXPORTS)
                       if imported[name] != EXPORTS[name])
    problems = [f"_EXPORTS names {missing}, which it does not import"] if missing else []
    problems += [f"it imports {extra}, which _EXPORTS does not name"] if extra else []
    problems += [f"it imports {elsewhere}"] if elsewhere else []
    assert not problems, "the TYPE_CHECKING block: " + "; ".join(problems)
