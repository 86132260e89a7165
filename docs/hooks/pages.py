"""The pages of the documentation site that are made, not written: a mkdocs hook.

Two kinds, so that no text is kept twice and no public name can be left out:

* The guides are the README's own sections: ``index.md`` is its opening and its quick
  start, and each other ``##`` section becomes a page under ``guide/`` (its headings one
  level up, its links into ``docs/`` made relative to the page). A new README section is a
  new page.
* The API reference follows ``phalanx.__all__``: every exported name gets a ``:::``
  entry (mkdocstrings renders it from the docstrings) on the page of its topic, picked by
  the module that defines it (:data:`TOPICS`); a name whose module no topic claims lands on
  the "More names" page, so a new export is documented the moment it is exported.
  ``tests/unit/test_docs_reference.py`` checks that every name has its entry.

mkdocs calls :func:`on_config` (the navigation, built from both) and :func:`on_files` (the
pages themselves). Everything above those two is plain Python without mkdocs, so that the
test can run it where mkdocs is not installed.
"""

from __future__ import annotations

import importlib
import inspect
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PACKAGE = "phalanx"

# README sections shown on the home page, under the README's opening.
HOME_SECTIONS = ("Quick start",)


@dataclass(frozen=True)
class Topic:
    """One page of the reference: the names defined in ``modules`` (or below them)."""

    slug: str
    title: str
    intro: str
    modules: tuple[str, ...]


# In the order of the navigation; within a page, names go in the order of ``modules``, then
# of their definitions in the source (so the exception tree reads top-down).
TOPICS = (
    Topic("worker-group", "WorkerGroup",
          "The group of worker processes: starting it, calling its ranks, watching and "
          "resizing it, stopping it.",
          ("phalanx.controller.group", "phalanx.controller.callforms",
           "phalanx.world.calloptions", "phalanx.controller.state",
           "phalanx.controller.lifecycle")),
    Topic("futures", "Futures",
          "What the asynchronous call forms return.",
          ("phalanx.controller.futures",)),
    Topic("refs", "Results kept on ranks",
          "Results that stay on the ranks that made them (``keep=True``), their parts and "
          "their rows.",
          ("phalanx.controller.refs", "phalanx.rank.kept", "phalanx.controller.chunks")),
    Topic("groups", "Several groups",
          "Groups sharing one job's resources, and parts of a group.",
          ("phalanx.controller.pool", "phalanx.controller.slices")),
    Topic("spmd", "SPMD, meshes and joint worlds",
          "A mesh over a group's ranks, plain functions on every rank, a distributed world "
          "made of several groups, and weights sent from one group to another.",
          ("phalanx.controller.spmd", "phalanx.world.sharding", "phalanx.controller.joint",
           "phalanx.rank.joint", "phalanx.controller.weightsync", "phalanx.world.syncplan")),
    Topic("backends", "Backends",
          "Where the ranks run: child processes of this one, Ray actors, your own nodes "
          "(``phalanx agent``) or a Slurm allocation.",
          ("phalanx.backends.local", "phalanx.backends.ray", "phalanx.backends.cluster.backend",
           "phalanx.backends")),
    Topic("observing", "Supervision and traces",
          "What a group tells about its ranks, traces of its calls, and the dashboard.",
          ("phalanx.controller.watch", "phalanx.controller.trace", "phalanx.monitor")),
    Topic("debugging", "Debugging and fault injection",
          "Stopping one rank in a debugger, and failures made on purpose in your own tests.",
          ("phalanx.rank.debugger", "phalanx.rank.faults")),
    Topic("errors", "Exceptions",
          "The errors phalanx raises and the records they carry; most derive from "
          "[`PhalanxError`][phalanx.PhalanxError].",
          ("phalanx.errors",)),
)
MORE = Topic("more", "More names", "Exported names that no other page of this reference "
             "covers yet.", ())


@dataclass(frozen=True)
class Page:
    path: str  # relative to docs/
    nav_title: str
    text: str


# -- the API reference -----------------------------------------------------------------


def exported_names() -> list[str]:
    """``phalanx.__all__``, as the package declares it."""
    return list(importlib.import_module(PACKAGE).__all__)


def defined_in(name: str) -> tuple[str | None, int]:
    """The module that defines an exported name, and the line where (None, 0: a value)."""
    value = getattr(importlib.import_module(PACKAGE), name)
    if not (inspect.isclass(value) or inspect.isroutine(value)):
        return None, 0  # a plain value such as __version__: shown on the reference's index
    try:
        line = inspect.getsourcelines(value)[1]
    except (OSError, TypeError):
        line = 0
    return value.__module__, line


