"""The HTML run report: one self-contained file (no request leaves it) of a merged run or of one trace.

Example:
    >>> tl.merge_ranks("runs/job42").report("job42.html")
    >>> tl.trace(model, x).report("model.html")
    $ tl-dist report runs/job42 -o job42.html

Sections: a headline (the slowest step: which rank, phase, module, how long), overview (ranks, steps, hosts,
step time per rank), a timeline per rank of each step (compute,
communication, waiting), time per module and per op func with FLOP/s and the slowest ops, collectives (table,
bus bandwidth, wait heatmap, stragglers), findings, and statistics (norms per module over steps, the first
non-finite value). Every time is a step fact (:mod:`tl_dist.step_facts`, docs/telemetry.md). Needs the ``tl_dist[report]`` extra (plotly, whose plotly.js is inlined: ~4.8 MB).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .._files import replacing
from .data import Run
from .page import Page

if TYPE_CHECKING:
    from ..merge.graph import MergedTrace
    from ..trace import Trace

__all__ = ["write_report"]


def write_report(source: MergedTrace | Trace, path: str | os.PathLike, *, title: str | None = None) -> str:
    """Write the HTML report of ``source`` (a :func:`tl_dist.merge_ranks` result or a trace) to ``path``.

    Args:
        source: what to report on.
        path: the ``.html`` file to write (its folder must exist); written whole or not at all.
        title: the page's title; default names the run's ranks and steps.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: ``source``, ``path`` or ``title`` is of the wrong type, or ``path``'s folder is missing.
        MissingToolError: plotly (the ``tl_dist[report]`` extra) is not installed.

    Example:
        >>> write_report(tl.merge_ranks("runs/job42"), "job42.html")
        'job42.html'
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if title is not None and not isinstance(title, str):
        raise ValueError(f"title must be a str or None, got {title!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"path: folder {folder} does not exist (writing report {os.path.basename(path)})")
    run = Run.of(source)
    if title is None:
        ranks, steps = run.ranks, run.steps
        title = (
            f"tl_dist report: {len(ranks)}/{run.world_size} rank(s), "
            f"{len(steps)} step(s) ({steps[0]}..{steps[-1]})"
            if steps
            else "tl_dist report: empty run"
        )
    text = Page(run, title).render()
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path
