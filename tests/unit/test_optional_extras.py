"""The suite without the optional extras: ``pip install phalanx[test]`` alone must pass it,
every test that needs torch, ray, jax, tensorflow or monarch skipping with the reason.

The packages are hidden, not uninstalled: a ``sitecustomize`` on ``PYTHONPATH`` makes them
look absent to this interpreter and to every process it starts (the workers inherit
``PYTHONPATH``). To run the whole suite that way::

    python tests/unit/test_optional_extras.py /tmp/noextras
    PYTHONPATH=/tmp/noextras python -m pytest tests
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What a real absence looks like, and what phalanx and the tests check: ``import torch``
# raises ModuleNotFoundError, ``importlib.util.find_spec("torch")`` returns None and
# ``importlib.metadata`` knows no such distribution.
SITECUSTOMIZE = textwrap.dedent('''\
    """Make phalanx's optional extras look uninstalled (see tests/unit/test_optional_extras.py)."""
    import sys

    HIDDEN = {"torch", "ray", "jax", "jaxlib", "tensorflow", "monarch", "torchmonarch"}
    HIDDEN_DISTS = {"torch", "ray", "jax", "jaxlib", "tensorflow", "tensorflow_cpu",
                    "torchmonarch"}


    def _hidden(name):
        return name.partition(".")[0] in HIDDEN


    class _Hiding:
        """Wraps a meta-path finder so that it finds none of the hidden packages."""

        def __init__(self, finder):
            self._finder = finder

        def __getattr__(self, attr):
            return getattr(self._finder, attr)

        def find_spec(self, name, path=None, target=None):
            find = getattr(self._finder, "find_spec", None)
            if _hidden(name) or find is None:
                return None
            return find(name, path, target)

        def find_distributions(self, *args, **kwargs):
            find = getattr(self._finder, "find_distributions", None)
            for dist in find(*args, **kwargs) if find is not None else ():
                name = (dist.metadata["Name"] or "").lower().replace("-", "_")
                if name not in HIDDEN_DISTS:
                    yield dist


    class _Guard:
        """First on sys.meta_path: wraps any finder added later before it is asked."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            _hide_all()
            return None


    def _hide_all():
        for i, finder in enumerate(sys.meta_path):
            if finder is not _Guard and not isinstance(finder, _Hiding):
                sys.meta_path[i] = _Hiding(finder)


    for _name in list(sys.modules):
        if _hidden(_name):
            del sys.modules[_name]
    _hide_all()
    sys.meta_path.insert(0, _Guard)
''')

# A representative part of the suite: contract tests run on both backends and on
# framework="torch"/"jax", and the framework unit tests.
# tests/security/test_ray_listener.py: tests of no backend that use the shared Ray cluster.
SUBSET = ["tests/contract/test_placement.py", "tests/unit/test_frameworks.py",
          "tests/security/test_ray_listener.py"]

CHECK_HIDDEN = textwrap.dedent("""\
    import importlib.metadata, importlib.util
    for name in ("torch", "ray", "jax", "tensorflow", "monarch"):
        assert importlib.util.find_spec(name) is None, name
        try:
            __import__(name)
        except ModuleNotFoundError as e:
            assert e.name == name, e
        else:
            raise AssertionError(f"{name} imported")
    for dist in ("torch", "ray"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            raise AssertionError(f"{dist} distribution found")
    assert importlib.util.find_spec("numpy") is not None
    import phalanx
    print("hidden")
""")


def write_sitecustomize(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE)
    return path


def without_extras_env(directory: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a test cluster of the outer run, if any
    env.pop("PYTEST_ADDOPTS", None)
    paths = [str(directory), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PHALANX_PROGRESS"] = "0"
    return env


@pytest.mark.slow
def test_the_suite_skips_what_needs_a_missing_extra(tmp_path):
    hide = tmp_path / "noextras"
    write_sitecustomize(hide)
    env = without_extras_env(hide)

    check = subprocess.run([sys.executable, "-c", CHECK_HIDDEN], cwd=str(REPO), env=env,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and "hidden" in check.stdout, check.stdout + check.stderr

    result = subprocess.run(
        [sys.executable, "-m", "pytest", *SUBSET, "-q", "-rs", "-p", "no:cacheprovider",
         "-o", "addopts="],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and re.search(r"\d+ skipped", summary), output
    assert "failed" not in summary and "error" not in summary, output
    # skipped for the reason, not for anything else
    assert "torch is not installed" in output, output
    assert "the ray backend needs ray" in output, output
    assert "this test needs a Ray cluster" in output, output


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/noextras")
    print(f"wrote {write_sitecustomize(target)}; run: PYTHONPATH={target} python -m pytest tests")
