"""Chrome / Perfetto trace JSON of a merged trace (the "JSON Array/Object format" both UIs load).

One process per rank (``pid`` = rank), one thread per phase (forward, backward, optimizer), every op as a
complete ("X") slice on aligned time in microseconds. Each joined collective is a flow: a start event on the
first member to arrive, steps on the others, bound to the collective's slice on each rank so the UI draws arrows
between the ranks.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import MergedTrace

_PHASE_TID = {"forward": 1, "backward": 2, "optimizer": 3}


def perfetto_events(g: MergedTrace) -> list[dict[str, Any]]:
    """The trace events (metadata, slices, flows) as dicts."""
    traces = g.tables()
    if not traces:
        return []
    base = (
        min(min(t.columns["start_ns"]) - g.offsets.get(r, 0) for (_, r), t in traces.items() if len(t))
        if any(len(t) for t in traces.values())
        else 0
    )
    events: list[dict[str, Any]] = []
    for rank in g.ranks:
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        for phase, tid in _PHASE_TID.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": phase}}
            )
    for (step, rank), trace in sorted(traces.items()):
        cols = trace.columns
        off = g.offsets.get(rank, 0) + base
        for i in range(len(trace)):
            events.append(
                {
                    "ph": "X",
                    "name": cols["label"][i],
                    "cat": cols["kind"][i],
                    "pid": rank,
                    "tid": _PHASE_TID.get(cols["phase"][i], 4),
                    "ts": (cols["start_ns"][i] - off) / 1e3,
                    "dur": max(cols["duration_ns"][i], 1) / 1e3,
                    "args": {
                        "step": step,
                        "module": cols["module"][i],
                        "func": cols["func"][i],
                        "flops": cols["flops"][i],
                    },
                }
            )
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
                "tid": _PHASE_TID.get(trace.columns["phase"][e.op], 4) if 0 <= e.op < len(trace) else 4,
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
    events = perfetto_events(g)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    return os.fspath(path)
