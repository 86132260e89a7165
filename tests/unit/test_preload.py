"""Which modules a node preloads and forks a group's ranks from (``preload=``): the choice
of :mod:`phalanx.world.preload`, pure, no processes.

- :func:`imported_packages` reads the packages a module's source imports at its top level
  (what the default preloads, after the caller keeps the installed ones): ``import a.b``
  and ``from a import b`` count as ``a``; relative imports, and imports inside functions,
  classes, ``if`` or ``try`` blocks, do not (they may never run, or run later);
- :func:`preload_modules` puts the rank runtime first, then the framework's modules, then
  the packages (less those that read a rank's environment as they are imported), or the
  user's list; nothing where ranks are not forked;
- :func:`check_preload` refuses what is not ``True``, ``False``, ``None`` or a list of
  module names, naming the value.
"""

from __future__ import annotations

import keyword
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.world.preload import (
    RUNTIME,
    UNSAFE,
    check_preload,
    imported_packages,
    preload_modules,
)

# -- imported_packages ------------------------------------------------------------------


def test_top_level_imports_count_as_their_first_component():
    source = "import torch.nn\nfrom transformers.models import bert\nimport numpy as np\n"
    assert imported_packages(source) == ["torch", "transformers", "numpy"]


def test_one_import_statement_may_name_several_packages():
    assert imported_packages("import os, json.decoder, yaml\n") == ["os", "json", "yaml"]


def test_relative_imports_are_the_users_own_and_not_counted():
    source = "from . import sibling\nfrom .models import net\nfrom ..up import x\nimport a\n"
    assert imported_packages(source) == ["a"]


def test_imports_inside_functions_classes_and_blocks_are_not_counted():
    source = textwrap.dedent("""
        import first

        def later():
            import in_def

        async def later_async():
            import in_async_def

        class Model:
            import in_class

        if TYPE_CHECKING:
            import in_if
        try:
            import in_try
        except ImportError:
            import in_except
        with ctx:
            import in_with
        for _ in ():
            import in_for
        while False:
            import in_while

        from last import thing
    """)
    assert imported_packages(source) == ["first", "last"]


def test_packages_keep_their_first_order_without_repeats():
    source = "import b\nimport a.x\nfrom b.y import z\nimport a\nimport c\nfrom a import w\n"
    assert imported_packages(source) == ["b", "a", "c"]


@pytest.mark.parametrize("source", [
    "import (",
    "def f(:\n    pass\n",
    "import a\n  import b\n",  # an indentation error
    "x = 'unterminated\n",
    "import a\x00\n",  # a null byte: ValueError from the parser on some Pythons
])
def test_source_that_does_not_parse_imports_nothing(source):
    assert imported_packages(source) == []


def test_source_without_imports_imports_nothing():
    assert imported_packages("") == []
    assert imported_packages("x = 1\nprint(x)\n") == []


_IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name) and not keyword.issoftkeyword(name))
_DOTTED = st.lists(_IDENTIFIERS, min_size=1, max_size=3).map(".".join)


@given(imports=st.lists(st.tuples(_DOTTED, st.booleans()), max_size=12))
def test_rendered_imports_give_the_unique_first_components_in_order(imports):
    """Each name as ``import a.b.c`` or ``from a.b import c``: the result is the names'
    first components, each once, in the order they first appear."""
    names = [name for name, _ in imports]
    lines = []
    for name, plain in imports:
        head, _, rest = name.rpartition(".")
        if plain or not head:  # "from a import b" needs a module and a name
            lines.append(f"import {name}")
        else:
            lines.append(f"from {head} import {rest}")
    expected = list(dict.fromkeys(name.split(".")[0] for name in names))
    assert imported_packages("\n".join(lines) + "\n") == expected


# -- preload_modules --------------------------------------------------------------------


def test_false_preloads_nothing():
    assert preload_modules(False, ("torch",), ("numpy",), forks=True) == ()


@pytest.mark.parametrize("preload", [None, True, False, ["numpy"]])
def test_nothing_is_preloaded_where_ranks_are_not_forked(preload):
    assert preload_modules(preload, ("torch",), ("numpy",), forks=False) == ()


@pytest.mark.parametrize("preload", [None, True])
def test_the_default_is_the_runtime_then_the_framework_then_the_packages(preload):
    modules = preload_modules(preload, ("torch",), ("numpy", "transformers"), forks=True)
    assert modules == (RUNTIME, "torch", "numpy", "transformers")


@pytest.mark.parametrize("unsafe", sorted(UNSAFE))
def test_the_default_leaves_out_packages_that_read_a_ranks_environment_on_import(unsafe):
    modules = preload_modules(None, (), ("numpy", unsafe, "yaml"), forks=True)
    assert modules == (RUNTIME, "numpy", "yaml")


def test_the_unsafe_packages_are_the_ones_that_read_the_environment_as_imported():
    assert {"jax", "tensorflow", "ray", "phalanx"} <= UNSAFE


def test_the_default_without_framework_or_packages_is_the_runtime_alone():
    assert preload_modules(None, (), (), forks=True) == (RUNTIME,)


def test_a_list_is_the_runtime_and_that_list_alone():
    modules = preload_modules(["numpy", "torch.nn"], ("torch",), ("yaml",), forks=True)
    assert modules == (RUNTIME, "numpy", "torch.nn")


def test_a_list_is_taken_as_given_even_with_a_package_the_default_leaves_out():
    assert preload_modules(["jax"], (), (), forks=True) == (RUNTIME, "jax")


def test_an_empty_list_is_the_runtime_alone():
    assert preload_modules([], ("torch",), ("numpy",), forks=True) == (RUNTIME,)


@pytest.mark.parametrize(("preload", "framework", "packages", "expected"), [
    (None, ("torch",), ("torch", "numpy", "torch"), (RUNTIME, "torch", "numpy")),
    (None, (), (RUNTIME, "numpy"), (RUNTIME, "numpy")),
    (["numpy", "numpy", RUNTIME], (), (), (RUNTIME, "numpy")),
    (("a", "b", "a"), (), (), (RUNTIME, "a", "b")),
])
def test_no_module_is_named_twice(preload, framework, packages, expected):
    assert preload_modules(preload, framework, packages, forks=True) == expected


# -- check_preload ----------------------------------------------------------------------


@pytest.mark.parametrize("preload", [
    None, True, False, [], (), ["numpy"], ["torch.nn", "_private", "a1.b_2"], ("numpy",),
])
def test_true_false_none_and_lists_of_module_names_are_accepted(preload):
    check_preload(preload)


@pytest.mark.parametrize("preload", ["numpy", "", 3, 0.5, {"numpy": True}, {"numpy"}, object()])
def test_what_is_not_a_list_of_names_is_a_type_error_naming_it(preload):
    with pytest.raises(TypeError, match="preload") as info:
        check_preload(preload)
    assert repr(preload) in str(info.value)


@pytest.mark.parametrize("name", ["1abc", "a..b", "", ".a", "a.", "a b", "a-b", "a/b", 3,
                                  None, b"numpy"])
def test_a_list_with_what_is_not_a_module_name_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match="preload") as info:
        check_preload(["numpy", name])
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("preload", ["numpy", 3, ["1abc"]])
def test_preload_modules_checks_its_argument_first(preload):
    with pytest.raises((TypeError, ValueError), match="preload"):
        preload_modules(preload, (), (), forks=False)
