"""Which compiled twins run in this process: ``speedups`` is :mod:`phalanx.wire._speedups`
(built by ``setup.py`` where a C compiler is), or None where it did not build, or where
``PHALANX_PURE_PYTHON=1`` (:data:`phalanx.config.ENV_PURE_PYTHON`) asks for the pure-Python
steps (``wanted`` is False then: :mod:`phalanx.controller.compiled` reads it for the
controller's own). Each compiled step does what its Python twin does, and hands it everything
but the usual case. Read from the environment here, not through :mod:`phalanx.config`: the
warden starts lean."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing's, without importing typing (the warden starts lean)
if TYPE_CHECKING:
    from types import ModuleType

wanted = os.environ.get("PHALANX_PURE_PYTHON", "") in ("", "0")
speedups: ModuleType | None = None
if wanted:
    try:
        from phalanx.wire import _speedups as speedups  # noqa: F401 - what others read
    except ImportError:  # not built here (no compiler at install, another interpreter)
        pass
