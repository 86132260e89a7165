"""The compiled parts, optional: phalanx.wire._speedups and phalanx.controller._hotpath (see
their sources). Where one does not build, the install goes on without it, and phalanx runs its
pure-Python twin."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("phalanx.wire._speedups", ["phalanx/wire/_speedups.c"], optional=True),
    Extension("phalanx.controller._hotpath", ["phalanx/controller/_hotpath.c"], optional=True),
])
