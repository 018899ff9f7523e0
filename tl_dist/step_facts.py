"""Step facts: what one (step, rank) window did, computed here once and read by every view.

The report, ``tl-dist summary``, ``MergedTrace.time_breakdown()``, :class:`~tl_dist.telemetry.StepTelemetry`,
the OpenTelemetry/Prometheus exporters and the Lightning ``tl/*`` metrics all take these numbers from this
module, so they say the same thing about the same step. The names and their definitions are in one table,
``docs/telemetry.md`` ("Step facts"):

- ``window_ns``: the capture window, enter -> leave (``window_start_ns`` / ``window_end_ns`` of the shard);
  a shard from before windows recorded their span: first op start -> last op end.
- ``idle_before_ns`` / ``idle_after_ns``: window start -> first op start, last op end -> window end (a rank
  sleeping in its data loader before the forward shows here, not in its ops).
- ``compute_ns``: the summed duration of every op that is not a collective.
- ``comm_ns``: the time covered by at least one collective: a blocking one's op interval (its wait included),
  an async one's issue -> observed completion, overlapping ones once; in an incomplete shard (hang, crash) a
  collective that never completed counts until the window's end.
- the straggler of a step (:func:`straggler`): the rank the others waited for longest on the aligned clock
  (``caused_wait_ns`` of ``MergedTrace.stragglers()``), and that wait.
- the owner module of an op or collective: :func:`tl_dist.schema.module_name` of its row.
- busbw: :func:`bus_bandwidth` (nccl-tests: size / time x :func:`tl_dist.schema.bus_factor`).

Example:
    >>> f = window_facts(trace)
    >>> f["window_ns"], f["idle_before_ns"], f["compute_ns"], f["comm_ns"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .schema import bus_factor

FACTS = ("window_ns", "idle_before_ns", "idle_after_ns", "compute_ns", "comm_ns")
"""The per-window time facts, in the order ``time_breakdown()`` and the docs list them."""


def _union(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length of the union of [start, end) intervals."""
    if not len(starts):
        return 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    # Sorted by start, an interval adds what it reaches past every earlier one's end.
    before = np.concatenate([[s[0]], np.maximum.accumulate(e)[:-1]])
    return int(np.maximum(e - np.maximum(s, before), 0).sum())


def local_facts(
    kind_is_collective: np.ndarray,
    starts: np.ndarray,
    durations: np.ndarray,
    spans: tuple[np.ndarray, np.ndarray, np.ndarray],
    window: tuple[int | None, int | None] = (None, None),
    hung: np.ndarray | None = None,
) -> dict[str, int]:
    """The time facts (:data:`FACTS`) of one rank's window from its op columns (no clocks needed).

    Args:
        kind_is_collective: per op, whether it is a collective.
        starts, durations: per op, start (ns, the rank's clock) and duration.
        spans: (op index, issue, completion) of the collectives that completed. The op itself only enqueues
            the work, async or not: a blocking ``dist.all_reduce`` waits in Python after the op returned, so a
            collective is in flight from its issue to its observed completion.
        window: (window_start_ns, window_end_ns) of the shard; None where not recorded.
        hung: an incomplete shard's (hang, crash, signal) issue times of the collectives that never completed:
            the rank was blocked in them until the window's end.

    Example:
        >>> local_facts(np.array([False, True]), np.array([10, 20]), np.array([10, 5]),
        ...             (np.zeros(0, int), np.zeros(0, int), np.zeros(0, int)), (0, 40))
        {'window_ns': 40, 'idle_before_ns': 10, 'idle_after_ns': 15, 'compute_ns': 10, 'comm_ns': 5}
    """
    n = len(starts)
    lo, hi = window
    if not n:
        w = int(hi - lo) if lo is not None and hi is not None else 0
        return {"window_ns": w, "idle_before_ns": w, "idle_after_ns": 0, "compute_ns": 0, "comm_ns": 0}
    compute = int(durations[~kind_is_collective].sum())
    ops = np.flatnonzero(kind_is_collective)
    s = starts[ops].astype(np.int64)
    e = s + durations[ops]
    position = np.full(n, -1, dtype=np.int64)
    position[ops] = np.arange(len(ops))
    op, issue, complete = spans
    keep = (op >= 0) & (op < n)
    p = position[op[keep]]
    ok = p >= 0
    s[p[ok]] = issue[keep][ok]
    e[p[ok]] = complete[keep][ok]
    first = int(starts.min())
    last = int((starts + durations).max())
    # What the shard did not record: the first op's start, the last op's end.
    lo = first if lo is None else int(lo)
    hi = last if hi is None else int(hi)
    if hung is not None and len(hung):
        s = np.concatenate([s, hung.astype(np.int64)])
        e = np.concatenate([e, np.full(len(hung), hi, dtype=np.int64)])
    return {
        "window_ns": hi - lo,
        "idle_before_ns": max(first - lo, 0),
        "idle_after_ns": max(hi - last, 0),
        "compute_ns": compute,
        "comm_ns": _union(s, np.maximum(e, s)),
    }


