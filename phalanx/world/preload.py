"""Which modules a node imports once and forks a group's ranks from (``preload=``): pure.

Every rank imports what its target needs; with a framework that is ``import torch``, a
second or more of CPU per rank, paid again at each ``recreate``, ``restart`` and elastic
start. A node's supervisor can import those modules once and fork each rank from itself
(:class:`phalanx.node.keeper._Preload`), so that a node pays the import once.

``WorkerGroup(preload=...)``:

- ``None`` or ``True`` (the default): phalanx's rank runtime, the framework's modules
  (:attr:`phalanx.world.frameworks.Framework.preload`: ``torch`` for ``framework="torch"``)
  and the installed packages the target's module imports at its top level
  (:func:`imported_packages`: ``import torch``, ``from transformers import ...``), read
  from its source -- never the module itself, nor any of the user's own: their code runs
  in the rank, after its environment (``RANK``, ...) is set, as without preloading. Left
  out: packages that read a rank's environment as they are imported (:data:`UNSAFE`:
  jax, tensorflow, ray). A preloaded module whose file changes later stops the forking:
  ranks start fresh from then on, and say why;
- ``False``: none; every rank is a fresh interpreter;
- a list of module names: those, with the rank runtime.

Where a fork cannot be had (another interpreter, ``python=``; a module that starts a
thread or initialises CUDA as it is imported; a backend whose ranks are not forked by a
supervisor of phalanx's, Ray's), ranks start as fresh interpreters, and the node side says
why once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

RUNTIME = "phalanx.rank.runtime"
# packages that read a rank's environment (its devices, its platform) as they are imported
UNSAFE = frozenset({"jax", "jaxlib", "tensorflow", "ray", "monarch", "phalanx"})
# a dotted module name: identifiers separated by dots
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_preload(preload: object) -> None:
    """``TypeError``/``ValueError`` naming what is wrong with a ``preload=`` value."""
    if preload is None or isinstance(preload, bool):
        return
    if isinstance(preload, str) or not isinstance(preload, Sequence):
        raise TypeError(f"preload must be True, False or a list of module names, got "
                        f"{preload!r}")
    for name in preload:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"preload: {name!r} is not a module name (dotted identifiers, "
                             "as in 'numpy' or 'torch.nn')")


def imported_packages(source: str) -> list[str]:
    """The top-level packages a module's source imports at its top level (``import a.b``,
    ``from a import b``: ``a``), in order; relative imports, and imports inside functions,
    classes or ``if``/``try`` blocks, are not counted. ``[]`` for source that does not
    parse."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def preload_modules(preload: bool | Sequence[str] | None, framework: Sequence[str],
                    packages: Sequence[str], *, forks: bool) -> tuple[str, ...]:
    """The modules to preload, in order, without repeats (empty: start fresh interpreters).

    ``framework``: the framework's own; ``packages``: the installed third-party packages
    the target's module imports (the caller's to find, :func:`imported_packages`);
    ``forks``: the backend's nodes start ranks through a phalanx supervisor on the same
    interpreter."""
    check_preload(preload)
    if preload is False or not forks:
        return ()
    if preload is None or preload is True:
        modules = [RUNTIME, *framework, *(p for p in packages if p not in UNSAFE)]
    else:
        modules = [RUNTIME, *preload]
    return tuple(dict.fromkeys(modules))
