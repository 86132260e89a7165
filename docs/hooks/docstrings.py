"""What the API reference shows of phalanx's docstrings: griffe extensions that mkdocs.yml
hands to mkdocstrings. :class:`Roles` turns reST roles into cross-references;
:class:`PlainInstanceAttributes` drops the ``rank = rank`` an ``__init__`` assignment
would show as an attribute's value.

The docstrings are written for a reader of the source, with Sphinx's roles::

    :class:`~phalanx.controller.slices.GroupSlice`   :meth:`stop`   :mod:`.group`

mkdocstrings renders Markdown, where those would show as a stray ``:class:`` before code.
Once griffe has loaded the package, this extension rewrites the roles of every docstring
the reference shows (the objects of ``phalanx.__all__`` and their public members) into
Markdown, resolving each target as Sphinx would: as written (a full path), then from the
object outwards (its class, its module), then as a name of the package itself, then as a
builtin or a module of the standard library.

* A target the reference shows becomes an autorefs link to its entry, by its public path
  (``[`GroupSlice`][phalanx.GroupSlice]``).
* A target that exists but is not public (an internal module, a private method) or is not
  phalanx's (``ValueError``) becomes plain code: there is no page to link to.
* A target that resolves to nothing is an error, logged where ``mkdocs build --strict``
  counts it, so a stale reference fails the build.

Sphinx's display rules hold: ``~`` shows the last part only, ``title <target>`` shows the
title, a leading ``!`` links nothing, and a function or method gets ``()``. A paragraph
ending in ``::`` (a literal block follows) ends in ``:``, as Sphinx shows it.
"""

from __future__ import annotations

import builtins
import importlib.util
import logging
import re
import sys
from typing import TYPE_CHECKING, Any

import griffe

if TYPE_CHECKING:
    from collections.abc import Iterator

# Under "mkdocs.", so that mkdocs --strict counts its warnings.
logger = logging.getLogger("mkdocs.plugins.phalanx.roles")

