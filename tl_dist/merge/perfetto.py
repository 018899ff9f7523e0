"""Chrome / Perfetto trace JSON of a merged trace (the "JSON Array/Object format" both UIs load).

One process per rank (``pid`` = rank), one thread per phase (forward, backward, optimizer), every op as a
complete ("X") slice on aligned time in microseconds. Each joined collective is a flow: a start event on the
first member to arrive, steps on the others, bound to the collective's slice on each rank so the UI draws arrows
between the ranks.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .timing import step_timing

if TYPE_CHECKING:
    from .graph import MergedTrace

_PHASE_TID = {"forward": 1, "backward": 2, "optimizer": 3}


def perfetto_events(g: MergedTrace) -> Iterator[dict[str, Any]]:
    """The trace events (metadata, slices, flows) as dicts, one rank's shard read at a time."""
    keys = g.keys()
    if not keys:
        return
    offsets = g.offsets
    base = g.aligned_origin_ns()
    ids = itertools.count()
    for rank in g.ranks:
        yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        for phase, tid in _PHASE_TID.items():
            yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": phase}}
    for step in g.steps:
        anchors: dict[int, dict[int, tuple[float, int]]] = {}  # rank -> collective op -> (ts, tid)
        for (_, rank), trace in g.iter_traces(step=step):
            cols = trace.columns
            shift = offsets.get((step, rank), 0) + base
            labels, kinds, phases, starts = cols["label"], cols["kind"], cols["phase"], cols["start_ns"]
            durations, modules, funcs, flops = (
                cols["duration_ns"],
                cols["module"],
                cols["func"],
                cols["flops"],
            )
            mine = anchors.setdefault(rank, {})
            for i in range(len(trace)):
                ts = (starts[i] - shift) / 1e3
                tid = _PHASE_TID.get(phases[i], 4)
                if kinds[i] == "collective":
                    mine[i] = (ts, tid)
                yield {
                    "ph": "X",
                    "name": labels[i],
                    "cat": kinds[i],
                    "pid": rank,
                    "tid": tid,
                    "ts": ts,
                    "dur": max(durations[i], 1) / 1e3,
                    "args": {"step": step, "module": modules[i], "func": funcs[i], "flops": flops[i]},
                }
        yield from _flows(g, step, anchors, base, ids)


def _flows(
    g: MergedTrace, step: int, anchors: dict[int, dict[int, tuple[float, int]]], base: int, ids: Iterator[int]
) -> Iterator[dict]:
    """One flow per joined collective of ``step``: ``s`` on the first member to arrive, ``t``/``f`` on the others,
    each inside that member's slice of the collective so the UI binds it."""
    clocks = g.clock_solutions[step]
    joined = g.joined_step(step)
    timing = step_timing(joined, clocks)
    offset = clocks.offsets
    for k, j in enumerate(joined):
        if len(j.entries) < 2:
            continue
        members = sorted(j.entries.items(), key=lambda kv: (kv[1].issue_ns - offset.get(kv[0], 0), kv[0]))
        flow_id = next(ids)
        skew_us = int(timing.skew[k]) / 1e3
        for n, (rank, e) in enumerate(members):
            ts, tid = anchors.get(rank, {}).get(e.op, ((e.issue_ns - offset.get(rank, 0) - base) / 1e3, 4))
            ph = "s" if n == 0 else ("f" if n == len(members) - 1 else "t")
            ev = {
                "ph": ph,
                "id": flow_id,
                "name": f"{j.func} seq {j.seq}",
                "cat": "collective",
                "pid": rank,
                "tid": tid,
                "ts": ts + 0.0005,
                "args": {"verdict": j.verdict, "skew_us": skew_us},
            }
            if ph == "f":
                ev["bp"] = "e"
            yield ev


def write_perfetto(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write :func:`perfetto_events` as ``{"traceEvents": [...]}`` to ``path``, event by event; returns the
    path."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write('{"displayTimeUnit": "ms", "traceEvents": [')
            for n, event in enumerate(perfetto_events(g)):
                fh.write(("," if n else "") + "\n" + json.dumps(event))
            fh.write("\n]}\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return os.fspath(path)
