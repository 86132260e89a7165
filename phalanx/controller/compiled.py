"""Whether the controller's compiled twins run in this process: ``hotpath`` is
:mod:`phalanx.controller._hotpath` (built by ``setup.py`` where a C compiler is, as
:mod:`phalanx.wire.compiled`'s module is), or None where it did not build, or where
``PHALANX_PURE_PYTHON=1`` asks for the pure-Python steps (:data:`phalanx.wire.compiled.wanted`
decides for both). Its steps do what the Python they stand for does (see its source)."""

from __future__ import annotations

from types import ModuleType

from phalanx.wire import compiled

hotpath: ModuleType | None = None
if compiled.wanted:
    try:
        from phalanx.controller import _hotpath as hotpath  # noqa: F401 - what others read
    except ImportError:  # not built here (no compiler at install, another interpreter)
        pass