ROLE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|mod|attr|exc|data|obj|const):`(?P<body>[^`]+)`")
CALLABLE_ROLES = ("meth", "func")
LITERAL_MARK = re.compile(r"(?<=\S)(::)[ \t]*$|[ \t]*::[ \t]*$", re.MULTILINE)


class Roles(griffe.Extension):
    """Rewrite the roles of the docstrings of ``package``'s public API, once it is loaded."""

    def __init__(self, package: str = "phalanx") -> None:
        super().__init__()
        self.package = package
        self.errors: list[str] = []

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        if pkg.name != self.package:
            return
        shown = public_objects(pkg)
        for obj in _documented(pkg, shown):
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj.docstring.value, obj, pkg, shown)

    def rewrite(self, text: str, obj: griffe.Object, pkg: griffe.Module,
                shown: dict[str, str]) -> str:
        def replace(match: re.Match[str]) -> str:
            return self._role(match.group("role"), match.group("body"), obj, pkg, shown)

        text = ROLE.sub(replace, text)
        # "for example::" -> "for example:"; "text ::" and a lone "::" lose it (as in Sphinx)
        return LITERAL_MARK.sub(lambda m: ":" if m.group(1) else "", text)

    def _role(self, role: str, body: str, obj: griffe.Object, pkg: griffe.Module,
              shown: dict[str, str]) -> str:
        title_match = re.fullmatch(r"(?s)(.*?)\s*<([^<>]+)>", body)
        target = (title_match.group(2) if title_match else body).strip()
        no_link = target.startswith("!")
        target = target.lstrip("!")
        short = target.startswith("~")
        target = target.lstrip("~")
        if target.endswith("()"):
            target = target[:-2]
        if title_match:
            title = title_match.group(1)
        else:
            title = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
            if role in CALLABLE_ROLES:
                title += "()"
        found = resolve(target, obj, pkg)
        if found is None:
            where = obj.path
            message = (f"{where}: the docstring's :{role}:`{body}` names nothing: no "
                       f"{target!r} in {pkg.name} (from {where} outwards), its package, the "
                       "builtins or the standard library")
            self.errors.append(message)
            logger.warning(message)
            return f"`{title}`"
        public = next((shown[path] for path in found if path in shown), None)
        return f"[`{title}`][{public}]" if public and not no_link else f"`{title}`"


class PlainInstanceAttributes(griffe.Extension):
    """``self.rank = rank`` in ``__init__`` is an attribute whose "value" is a parameter's
    name: shown as ``rank = rank``, it says nothing. Such a value is left out."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if "instance-attribute" in attr.labels and isinstance(attr.value, griffe.ExprName):
            attr.value = None


def public_objects(pkg: griffe.Module) -> dict[str, str]:
    """Path of each object the reference shows -> the public path it is shown under
    (``phalanx.controller.slices.GroupSlice`` -> ``phalanx.GroupSlice``). A class's
    inherited members are shown too (``WorkerGroup.call`` is defined by an internal base),
    under both their paths: the one through the class and their own."""
    shown: dict[str, str] = {}

    def walk(obj: griffe.Object, public: str) -> None:
        shown.setdefault(obj.path, public)
        if not obj.is_class:
            return
        for name, member in obj.all_members.items():
            if name.startswith("_"):
                continue
            target = _target(member)
            if target is None:
                continue
            if isinstance(member, griffe.Alias):  # inherited: phalanx.x.Sub.method
                shown.setdefault(member.path, f"{public}.{name}")
            walk(target, f"{public}.{name}")

    for export in pkg.exports or ():
        name = str(export)
        target = _target(pkg.members.get(name))
        if target is not None:
            walk(target, f"{pkg.path}.{name}")
    return shown


def _documented(pkg: griffe.Module, shown: dict[str, str]) -> Iterator[griffe.Object]:
    """Each object whose docstring the reference shows, once: the public ones, and the
    constructors whose docstrings mkdocstrings merges into their classes'."""
    seen: set[str] = set()
    for path in shown:
        obj = _target(_lookup(pkg.modules_collection, path))
        if obj is None or obj.path in seen:
            continue
        seen.add(obj.path)
        yield obj
        init = obj.members.get("__init__") if obj.is_class else None
        if isinstance(init, griffe.Object):
            yield init


def _target(obj: Any) -> griffe.Object | None:
    if isinstance(obj, griffe.Alias):
        try:
            final = obj.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        return final if isinstance(final, griffe.Object) else None
    return obj if isinstance(obj, griffe.Object) else None


def resolve(target: str, obj: griffe.Object, pkg: griffe.Module) -> list[str] | None:
    """What ``target`` names, seen from ``obj``: the paths it has in the package (as found,
    then where it is defined; none for something outside the package: a builtin, the
    standard library, an import of another package), or None for nothing."""
    name = target.lstrip(".")
    if not name:
        return None
    scopes: list[griffe.Object] = []
    scope: griffe.Object | None = obj
    while scope is not None:
        if scope.is_class or scope.is_module:
            scopes.append(scope)
        scope = scope.parent
    for candidate in (_lookup(pkg.modules_collection, name),
                      *(_lookup(s, name) for s in scopes), _lookup(pkg, name)):
        if candidate is None:
            continue
        found = _target(candidate)
        if found is None:  # an import from elsewhere (threading.Event): not ours to link
            return []
        return [candidate.path, found.path]
    if target.startswith("."):  # Sphinx: the one object whose path ends so
        ends = [path for path in _all_paths(pkg) if path.endswith(target)]
        if len(ends) == 1:
            return ends
    return [] if _is_external(name, pkg.name) else None


def _lookup(scope: Any, name: str) -> Any:
    try:
        return scope.get_member(name) if hasattr(scope, "get_member") else scope[name]
    except (KeyError, ValueError, IndexError, griffe.AliasResolutionError,
            griffe.CyclicAliasError):
        pass
    if isinstance(scope, griffe.Object) and scope.is_class:
        try:  # an inherited member
            return scope[name]
        except (KeyError, ValueError, IndexError, griffe.AliasResolutionError,
                griffe.CyclicAliasError):
            return None
    return None


def _all_paths(pkg: griffe.Module) -> Iterator[str]:
    stack: list[griffe.Object] = [pkg]
    while stack:
        obj = stack.pop()
        yield obj.path
        stack.extend(m for m in obj.members.values() if isinstance(m, griffe.Object))


def _is_external(name: str, package: str) -> bool:
    first = name.split(".")[0]
    if first == package:
        return False
    if hasattr(builtins, first):
        return True
    if first in sys.stdlib_module_names:
        return True
    try:
        return importlib.util.find_spec(first) is not None
    except (ImportError, ValueError):
        return False
