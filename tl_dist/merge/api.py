"""The facade of :class:`~tl_dist.merge.graph.MergedTrace`: its methods that reach the views, the drawing, Perfetto,
the report and the merged file, defined here and attached to the class when ``tl_dist`` is imported (the same
pattern as :mod:`tl_dist.api` for ``Trace``: ``graph.py`` keeps the data and its queries and imports none of
its consumers).

Example:
    >>> g = tl.merge_ranks("runs/job42")
    >>> g.collectives, g.clocks, g.to_pandas(), g.report("job42.html"), g.save("job42-merged.h5")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .._common import attach
from ..report import write_report
from .draw import draw
from .graph import MergedTrace
from .perfetto import write_perfetto
from .persist import save_merged
from .split import SPLITS, save_steps
from .views import clocks_frame, collectives_frame, ops_frame, summary


class _MergedTraceMethods:
    """The ``MergedTrace`` methods of this layer (attached below; ``self`` is a ``MergedTrace``)."""

    @property
    def clocks(self) -> Any:
        """Per (step, rank): host, offset_ns (its clock minus its reference rank's), uncertainty_ns (the true
        offset lies within offset_ns +- uncertainty_ns; NA when not estimated), method (``same-host``: one clock,
        offset 0 by construction; ``estimated``: from the causality bounds of matched collectives; ``none``:
        not bounded both ways), collectives (used as evidence), reference.

        Example:
            >>> g.clocks.query("method == 'estimated'").uncertainty_ns.max()
        """
        return clocks_frame(self)

    @property
    def collectives(self) -> Any:
        """One row per joined collective: step, group, seq, func, verdict, ranks, bytes, skew, duration, ...

        Example:
            >>> g.collectives.query("verdict != 'matched'")
        """
        return collectives_frame(self._collective_rows)

    def to_pandas(self, *, step: int | None = None) -> Any:
        """All ops of all ranks (of ``step`` only, when given): the schema's columns plus ``step``, ``rank`` and
        ``aligned_start_ns``. Shards (or a per-step folder's step files) are read one at a time; the frame of
        the whole run holds every op, so on a big run ask for one step.

        Example:
            >>> g.to_pandas(step=100).groupby(["rank", "func"]).duration_ns.sum()
        """
        return ops_frame(self, step)

    def summary(self) -> str:
        """A readable report: ranks, collectives by verdict, clocks, findings, stragglers, time per rank."""
        return summary(self)

    def draw(
        self,
        path: str,
        *,
        format: str = "svg",
        depth: int | str | None = "auto",
        rank: int | Sequence[int] | None = None,
        step: int | Sequence[int] | None = None,
        phase: str | Sequence[str] | None = None,
        show_all: bool = False,
    ) -> str:
        """Render one cluster per (step, rank), each drawn as ``trace.draw`` draws one trace, with collectives
        joined across clusters. ``rank`` and ``step`` pick the shards drawn (an int or a list; one the run has
        no shard for raises :class:`~tl_dist.errors.SelectionError`); ``depth``,
        ``phase`` and ``show_all`` as in :func:`tl_dist.views.draw.draw` (``"auto"`` counts the nodes of all
        drawn shards together). Returns the written file's path.

        Example:
            >>> g.draw("job42.svg", step=100, phase="backward")
        """
        return draw(
            self, path, format=format, depth=depth, rank=rank, step=step, phase=phase, show_all=show_all
        )

    def to_perfetto(self, path: str) -> str:
        """Write a Chrome/Perfetto trace JSON: one process per rank, ops as slices on aligned time, joined
        collectives linked by flow events. Returns ``path``.

        Example:
            >>> g.to_perfetto("job42.json")   # open in https://ui.perfetto.dev
        """
        return write_perfetto(self, path)

    def report(self, path: str | os.PathLike, *, title: str | None = None) -> str:
        """Write a self-contained HTML report of the run (overview, timeline per rank, time per module and op,
        collectives, findings, statistics; needs the ``tl_dist[report]`` extra). Returns ``path``.

        Example:
            >>> g.report("job42.html")   # opens offline in any browser
        """
        return write_report(self, path, title=title)

    def save(self, path: str | os.PathLike, *, split: str | None = None) -> str:
        """Write the merged trace: one HDF5 file (every rank's tables; the analysis is re-run on load), or with
        ``split="step"`` a folder (path or URL) of one HDF5 file per step plus an index of the merge's results,
        which :func:`load_merged` reads lazily (a step's file only when a view needs that step). Reopen either
        with :func:`load_merged`. Returns ``path``.

        Example:
            >>> g.save("job42-merged.h5"); tl.load_merged("job42-merged.h5").findings
            >>> g.save("s3://bucket/job42-merged", split="step")
        """
        if split is None:
            return save_merged(self, path)
        if split not in SPLITS:
            raise ValueError(f"split must be None (one file) or one of {list(SPLITS)}, got {split!r}")
        return save_steps(self, path)


attach(MergedTrace, _MergedTraceMethods)
