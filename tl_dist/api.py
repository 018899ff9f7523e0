"""The facade: the :class:`~tl_dist.trace.Trace` methods that reach the layers above the data -- views, store,
report, replay, validate -- defined here and attached to ``Trace`` when ``tl_dist`` is imported.

Why attach: ``trace.py`` holds the data and its queries at the bottom of the package and imports none of its
consumers, so the views and the store can import it without a cycle. The methods users call on a trace
(``to_pandas``, ``draw``, ``save``, ``report``, ``replay``, ``fork``, ``validate`` ...) stay methods of the
one ``Trace`` class -- same signatures, ``isinstance(t, tl.Trace)`` holds for captured, loaded and replayed
traces alike -- but their bodies live in this layer, which imports everything below at module top.
``tl_dist/__init__`` imports this module, and Python imports a package before any of its modules, so the
methods are present whichever ``tl_dist`` module a program imports first. :mod:`tl_dist.merge.api` (imported
here) does the same for :class:`~tl_dist.merge.MergedTrace`. Layering: ``docs/capture.md``.

Example:
    >>> trace = tl.trace(model, x)
    >>> trace.to_pandas(), trace.save("model.h5"), trace.replay()
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ._common import VALIDATE_ATOL, VALIDATE_RTOL, attach
from .merge import api as merge_api  # noqa: F401 (attaches MergedTrace's methods)
from .replay import Fork, replay
from .report import write_report
from .schema import COLLECTIVE_FIELDS
from .store import write_shard
from .trace import Trace
from .validate import validate
from .views.draw import draw
from .views.perfetto import to_perfetto
from .views.summary import summary
from .views.table import columns_frame, to_pandas


class _TraceMethods:
    """The ``Trace`` methods of this layer (attached below; ``self`` is a :class:`~tl_dist.trace.Trace`)."""

    def collectives_frame(self) -> Any:
        """One row per collective, one column per ``schema.COLLECTIVE_FIELDS`` field, plus the op's label.

        Example:
            >>> trace.collectives_frame().groupby("func").bytes.sum()
        """
        frame = columns_frame(self.collective_table, COLLECTIVE_FIELDS)
        frame.insert(1, "label", [self.columns["label"][i] for i in self.collective_table["op"]])
        return frame

    def to_pandas(self) -> Any:
        """One row per op, one column per schema field (``schema.OP_FIELDS``).

        Example:
            >>> trace.to_pandas().groupby("module").duration_ns.sum()
        """
        return to_pandas(self)

    def summary(self, top: int = 10) -> str:
        """A readable table: time and FLOPs per module, and the ``top`` most expensive ops."""
        return summary(self, top=top)

    def draw(
        self,
        path: str,
        *,
        format: str = "svg",
        depth: int | str | None = "auto",
        phase: str | Sequence[str] | None = None,
        show_all: bool = False,
        rolled: bool = False,
    ) -> str:
        """Render the op graph with Graphviz: ops in module clusters, input, parameter and output nodes;
        modules deeper than ``depth`` collapse into one node (``"auto"``: when over ~300 nodes); ``phase``
        keeps one phase's ops; bookkeeping ops (views, ``detach``, allocations) only with ``show_all``;
        ``rolled=True`` draws a loop repeating the same ops once, with iteration counts on its edges.
        Returns the written file's path (see :func:`tl_dist.views.draw.draw`).

        Example:
            >>> trace.draw("graph.svg", phase="forward")
            >>> tl.trace(rnn, x).draw("rnn.svg", rolled=True)
        """
        return draw(self, path, format=format, depth=depth, phase=phase, show_all=show_all, rolled=rolled)

    def to_perfetto(self, path: str | os.PathLike) -> str:
        """Write a Chrome/Perfetto trace JSON: ops as slices on one track per phase inside their module calls'
        slices, collectives in flight on their own track, and a counter of live activation bytes. Returns
        ``path`` (see :mod:`tl_dist.views.perfetto`).

        Example:
            >>> trace.to_perfetto("step.json")   # open in https://ui.perfetto.dev
        """
        return to_perfetto(self, path)

    def report(self, path: str | os.PathLike, *, title: str | None = None) -> str:
        """Write a self-contained HTML report of this trace (time per module and op, collectives, statistics;
        needs the ``tl_dist[report]`` extra). Returns ``path`` (see :func:`tl_dist.report.write_report`).

        Example:
            >>> tl.trace(model, x).report("model.html")
        """
        return write_report(self, path, title=title)

    def save(self, path: str | os.PathLike) -> str:
        """Write this trace as one HDF5 shard that ``tl.load`` and the ``tl-dist`` command read (no ``tl.arm``
        needed); the file is replaced atomically. Returns ``path`` as a string.

        Example:
            >>> tl.trace(model, x).save("model.h5"); tl.load("model.h5")["relu_1"].out
        """
        return os.fspath(write_shard(self, path, complete=bool(self.metadata.get("complete", True))))

    def fork(self) -> Any:
        """An editable copy of this trace's edits: ``.do(site, edit)`` adds one, ``.replay()`` re-executes the
        recorded graph with them, ``.rerun(model, x)`` runs the model again with them (see
        :class:`tl_dist.replay.Fork`).

        Example:
            >>> edited = trace.fork().do("relu_3", tl.zero_ablate()).replay()
            >>> tl.compare(trace, edited, first=True).label
            'relu_3'
        """
        return Fork(self)

    def replay(self) -> Trace:
        """Re-execute the recorded forward ops from the saved inputs and parameters, without the model's code,
        applying this trace's own edits: a new trace (``trace.fork().do(...).replay()`` adds edits first).
        Ops it cannot replay are listed in ``.metadata["not_replayed"]`` (see :func:`tl_dist.replay.replay`).

        Example:
            >>> assert torch.equal(trace.replay().output, trace.output)
        """
        return replay(self, self.interventions)

    def validate(
        self, *, raise_on_mismatch: bool = False, atol: float = VALIDATE_ATOL, rtol: float = VALIDATE_RTOL
    ) -> Any:
        """Re-execute every saved op from its parents' saved outputs and check it reproduces its saved output."""
        return validate(self, raise_on_mismatch=raise_on_mismatch, atol=atol, rtol=rtol)


attach(Trace, _TraceMethods)
