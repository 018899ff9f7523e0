"""Chrome / Perfetto trace JSON of one trace (``trace.to_perfetto``), and the per-process events a merged
export repeats for every rank.

Tracks of one process:

- ``forward`` / ``backward`` / ``optimizer`` / ``recompute``: every op as a complete ("X") slice, inside slices of the module
  calls it ran in, nested by depth. A run of consecutive ops drawn in the same module call (see
  :func:`tl_dist.views.graph.home_calls`: backward ops belong to their forward op's call, optimizer ops to their
  parameters' module) is one slice, so slices nest by construction.
- ``collectives``: each collective (category ``comm``) from issue to observed completion (an async one is in flight while other
  ops run); collectives in flight together go on extra lanes so no two slices of a track partly overlap. A
  merged export adds, inside each, a ``wait`` slice: the time this rank waited for the last member to arrive.
- a counter ``live activation bytes``: each op output counts from the op that made it to the end of the last
  op that read it (or the window's end when the trace saved it). Views and in-place results alias their
  base: they add no bytes but keep the base alive while they are read. Inputs and parameters (and views of
  them) are not counted.

Times are microseconds from the earliest op (the merged export: on the aligned clock).

Example:
    >>> trace.to_perfetto("step.json")   # open in https://ui.perfetto.dev
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._files import replacing
from ..schema import PHASES
from .graph import home_calls

if TYPE_CHECKING:
    from ..trace import Trace

PHASE_TID = {phase: tid for tid, phase in enumerate(PHASES, 1)}
OTHER_TID = len(PHASES) + 1
COMM_TID = 10  # first lane of collectives in flight; lane k is COMM_TID + k
COUNTER = "live activation bytes"


def _us(ns: float) -> float:
    return ns / 1e3


def thread_names(pid: int, lanes: int) -> list[dict[str, Any]]:
    """The ``thread_name`` metadata of a process's tracks (phases, then ``lanes`` collective lanes)."""
    names = {**{tid: phase for phase, tid in PHASE_TID.items()}, OTHER_TID: "other"}
    names.update({COMM_TID + k: "collectives" + (f" {k + 1}" if k else "") for k in range(lanes)})
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        for tid, name in names.items()
    ] + [
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        for tid in names
    ]


def module_runs(trace: Trace) -> list[tuple[int, int, int, str]]:
    """``(first op, last op, call row, phase)`` of every module slice: maximal runs of consecutive ops of one
    phase drawn inside that call (at every depth of its enclosing calls)."""
    cols = trace.columns
    parent_of = trace.module_table["parent"]
    home = home_calls(trace)
    phases = cols["phase"]
    runs: list[tuple[int, int, int, str]] = []
    open_runs: dict[str, list[tuple[int, int]]] = {}  # phase -> [(call row, first op)] outermost first
    last_op: dict[str, int] = {}

    def close(phase: str, keep: int) -> None:
        stack = open_runs.get(phase, [])
        while len(stack) > keep:
            row, first = stack.pop()
            runs.append((first, last_op[phase], row, phase))

    for i in range(len(trace)):
        phase = phases[i]
        chain = []
        row = home[i]
        while row >= 0:
            chain.append(row)
            row = parent_of[row]
        chain.reverse()
        stack = open_runs.setdefault(phase, [])
        same = 0
        while same < len(stack) and same < len(chain) and stack[same][0] == chain[same]:
            same += 1
        close(phase, same)
        stack.extend((row, i) for row in chain[same:])
        last_op[phase] = i
    for phase in list(open_runs):
        close(phase, 0)
    depth = trace.module_table["depth"]
    return sorted(runs, key=lambda r: (r[0], -r[1], depth[r[2]]))


def live_bytes(trace: Trace) -> list[tuple[int, int]]:
    """``(time ns, live activation bytes from then on)`` at every change, in time order (see module doc)."""
    cols = trace.columns
    n = len(trace)
    if not n:
        return []
    starts, durations = cols["start_ns"], cols["duration_ns"]
    kinds, parents, inplace, out_bytes = cols["kind"], cols["parents"], cols["inplace"], cols["out_bytes"]
    ends = [s + d for s, d in zip(starts, durations)]
    window_end = max(ends)
    owner = list(range(n))  # whose bytes an output is (views and in-place results: their base's)
    freed = list(ends)  # when each owner's bytes are last read
    for i in range(n):
        if kinds[i] == "view" or inplace[i]:
            # -1: an alias of a tensor no op made (a parameter's weight.t(), an optimizer's param.add_())
            owner[i] = owner[parents[i][0]] if parents[i] else -1
        for p in parents[i]:
            o = owner[p]
            if o >= 0:
                freed[o] = max(freed[o], ends[i])
    # A saved output (or a saved view of it) is held until the window's end.
    held = {owner[i] for i in trace.saved if 0 <= i < n and owner[i] >= 0}
    changes: dict[int, int] = {}
    for i in range(n):
        if owner[i] != i or not out_bytes[i]:
            continue
        end = window_end if i in held else freed[i]
        changes[starts[i]] = changes.get(starts[i], 0) + out_bytes[i]
        changes[end] = changes.get(end, 0) - out_bytes[i]
    level, points = 0, []
    for t in sorted(changes):
        level += changes[t]
        points.append((t, level))
    return points


