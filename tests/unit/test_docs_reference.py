"""The documentation site's made pages (docs/hooks/): every public name has its entry in
the API reference, the guides keep all of the README, and the docstrings' reST roles become
cross-references, with a role that names nothing reported.

The page generator is plain Python, so these run without mkdocs; the role rewriting is a
griffe extension, and its tests skip, saying why, where griffe (the docs extra) is missing.
``scripts/docs`` builds the site itself, in CI too.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import phalanx

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "docs" / "hooks"


def _load(name: str) -> ModuleType:
    module_name = f"phalanx_docs_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HOOKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


pages = _load("pages")


def test_every_public_name_has_one_entry_in_the_reference():
    entries: dict[str, list[str]] = {}
    for page in pages.reference_pages():
        for line in page.text.splitlines():
            if line.startswith(":::"):
                entries.setdefault(line.split()[1], []).append(page.path)
    expected = {f"phalanx.{name}" for name in phalanx.__all__}
    missing = sorted(expected - set(entries))
    assert not missing, f"no reference entry for {missing}"
    twice = {name: where for name, where in entries.items() if len(where) > 1}
    assert not twice, f"entries on more than one page: {twice}"
    unexported = sorted(set(entries) - expected)
    assert not unexported, f"reference entries for names not in phalanx.__all__: {unexported}"


def test_the_reference_nav_lists_every_page_once():
    reference = pages.reference_pages()
    paths = [page.path for page in reference]
    assert paths[0] == "reference/index.md"
    assert len(paths) == len(set(paths))
    index = reference[0].text
    for page in reference[1:]:
        assert f"({Path(page.path).name})" in index, f"the index does not link {page.path}"


def test_topics_name_modules_that_exist():
    for topic in pages.TOPICS:
        for module in topic.modules:
            assert importlib.util.find_spec(module) is not None, (
                f"topic {topic.title!r} names {module}, which does not exist")


def _same_lines(ours: list[str], theirs: list[str], where: str) -> None:
    """The README's lines, headings one level up and links rewritten, nothing else."""
    assert len(ours) == len(theirs), f"{where} is not the whole of its README text"
    for mine, original in zip(ours, theirs, strict=True):
        if original.startswith("###"):
            assert mine == original[1:], where
        elif "](" not in original:
            assert mine == original, where


def test_the_guides_are_the_readme_split_not_rewritten():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    opening, sections = pages.split_readme(readme)
    assert sections, "the README has no ## sections"
    guides = {page.path: page for page in pages.guide_pages(readme)}
    home = guides.pop("index.md").text.splitlines()
    _same_lines(home[: len(opening)], opening, "index.md")
    by_title = {page.text.splitlines()[0][2:]: page for page in guides.values()}
    for title, lines in sections:
        if title in pages.HOME_SECTIONS:
            start = home.index(f"## {title}") + 1
            # on the home page the section keeps its heading levels
            assert home[start:start + len(lines)] == pages._page_lines(lines, "index.md", up=0)
            continue
        page = by_title.get(title)
        assert page is not None, f"README section {title!r} has no page"
        _same_lines(page.text.splitlines()[1:], lines, page.path)
    assert len(by_title) == len(sections) - len(
        [title for title, _ in sections if title in pages.HOME_SECTIONS])


def test_guide_links_into_docs_are_relative_to_the_page():
    text = "See [the map](docs/architecture.md), [bench](bench/README.md), [x](https://a.b/c)."
    lines = pages.guide_pages(f"# t\n\n## Some guide: more\n\n{text}\n")[1].text.splitlines()
    assert lines[0] == "# Some guide: more"
    assert lines[2] == ("See [the map](../architecture.md), bench (`bench/README.md`), "
                        "[x](https://a.b/c).")


def test_readme_split_ignores_headings_in_code_blocks():
    opening, sections = pages.split_readme("# t\n\n```\n## not a section\n```\n## Real\nx\n")
    assert [title for title, _ in sections] == ["Real"]
    assert "## not a section" in opening


# -- the reST roles (a griffe extension) ------------------------------------------------


@pytest.fixture
def load_demo(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A small package written to tmp_path, loaded by griffe with the roles extension."""
    griffe = pytest.importorskip(
        "griffe", reason="griffe (the docs extra: pip install -e '.[docs]') is not installed")
    roles = _load("docstrings")

    def load(files: dict[str, str]) -> tuple[object, list[str]]:
        package = tmp_path / "demo"
        package.mkdir()
        for name, source in files.items():
            (package / name).write_text(textwrap.dedent(source))
        extension = roles.Roles(package="demo")
        with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.phalanx.roles"):
            pkg = griffe.load("demo", search_paths=[tmp_path],
                              extensions=griffe.load_extensions(extension))
        return pkg, extension.errors

    return load


DEMO_INIT = '''
    """The demo package."""
    from demo.core import Thing, make
    __all__ = ["Thing", "make"]
'''


def test_roles_become_links_to_public_entries(load_demo):
    pkg, errors = load_demo({"__init__.py": DEMO_INIT, "core.py": '''
        """Core: :class:`Thing` lives here."""

        class _Base:
            def run(self) -> None:
                """Run it; see :meth:`_Base.run`."""

        class Thing(_Base):
            """A thing made by :func:`~demo.core.make`; :meth:`run` it, :meth:`stop` it,
            or :meth:`_hidden`. See :mod:`demo.core`, :class:`ValueError`,
            :class:`the thing <demo.Thing>` and :class:`!Thing`. For example::

                Thing().run()
            """

            def stop(self) -> None:
                """Stop :class:`Thing`."""

            def _hidden(self) -> None:
                pass

        def make() -> Thing:
            """Make a :class:`Thing`."""
            return Thing()
    '''})
    assert errors == []
    thing = pkg["core.Thing"].docstring.value
    assert "A thing made by [`make()`][demo.make];" in thing
    assert "[`run()`][demo.Thing.run] it" in thing  # inherited from an internal base
    assert "[`stop()`][demo.Thing.stop] it" in thing
    assert "or `_hidden()`." in thing  # exists, but the reference does not show it
    assert "See `demo.core`, `ValueError`," in thing
    assert "[`the thing`][demo.Thing] and `Thing`." in thing
    assert "For example:\n" in thing and "::" not in thing
    assert pkg["core.Thing.stop"].docstring.value == "Stop [`Thing`][demo.Thing]."
    # shown as Thing.run: its docstring is rewritten from its own scope (the internal base)
    assert pkg["core._Base.run"].docstring.value == "Run it; see [`_Base.run()`][demo.Thing.run]."
    # a docstring the reference does not show is left as written
    assert pkg["core"].docstring.value == "Core: :class:`Thing` lives here."


def test_a_role_that_names_nothing_is_an_error(load_demo, caplog):
    pkg, errors = load_demo({"__init__.py": DEMO_INIT, "core.py": '''
        class Thing:
            """See :meth:`strat` and :class:`demo.core.Thingy`."""

        def make() -> Thing:
            return Thing()
    '''})
    assert len(errors) == 2
    assert re.search(r"demo\.core\.Thing: .*:meth:`strat` names nothing", errors[0])
    assert ":class:`demo.core.Thingy`" in errors[1]
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert pkg["core.Thing"].docstring.value == "See `strat()` and `demo.core.Thingy`."
