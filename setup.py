"""The one compiled part, optional: phalanx.wire._speedups (see its source). Where it does not
build, the install goes on without it, and phalanx runs its pure-Python twin."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("phalanx.wire._speedups", ["phalanx/wire/_speedups.c"],
                             optional=True)])