def window_span(metadata: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(window_start_ns, window_end_ns) of a shard's metadata; None where not recorded."""
    return metadata.get("window_start_ns"), metadata.get("window_end_ns")


def window_facts(trace: Any) -> dict[str, int]:
    """:func:`local_facts` of a trace in memory (``tl.capture`` / ``tl.load``)."""
    cols = trace.columns
    ct = trace.collective_table
    meta = trace.metadata
    complete = np.asarray(ct["complete_ns"], dtype=np.int64)
    issue = np.asarray(ct["issue_ns"], dtype=np.int64)
    spans = complete >= 0
    hung = None if meta.get("complete", True) else issue[complete < 0]
    return local_facts(
        np.fromiter((k == "collective" for k in cols["kind"]), dtype=bool, count=len(cols["kind"])),
        np.asarray(cols["start_ns"], dtype=np.int64),
        np.asarray(cols["duration_ns"], dtype=np.int64),
        (np.asarray(ct["op"], dtype=np.int64)[spans], issue[spans], complete[spans]),
        window_span(meta),
        hung,
    )


def nonfinite_origin(first_kinds: Mapping[int, str]) -> int | None:
    """The rank a step's first non-finite value is reported on, from each rank's first non-finite op kind
    (ranks without one left out): the lowest rank where it arose in an op of its own, not in a collective (which
    brings another rank's values: DDP's all-reduce spreads one rank's NaN to every rank's gradients); else the
    lowest rank. None when no rank has one.

    Example:
        >>> nonfinite_origin({0: "collective", 1: "compute"})
        1
    """
    ranks = sorted(first_kinds)
    own = [r for r in ranks if first_kinds[r] != "collective"]
    return (own or ranks or [None])[0]


def straggler(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
    """The straggler of one step: ``(rank, caused_wait_ns)`` of the rank the others waited for longest (ties:
    the lowest rank), from that step's ``MergedTrace.stragglers()`` rows; None when nobody waited beyond the
    clock uncertainty.

    Example:
        >>> straggler([{"rank": 0, "caused_wait_ns": 0}, {"rank": 1, "caused_wait_ns": 30_000_000}])
        (1, 30000000)
    """
    best = None
    for r in rows:
        caused = int(r["caused_wait_ns"])
        if caused > 0 and (best is None or (-caused, int(r["rank"])) < (-best[1], best[0])):
            best = (int(r["rank"]), caused)
    return best


def bus_bandwidth(func: str, group_size: int, size: int, duration_ns: int) -> float:
    """nccl-tests' busbw in bytes/s: ``size`` (the larger buffer, :func:`~tl_dist.telemetry.collective_bytes`)
    / time x :func:`tl_dist.schema.bus_factor`; 0 when the time is unknown.

    Example:
        >>> bus_bandwidth("all_reduce", 2, 1000, 1000)  # 1000 B in 1 us on 2 ranks: 1 GB/s x 2(2-1)/2
        1000000000.0
    """
    if duration_ns <= 0 or size <= 0:
        return 0.0
    return size / (duration_ns / 1e9) * bus_factor(func, group_size)