def topic_of(module: str) -> tuple[Topic, int]:
    """The topic whose modules hold ``module``, and which of them (its order on the page)."""
    for topic in TOPICS:
        for index, prefix in enumerate(topic.modules):
            if module == prefix or module.startswith(prefix + "."):
                return topic, index
    return MORE, 0


def reference_pages() -> list[Page]:
    """The reference: an index, then one page per topic that has names."""
    by_topic: dict[str, list[tuple[int, str, int, str]]] = {}
    values: list[str] = []
    for name in exported_names():
        module, line = defined_in(name)
        if module is None:
            values.append(name)
            continue
        topic, index = topic_of(module)
        by_topic.setdefault(topic.slug, []).append((index, module, line, name))
    pages = []
    index_lines = [
        "# API reference",
        "",
        f"Every name of `{PACKAGE}.__all__`, from the docstrings: `import {PACKAGE} as px`, "
        "then `px.WorkerGroup`, `px.WorkerDied`, ... Nothing else of the package is public.",
        "",
    ]
    for topic in (*TOPICS, MORE):
        entries = sorted(by_topic.get(topic.slug, []))
        if not entries:
            continue
        path = f"reference/{topic.slug}.md"
        names = [name for _, _, _, name in entries]
        lines = [f"# {topic.title}", "", topic.intro, ""]
        lines += [f"::: {PACKAGE}.{name}\n" for name in names]
        pages.append(Page(path, topic.title, "\n".join(lines)))
        index_lines.append(f"## [{topic.title}]({topic.slug}.md)")
        index_lines.append("")
        index_lines.append(", ".join(f"[`{name}`][{PACKAGE}.{name}]" for name in names))
        index_lines.append("")
    if values:
        index_lines += ["## Values", ""]
        index_lines += [f"::: {PACKAGE}.{name}\n" for name in values]
    return [Page("reference/index.md", "Overview", "\n".join(index_lines)), *pages]


# -- the guides, from the README ---------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def _slug(title: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", title.split(":")[0].lower()).split()
    return "-".join(words) or "section"


def _nav_title(title: str) -> str:
    return title.split(":")[0].replace("`", "").strip()


def split_readme(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The README's opening lines, and its ``##`` sections as (title, lines) in order."""
    opening: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            opening.append(line)
    return opening, sections


def _page_lines(lines: list[str], page: str, *, up: int) -> list[str]:
    """Headings ``up`` levels up; links into docs/ relative to ``page``; links to other
    files of the repository (not part of the site) as their path in plain text."""
    out = []
    fenced = False
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced:
            if up and re.match(r"#{2,6} ", line):
                line = line[up:]
            line = _LINK.sub(lambda m: _relink(m, page), line)
        out.append(line)
    return out


def _relink(match: re.Match[str], page: str) -> str:
    text, target = match.group(1), match.group(2)
    if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor, a site path
        return match.group(0)
    if target.startswith("docs/"):
        return f"[{text}]({posixpath.relpath(target[5:], posixpath.dirname(page) or '.')})"
    return text if text.strip("`") == target else f"{text} (`{target}`)"


def guide_pages(readme: str) -> list[Page]:
    """The home page (the README's opening and quick start) and one page per other section."""
    opening, sections = split_readme(readme)
    home = _page_lines(opening, "index.md", up=0)
    pages = []
    for title, lines in sections:
        if title in HOME_SECTIONS:
            home += [f"## {title}", *_page_lines(lines, "index.md", up=0)]
            continue
        path = f"guide/{_slug(title)}.md"
        text = "\n".join([f"# {title}", *_page_lines(lines, path, up=1), ""])
        pages.append(Page(path, _nav_title(title), text))
    return [Page("index.md", "Home", "\n".join([*home, ""])), *pages]


# -- the mkdocs hook -------------------------------------------------------------------


def _pages() -> tuple[list[Page], list[Page]]:
    return guide_pages(README.read_text(encoding="utf-8")), reference_pages()


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """The navigation: home, the guides, the hand-written pages, the reference."""
    guides, reference = _pages()
    written = config.nav or []  # mkdocs.yml's own nav: the pages written by hand
    nav: list[Any] = [{"Home": "index.md"}]
    nav.append({"Guides": [{page.nav_title: page.path} for page in guides[1:]]})
    nav.extend(written)
    nav.append({"API reference": [{page.nav_title: page.path} for page in reference]})
    config.nav = nav
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from mkdocs.structure.files import File

    guides, reference = _pages()
    for page in (*guides, *reference):
        if files.get_file_from_path(page.path) is not None:
            raise ValueError(f"docs/{page.path} is generated by docs/hooks/pages.py: "
                             "remove the written one")
        files.append(File.generated(config, page.path, content=page.text))
    return files
