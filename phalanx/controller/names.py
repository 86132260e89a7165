"""Group names: what errors, logs and reprs call a group (``WorkerGroup(..., name=)``).

A group's name is unique among the open groups of this process, so that a message naming
it names one group:

- **By default** it is the target's name (a class's or function's ``__name__``; the wrapped
  function's for :func:`~phalanx.controller.spmd.spmd`), numbered when repeated: ``Policy``,
  ``Policy-2``, ``Policy-3``, ... One count per base name for the whole process: a default
  name is never given twice, even once its group is closed (a log line names one group).
- **A given name** (``name="policy"``) is letters, digits and ``-_.`` only, at most
  :data:`~phalanx.config.MAX_GROUP_NAME` characters: it goes into log lines, thread names
  and the holders of devices and slots unquoted. One already held by an open group of this
  process is refused (ValueError); once that group is shut down the name is free again.

Both are checked and taken before anything starts; the group gives its name back when it
shuts down (or when its start fails). :data:`GROUP_NAMES` is the process's one book.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from phalanx import config
from phalanx.backends.base import plain_target

_ALLOWED = re.compile(r"[A-Za-z0-9_.\-]+")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_.\-]+")
_FALLBACK = "group"  # the base of a target whose name has no character a name may hold


def check_name(name: Any, argument: str = "name") -> None:
    """TypeError unless ``name`` is a str; ValueError naming ``argument`` and the value
    unless it is a name a group may have (see the module docstring)."""
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str (the group's name), got "
                        f"{type(name).__name__} {name!r}")
    if not name:
        raise ValueError(f"{argument}='' is empty: give the group a name, or leave "
                         f"{argument}= out for the target's name")
    if len(name) > config.MAX_GROUP_NAME:
        raise ValueError(f"{argument}={name!r} is {len(name)} characters long; a group's name "
                         f"has at most {config.MAX_GROUP_NAME}")
    if _ALLOWED.fullmatch(name) is None:
        bad = ", ".join(repr(c) for c in sorted(set("".join(_NOT_ALLOWED.findall(name)))))
        raise ValueError(f"{argument}={name!r} holds {bad}: a group's name is made of "
                         "letters, digits and '-', '_', '.' only (no spaces)")


def base_of(target: Any) -> str:
    """The base of a default name for a group of ``target``: its ``__name__`` (a
    ``@ray.remote`` class's: the class it wraps; an object without one: its type's), with
    what a name may not hold replaced by ``_`` (``<lambda>`` -> ``lambda``)."""
    target, _, wrapped = plain_target(target)
    name = wrapped or getattr(target, "__name__", None)
    if not isinstance(name, str):
        name = type(target).__name__
    return name_from(name)


def name_from(text: str) -> str:
    """``text`` (a target's or a program's name) as a group's name may hold it: what it may
    not hold replaced by ``_``, with room for the number of a repeated name ("-12345")."""
    base = _NOT_ALLOWED.sub("_", text).strip("_")
    return base[:config.MAX_GROUP_NAME - 6] or _FALLBACK


class GroupNames:
    """The names held by this process's open groups, and the count of each default base.

    Interface: :meth:`check_free` (before a request's other checks), :meth:`claim` (a
    group's name, taken), :meth:`unused` (a default name, not taken), :meth:`release`,
    ``name in names``. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._counts: dict[str, int] = {}  # base -> how many default names it gave

    def claim(self, name: str | None, base: str) -> str:
        """Take ``name`` (checked already) for a group, ValueError if an open group holds
        it; None: the next default name of ``base``. Returns the name taken."""
        with self._lock:
            if name is None:
                name = self._next(base)
            else:
                self._refuse_held(name)
            self._held.add(name)
            return name

    def check_free(self, name: str) -> None:
        """ValueError if an open group holds ``name`` now (:meth:`claim` checks again)."""
        with self._lock:
            self._refuse_held(name)

    def _refuse_held(self, name: str) -> None:
        if name in self._held:
            raise ValueError(
                f"name={name!r} is the name of a group of this process that is still open; "
                "shut that group down first, choose another name, or leave name= out for a "
                "unique one")

    def unused(self, base: str) -> str:
        """The next default name of ``base``, not taken (for a caller that passes it on as
        ``name=``: :func:`~phalanx.controller.spmd.spmd`)."""
        with self._lock:
            return self._next(base)

    def _next(self, base: str) -> str:
        while True:  # past names that groups were given explicitly
            count = self._counts[base] = self._counts.get(base, 0) + 1
            name = base if count == 1 else f"{base}-{count}"
            if name not in self._held:
                return name

    def release(self, name: str) -> None:
        """The group named ``name`` is shut down (or never started): the name is free."""
        with self._lock:
            self._held.discard(name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._held


GROUP_NAMES = GroupNames()  # the book of this process's group names


def holder(name: str, world_size: int) -> str:
    """A group as the books of devices and pool slots name what it holds:
    ``group Policy-2 (4 ranks)``."""
    return f"group {name} ({world_size} rank{'s' if world_size != 1 else ''})"