def process_events(
    trace: Trace,
    *,
    pid: int,
    base_ns: int,
    waits: Mapping[int, tuple[int, int]] | None = None,
    args: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The slices and counter of one trace as process ``pid`` (times: ns minus ``base_ns``, as us). ``waits``
    maps a collective's op index to (wait ns, last rank) for the merged export's wait slices; ``args`` are
    added to every slice's. Returns the events and how many collective lanes they use."""
    cols = trace.columns
    table = trace.module_table
    starts, durations = cols["start_ns"], cols["duration_ns"]
    events: list[dict[str, Any]] = []
    extra = dict(args or {})
    for first, last, row, phase in module_runs(trace):
        begin = starts[first]
        end = starts[last] + max(durations[last], 1)  # as the op's slice ends
        address, mtype = table["address"][row], table["type"][row]
        events.append(
            {
                "ph": "X",
                "name": f"{address or '<root>'} ({mtype})",
                "cat": "module",
                "pid": pid,
                "tid": PHASE_TID.get(phase, OTHER_TID),
                "ts": _us(begin - base_ns),
                "dur": _us(end - begin),
                "args": {
                    "address": address,
                    "type": mtype,
                    "call": table["call"][row],
                    "depth": table["depth"][row],
                    **extra,
                },
            }
        )
    for i in range(len(trace)):
        events.append(
            {
                "ph": "X",
                "name": cols["label"][i],
                "cat": cols["kind"][i],
                "pid": pid,
                "tid": PHASE_TID.get(cols["phase"][i], OTHER_TID),
                "ts": _us(starts[i] - base_ns),
                "dur": _us(max(durations[i], 1)),
                "args": {
                    "module": cols["module"][i],
                    "func": cols["func"][i],
                    "flops": cols["flops"][i],
                    "out_bytes": cols["out_bytes"][i],
                    "source": cols["source"][i],
                    **extra,
                },
            }
        )
    lanes_end: list[int] = []  # per lane: when its last collective ends
    ct = trace.collective_table
    for row in sorted(range(len(ct["op"])), key=lambda r: ct["issue_ns"][r]):
        op, issue, complete = ct["op"][row], ct["issue_ns"][row], ct["complete_ns"][row]
        if not 0 <= op < len(trace):
            continue
        end = complete if complete >= issue else starts[op] + durations[op]
        end = max(end, issue + 1)
        lane = next((k for k, t in enumerate(lanes_end) if t <= issue), len(lanes_end))
        if lane == len(lanes_end):
            lanes_end.append(end)
        lanes_end[lane] = end
        tid = COMM_TID + lane
        events.append(
            {
                "ph": "X",
                "name": f"{ct['func'][row]} seq {ct['seq'][row]}",
                "cat": "comm",
                "pid": pid,
                "tid": tid,
                "ts": _us(issue - base_ns),
                "dur": _us(end - issue),
                "args": {
                    "label": cols["label"][op],
                    "group": list(ct["group_ranks"][row]),
                    "bytes": ct["bytes"][row],
                    "async": bool(ct["is_async"][row]),
                    "state": ct["state"][row],
                    **extra,
                },
            }
        )
        wait = (waits or {}).get(op)
        if wait and wait[0] > 0:
            waited = min(wait[0], end - issue)
            events.append(
                {
                    "ph": "X",
                    "name": f"wait for rank {wait[1]}",
                    "cat": "wait",
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(issue - base_ns),
                    "dur": _us(waited),
                    "args": {"wait_ns": wait[0], "last_rank": wait[1], **extra},
                }
            )
    for t, level in live_bytes(trace):
        events.append(
            {"ph": "C", "name": COUNTER, "pid": pid, "ts": _us(t - base_ns), "args": {"bytes": level}}
        )
    return events, len(lanes_end)


def trace_events(trace: Trace) -> list[dict[str, Any]]:
    """Every event of ``trace``'s Perfetto export (see the module doc), its process named after its rank."""
    base = min(trace.columns["start_ns"], default=0)
    pid = trace.rank if trace.rank is not None else 0
    events, lanes = process_events(trace, pid=pid, base_ns=base)
    name = f"rank {trace.rank}" if trace.rank is not None else "tl_dist trace"
    if trace.step is not None:
        name += f" step {trace.step}"
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}]
    return meta + thread_names(pid, lanes) + events


def write_events(events: Iterable[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write ``{"traceEvents": events}`` as JSON to ``path``, event by event (a merged export streams them), under
    a temporary name renamed when complete; returns the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write('{"displayTimeUnit": "ms", "traceEvents": [')
        for n, event in enumerate(events):
            fh.write(("," if n else "") + "\n" + json.dumps(event))
        fh.write("\n]}\n")
    return os.fspath(path)


def to_perfetto(trace: Trace, path: str | os.PathLike) -> str:
    """Write ``trace`` as Chrome/Perfetto trace JSON to ``path`` (tracks: see the module doc); returns ``path``.

    Example:
        >>> tl.trace(model, x).to_perfetto("trace.json")
        'trace.json'
    """
    return write_events(trace_events(trace), path)
