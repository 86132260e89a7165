"""What a rank and a controller import before they do anything: every rank of every group
pays for its imports at start-up (on a small machine several ranks share each CPU), and
the controller pays for its own before its first group can start. These modules are left
for the code paths that need them (a mesh, an error, a socket, an await)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Loaded by the interpreter's own start (site, an editable install's finder) or not at all.
RANK_LEAVES_OUT = ["inspect", "dataclasses", "traceback", "socket", "phalanx.errors",
                   "numpy", "cloudpickle", "asyncio", "subprocess"]
CONTROLLER_LEAVES_OUT = ["numpy", "asyncio", "secrets", "phalanx.world.sharding"]


def _loaded_after(code: str, names: list[str]) -> list[str]:
    probe = (f"import sys; sys.path.insert(0, {ROOT!r}); {code}; import json; "
             f"print(json.dumps([n for n in {names!r} if n in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_ranks_runtime_imports_only_what_serving_calls_needs():
    assert _loaded_after("from phalanx.rank.runtime import main", RANK_LEAVES_OUT) == []


def test_a_controller_without_a_mesh_does_not_import_numpy_or_asyncio():
    loaded = _loaded_after("import phalanx as px; px.WorkerGroup; px.ResourcePool",
                           CONTROLLER_LEAVES_OUT)
    assert loaded == []


RANK_PARTS = textwrap.dedent("""\
    from phalanx.rank.runtime import _is_awaitable, public_methods

    class A:
        x = 1

        def f(self):
            pass

        @property
        def p(self):
            raise RuntimeError("a property ran")

        @staticmethod
        def s():
            pass

    a = A()
    a.g = print
    assert public_methods(a) == ["f", "g", "s"], public_methods(a)

    async def c():
        pass

    co = c()
    assert _is_awaitable(co)
    co.close()
    assert not _is_awaitable(x for x in ())
""")

CONTROLLER_PARTS = textwrap.dedent("""\
    from phalanx.controller.meshcalls import Mesh

    mesh = Mesh({"dp": 2, "tp": 2}, "dp", 4)
    assert mesh.dp_size == 2 and mesh.dp_leader(1) == 2, mesh.dp_leader(1)
""")


@pytest.mark.parametrize("code", [RANK_PARTS, CONTROLLER_PARTS], ids=["rank", "controller"])
def test_what_is_left_out_still_loads_where_it_is_needed(code):
    """The lazily imported parts work when used: a rank's view of its object's methods
    and of what a method returned, a mesh's sharding."""
    probe = f"import sys; sys.path.insert(0, {ROOT!r})\n{code}"
    subprocess.run([sys.executable, "-c", probe], timeout=60, check=True, cwd=ROOT)
