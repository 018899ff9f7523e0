"""The optional C extension tl_dist._fastop, built from tl_dist/_csrc/ (the compiled per-op path,
tl_dist/_fastpath.py); everything else about the package is in pyproject.toml. ``optional=True``: without a
C compiler the install still succeeds and every op is recorded in Python."""

from setuptools import Extension, setup

SOURCES = [
    "tl_dist/_csrc/fastop.c",
    "tl_dist/_csrc/record.c",
    "tl_dist/_csrc/columns.c",
    "tl_dist/_csrc/writes.c",
    "tl_dist/_csrc/saved.c",
    "tl_dist/_csrc/modules.c",
    "tl_dist/_csrc/source.c",
]

setup(
    ext_modules=[
        Extension("tl_dist._fastop", sources=SOURCES, depends=["tl_dist/_csrc/fastop.h"], optional=True)
    ]
)
