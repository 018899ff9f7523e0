"""Time analysis on aligned clocks: per-collective arrival skew and wait, stragglers, compute vs communication.

All times here are on each rank's reference clock (its times minus its offset from :mod:`.clocks`). A member's
*arrival* is when it issued the collective; its *wait* is the time from its arrival to the last member's arrival,
i.e. the time it spent blocked on others. The last member to arrive *caused* the others' waits: summed per step,
that ranks the stragglers (HTA's straggler view).

A wait no longer than the clock uncertainty between the two ranks (:meth:`.clocks.ClockSolution.pair`) could be
an artefact of the offsets: it is reported apart (``uncertain_wait_ns``) and blames nobody. Ranks on one clock
have no uncertainty between them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .clocks import ClockSolution
from .match import Joined


def collective_timing(j: Joined, clocks: ClockSolution) -> dict[str, Any]:
    """Aligned timing of one joined collective.

    Returns start_ns (first arrival), skew_ns (last arrival - first), duration_ns (last completion - first
    arrival), last_rank (the last to arrive, -1 unless its lead over some member exceeds their clock
    uncertainty), uncertainty_ns (largest clock uncertainty between the last arriver and another member; -1
    when some member's clock is not comparable), waits (per member, its wait beyond the uncertainty, else 0)
    and uncertain (per member, a wait within the uncertainty). Times are -1 when no member issued it.
    """
    offsets = clocks.offsets
    arrivals = {r: e.issue_ns - offsets.get(r, 0) for r, e in j.entries.items()}
    completes = [e.complete_ns - offsets.get(r, 0) for r, e in j.entries.items() if e.complete_ns >= 0]
    if not arrivals:
        return {
            "start_ns": -1,
            "skew_ns": -1,
            "duration_ns": -1,
            "last_rank": -1,
            "uncertainty_ns": -1,
            "waits": {},
            "uncertain": {},
        }
    first = min(arrivals.values())
    last_rank = max(arrivals, key=lambda r: (arrivals[r], -r))
    last = arrivals[last_rank]
    waits: dict[int, int] = {}
    uncertain: dict[int, int] = {}
    worst = 0
    for r, a in arrivals.items():
        if r == last_rank:
            waits[r] = 0
            continue
        u = clocks.pair(r, last_rank)
        worst = -1 if u is None or worst < 0 else max(worst, u)
        w = last - a
        if u is not None and w > u:
            waits[r] = w
        else:
            waits[r] = 0
            if w > 0:
                uncertain[r] = w
    blamed = any(w > 0 for w in waits.values())
    return {
        "start_ns": first,
        "skew_ns": last - first,
        "duration_ns": (max(completes) - first) if completes else -1,
        "last_rank": last_rank if blamed else -1,
        "uncertainty_ns": worst,
        "waits": waits,
        "uncertain": uncertain,
    }


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals: overlapping ones count once."""
    if not intervals:
        return 0
    arr = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    return union_arrays(arr[:, 0], arr[:, 1])


def union_arrays(starts: np.ndarray, ends: np.ndarray) -> int:
    """:func:`union_ns` of intervals given as two arrays."""
    if not len(starts):
        return 0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    covered = np.maximum.accumulate(e)
    # Sorted by start, what the earlier intervals cover beyond this one's start is [start, their max end].
    before = np.concatenate(([np.iinfo(np.int64).min], covered[:-1]))
    return int(np.maximum(0, e - np.maximum(s, before)).sum())


def straggler_rows(joined: list[Joined], timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (step, rank): the time others waited for it (as last arriver), how often it was last, its own wait,
    and its waits within the clock uncertainty. Waits are intervals [own arrival, last arrival]; overlapping ones
    (async collectives such as DDP's buckets in flight together) count once per waiting rank."""
    own: dict[tuple[int, int], list[tuple[int, int]]] = {}
    unsure: dict[tuple[int, int], list[tuple[int, int]]] = {}
    caused: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
    last_count: dict[tuple[int, int], int] = {}
    for j, t in zip(joined, timings):
        if j.p2p or len(j.entries) < 2 or j.verdict == "not_completed":
            continue
        last = t["last_rank"]
        end = t["start_ns"] + t["skew_ns"]
        for r, w in t["waits"].items():
            own.setdefault((j.step, r), []).append((end - w, end))
            if w > 0 and last >= 0:
                caused.setdefault((j.step, last), {}).setdefault(r, []).append((end - w, end))
        for r, w in t["uncertain"].items():
            unsure.setdefault((j.step, r), []).append((end - w, end))
        if last >= 0:
            last_count[(j.step, last)] = last_count.get((j.step, last), 0) + 1
    return [
        {
            "step": s,
            "rank": r,
            "caused_wait_ns": sum(union_ns(iv) for iv in caused.get((s, r), {}).values()),
            "last_count": last_count.get((s, r), 0),
            "wait_ns": union_ns(intervals),
            "uncertain_wait_ns": union_ns(unsure.get((s, r), [])),
        }
        for (s, r), intervals in own.items()
    ]


def local_breakdown(
    kind_is_collective: np.ndarray,
    starts: np.ndarray,
    durations: np.ndarray,
    async_spans: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[int, int, int]:
    """(compute_ns, comm_ns, window_ns) of one rank's window, from its op columns (no clocks needed).

    ``comm_ns`` is the time covered by at least one collective: a blocking collective's op interval (which
    includes its wait), an async one's issue-to-observed-completion interval (``async_spans``: op index, issue,
    completion; the op itself only enqueues); overlapping collectives (DDP buckets in flight together) count
    once. ``compute_ns`` sums every other op's duration; ``window_ns`` spans first op start to last op end.
    """
    n = len(starts)
    if not n:
        return 0, 0, 0
    compute = int(durations[~kind_is_collective].sum())
    ops = np.flatnonzero(kind_is_collective)
    s = starts[ops].copy()
    e = s + durations[ops]
    position = np.full(n, -1, dtype=np.int64)
    position[ops] = np.arange(len(ops))
    op, issue, complete = async_spans
    keep = (op >= 0) & (op < n)
    p = position[op[keep]]
    ok = p >= 0
    s[p[ok]] = issue[keep][ok]
    e[p[ok]] = complete[keep][ok]
    window = int((starts + durations).max() - starts.min())
    return compute, union_arrays(s, e), window


def breakdown_row(
    step: int, rank: int, ops: int, local: tuple[int, int, int], wait_ns: int
) -> dict[str, Any]:
    """One row of ``MergedTrace.time_breakdown``."""
    compute, comm, window = local
    return {
        "step": step,
        "rank": rank,
        "ops": ops,
        "compute_ns": compute,
        "comm_ns": comm,
        "wait_ns": wait_ns,
        "window_ns": window,
    }
