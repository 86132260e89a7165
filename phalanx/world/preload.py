"""Which modules a node imports once and forks a group's ranks from (``preload=``): pure.

Every rank imports what its target needs; with a framework that is ``import torch``, a
second or more of CPU per rank, paid again at each ``recreate``, ``restart`` and elastic
start. A node's supervisor can import those modules once and fork each rank from itself
(:class:`phalanx.node.keeper._Preload`), so that a node pays the import once.

``WorkerGroup(preload=...)``:

- ``None`` or ``True`` (the default): phalanx's rank runtime, the framework's modules
  (:attr:`phalanx.world.frameworks.Framework.preload`: ``torch`` for ``framework="torch"``)
  and the target's own module where that is safe: not ``__main__`` (that is the user's
  script, which would run again), and only where the node runs the code from the same
  files as the controller (no code shipped by ``sync``: a reload must not find the old
  module loaded). A preloaded module whose file changes later stops the forking: ranks
  start fresh from then on, and say why;
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


def preload_modules(preload: bool | Sequence[str] | None, framework: Sequence[str],
                    target_module: str | None, *, ships_code: bool,
                    forks: bool) -> tuple[str, ...]:
    """The modules to preload, in order, without repeats (empty: start fresh interpreters).

    ``framework``: the framework's own; ``target_module``: where the target was defined
    (None if unknown); ``ships_code``: the backend runs code it ships (``sync``); ``forks``:
    its nodes start ranks through a phalanx supervisor on the same interpreter."""
    check_preload(preload)
    if preload is False or not forks:
        return ()
    if preload is None or preload is True:
        modules = [RUNTIME, *framework]
        if (target_module and target_module != "__main__" and not ships_code
                and not target_module.startswith("phalanx.")):
            modules.append(target_module)
    else:
        modules = [RUNTIME, *preload]
    return tuple(dict.fromkeys(modules))
