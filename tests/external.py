"""External programs some tests use, and the Debian package each comes from (the Makefile installs them).

Tests mark what they use with ``@pytest.mark.needs("dot")`` (see conftest.py): the test is skipped, with the
reason, when the program is missing. ``@pytest.mark.needs("dot", optional=True)`` marks a test that checks
what it can without the program (the DOT text) and uses it only when present (``have("dot")``).
"""

from __future__ import annotations

import shutil

PACKAGES = {"dot": "graphviz", "h5dump": "hdf5-tools", "chromium": "chromium", "prometheus": "prometheus"}


def have(tool: str) -> bool:
    """Whether ``tool`` is on PATH now (looked up each time: a test may change PATH)."""
    if tool not in PACKAGES:
        raise ValueError(f"unknown external tool {tool!r}; known: {', '.join(PACKAGES)}")
    return shutil.which(tool) is not None


def missing_reason(tool: str) -> str:
    return f"`{tool}` not on PATH (Debian package {PACKAGES[tool]}: make installs it when it can)"
