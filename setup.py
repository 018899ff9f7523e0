"""The optional C extension, tl_dist/_fastop.c (the compiled per-op path, tl_dist/_fastpath.py); everything
else about the package is in pyproject.toml. ``optional=True``: without a C compiler the install still
succeeds and every op is recorded in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tl_dist._fastop", sources=["tl_dist/_fastop.c"], optional=True)])
