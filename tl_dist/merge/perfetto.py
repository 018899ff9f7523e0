"""Chrome / Perfetto trace JSON of a merged trace (the "JSON Array/Object format" both UIs load).

One process per rank (``pid`` = rank) with the tracks of a one-trace export (``tl_dist.views.perfetto``: a
track per phase with module slices around the ops, collectives in flight with the time this rank waited for
the last member as a ``wait`` slice inside, a live activation bytes counter), every step on aligned time in
microseconds. Each joined collective is a flow: a start event on the first member to arrive, steps on the
others, bound to the collective's slice on each rank so the UI draws arrows between the ranks.

Written as a stream: one step's shards are read at a time (for the columns the tracks need), and each shard's
events are written before the next is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..views.perfetto import OTHER_TID, PHASE_TID, process_events, thread_names, write_events
from .timing import member_waits, step_timing

if TYPE_CHECKING:
    import os

    from .graph import MergedTrace
    from .match import Joined

# The op columns the tracks read (module slices need the backward/optimizer links, the counter the parents).
FIELDS = ("label", "func", "kind", "phase", "fwd_op", "module", "module_call", "parents", "params", "inplace")
FIELDS += ("start_ns", "duration_ns", "flops", "out_bytes", "source")

Anchors = dict[int, dict[int, tuple[float, int]]]  # rank -> collective op -> (ts of its slice, tid)


def perfetto_events(g: MergedTrace) -> Iterator[dict[str, Any]]:
    """The trace events (metadata, slices, counters, flows) as dicts, one shard read at a time."""
    if not g.keys():
        return
    base = g.aligned_origin_ns()
    ids = itertools.count()
    lanes: dict[int, int] = {}
    for rank in g.ranks:
        yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
    for step in g.steps:
        joined = g.joined_step(step)
        clocks = g.clock_solutions[step]
        timing = step_timing(joined, clocks)
        waits = _waits(joined, timing)
        anchors: Anchors = {}
        for (_, rank), trace in g.iter_traces(step=step, fields=FIELDS):
            shift = base + clocks.offsets.get(rank, 0)
            events, n_lanes = process_events(
                trace, pid=rank, base_ns=shift, waits=waits.get(rank), args={"step": step}
            )
            yield from events
            lanes[rank] = max(lanes.get(rank, 0), n_lanes)
            cols = trace.columns
            anchors[rank] = {
                i: ((cols["start_ns"][i] - shift) / 1e3, PHASE_TID.get(cols["phase"][i], OTHER_TID))
                for i, kind in enumerate(cols["kind"])
                if kind == "collective"
            }
        yield from _flows(joined, timing, clocks.offsets, base, anchors, ids)
    # Track names last: how many collective lanes a rank needs is known once all its steps are written.
    for rank in g.ranks:
        yield from thread_names(rank, lanes.get(rank, 0))


def _waits(joined: list[Joined], timing: Any) -> dict[int, dict[int, tuple[int, int]]]:
    """Per rank, collective op -> (its wait for the last member, ns; that member), for the wait slices."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    last = timing.last_rank.tolist()
    for k, rank, e, wait in member_waits(joined, timing):
        if wait > 0:
            out.setdefault(rank, {})[e.op] = (wait, last[k])
    return out


def _flows(
    joined: list[Joined],
    timing: Any,
    offset: dict[int, int],
    base: int,
    anchors: Anchors,
    ids: Iterator[int],
) -> Iterator[dict[str, Any]]:
    """One flow per joined collective of a step: ``s`` on the first member to arrive, ``t``/``f`` on the others,
    each just inside that member's slice of the collective op so the UI binds it."""
    skews = timing.skew.tolist()
    for k, j in enumerate(joined):
        if len(j.entries) < 2:
            continue
        members = sorted(j.entries.items(), key=lambda kv: (kv[1].issue_ns - offset.get(kv[0], 0), kv[0]))
        flow_id = next(ids)
        for n, (rank, e) in enumerate(members):
            fallback = ((e.issue_ns - offset.get(rank, 0) - base) / 1e3, OTHER_TID)
            ts, tid = anchors.get(rank, {}).get(e.op, fallback)
            ph = "s" if n == 0 else ("f" if n == len(members) - 1 else "t")
            ev = {
                "ph": ph,
                "id": flow_id,
                "name": f"{j.func} seq {j.seq}",
                "cat": "collective",
                "pid": rank,
                "tid": tid,
                "ts": ts + 0.0005,
                "args": {"verdict": j.verdict, "skew_us": skews[k] / 1e3},
            }
            if ph == "f":
                ev["bp"] = "e"
            yield ev


def write_perfetto(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write :func:`perfetto_events` as ``{"traceEvents": [...]}`` to ``path``, event by event; returns the
    path."""
    return write_events(perfetto_events(g), path)
