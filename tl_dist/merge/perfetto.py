"""Chrome / Perfetto trace JSON of a merged trace (the "JSON Array/Object format" both UIs load).

One process per rank (``pid`` = rank) with the tracks of a one-trace export (``tl_dist.views.perfetto``: a
track per phase with module slices around the ops, collectives in flight with the time this rank waited for
the last member as a ``wait`` slice inside, a live activation bytes counter), every step on aligned time in
microseconds. Each joined collective is a flow: a start event on the first member to arrive, steps on the
others, bound to the collective's slice on each rank so the UI draws arrows between the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..views.perfetto import OTHER_TID, PHASE_TID, process_events, thread_names, write_events

if TYPE_CHECKING:
    import os

    from .graph import MergedTrace


def _traces(g: MergedTrace) -> dict[tuple[int, int], Any]:
    # The module slices need the module table and the backward/optimizer links; shards on disk are read for
    # just those columns.
    from ..store.hdf5 import load_columns
    from ..trace import Trace

    fields = ("label", "func", "kind", "phase", "fwd_op", "module", "module_call", "parents", "params")
    fields += ("inplace", "start_ns", "duration_ns", "flops", "out_bytes", "source")
    return {
        key: t if isinstance(t, Trace) else load_columns(t.path, fields)
        for key, t in sorted(g.tables().items())
    }


def perfetto_events(g: MergedTrace) -> list[dict[str, Any]]:
    """The trace events (metadata, slices, counters, flows) as dicts."""
    traces = _traces(g)
    if not traces:
        return []
    starts = [min(t.columns["start_ns"]) - g.offsets.get(r, 0) for (_, r), t in traces.items() if len(t)]
    base = min(starts) if starts else 0
    waits: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    for j, t in zip(g.joined, g.timings):
        for rank, e in j.entries.items():
            waits.setdefault((j.step, rank), {})[e.op] = (t["waits"].get(rank, 0), t["last_rank"])
    events: list[dict[str, Any]] = []
    lanes: dict[int, int] = {}
    for (step, rank), trace in sorted(traces.items()):
        body, n_lanes = process_events(
            trace,
            pid=rank,
            base_ns=base + g.offsets.get(rank, 0),
            waits=waits.get((step, rank)),
            args={"step": step},
        )
        events.extend(body)
        lanes[rank] = max(lanes.get(rank, 0), n_lanes)
    meta: list[dict[str, Any]] = []
    for rank in g.ranks:
        meta.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        meta.extend(thread_names(rank, lanes.get(rank, 0)))
    events = meta + events
    for n, (j, t) in enumerate(zip(g.joined, g.timings)):
        if len(j.entries) < 2:
            continue
        members = sorted(j.entries.items(), key=lambda kv: (kv[1].issue_ns - g.offsets.get(kv[0], 0), kv[0]))
        for k, (rank, e) in enumerate(members):
            trace = traces[(j.step, rank)]
            start = trace.columns["start_ns"][e.op] if 0 <= e.op < len(trace) else e.issue_ns
            ph = "s" if k == 0 else ("f" if k == len(members) - 1 else "t")
            ev = {
                "ph": ph,
                "id": n,
                "name": f"{j.func} seq {j.seq}",
                "cat": "collective",
                "pid": rank,
                "tid": PHASE_TID.get(trace.columns["phase"][e.op], OTHER_TID)
                if 0 <= e.op < len(trace)
                else OTHER_TID,
                # Inside the op's slice, so the flow binds to it.
                "ts": (start - g.offsets.get(rank, 0) - base) / 1e3 + 0.0005,
                "args": {"verdict": j.verdict, "skew_us": t["skew_ns"] / 1e3},
            }
            if ph == "f":
                ev["bp"] = "e"
            events.append(ev)
    return events


def write_perfetto(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write :func:`perfetto_events` as ``{"traceEvents": [...]}`` to ``path``; returns the path."""
    return write_events(perfetto_events(g), path)
