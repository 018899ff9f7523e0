"""Time analysis on aligned clocks: per-collective arrival skew and wait, stragglers, compute vs communication.

All times here are on the reference clock (each rank's times minus its offset from :mod:`.clocks`). A member's
*arrival* is when it issued the collective; its *wait* is the time from its arrival to the last member's arrival,
i.e. the time it spent blocked on others. The last member to arrive *caused* the others' waits: summed per step,
that ranks the stragglers (HTA's straggler view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .match import Joined

if TYPE_CHECKING:
    from ..trace import Trace


def collective_timing(j: Joined, offsets: dict[int, int]) -> dict[str, Any]:
    """Aligned timing of one joined collective: first arrival, skew, duration, last rank and each rank's wait.

    Only members that issued it count; times are -1 when fewer than one member completed it.
    """
    arrivals = {r: e.issue_ns - offsets.get(r, 0) for r, e in j.entries.items()}
    completes = [e.complete_ns - offsets.get(r, 0) for r, e in j.entries.items() if e.complete_ns >= 0]
    if not arrivals:
        return {"start_ns": -1, "skew_ns": -1, "duration_ns": -1, "last_rank": -1, "waits": {}}
    first = min(arrivals.values())
    last_rank = max(arrivals, key=lambda r: (arrivals[r], -r))
    last = arrivals[last_rank]
    return {
        "start_ns": first,
        "skew_ns": last - first,
        "duration_ns": (max(completes) - first) if completes else -1,
        "last_rank": last_rank if len(arrivals) > 1 else -1,
        "waits": {r: last - a for r, a in arrivals.items()},
    }


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals: overlapping ones count once."""
    total = 0
    end = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def straggler_rows(joined: list[Joined], timings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (step, rank): the time others waited for it (as last arriver), how often it was last, and its own
    wait. Waits are intervals [own arrival, last arrival]; overlapping ones (async collectives such as DDP's
    buckets in flight together) count once per waiting rank."""
    own: dict[tuple[int, int], list[tuple[int, int]]] = {}
    caused: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
    last_count: dict[tuple[int, int], int] = {}
    for j, t in zip(joined, timings):
        if j.p2p or len(j.entries) < 2 or j.verdict == "not_completed":
            continue
        last = t["last_rank"]
        end = t["start_ns"] + t["skew_ns"]
        for r, w in t["waits"].items():
            own.setdefault((j.step, r), []).append((end - w, end))
            if last >= 0 and r != last:
                caused.setdefault((j.step, last), {}).setdefault(r, []).append((end - w, end))
        if last >= 0:
            last_count[(j.step, last)] = last_count.get((j.step, last), 0) + 1
    return [
        {
            "step": s,
            "rank": r,
            "caused_wait_ns": sum(union_ns(iv) for iv in caused.get((s, r), {}).values()),
            "last_count": last_count.get((s, r), 0),
            "wait_ns": union_ns(intervals),
        }
        for (s, r), intervals in own.items()
    ]


def time_breakdown(step: int, rank: int, trace: Trace, waits_ns: int) -> dict[str, Any]:
    """Compute vs communication time of one rank's window.

    ``comm_ns`` is the time covered by at least one collective: a blocking collective's op interval (which
    includes its wait), an async one's issue-to-observed-completion interval (the op itself only enqueues);
    overlapping collectives (DDP buckets in flight together) count once. ``compute_ns`` sums every other op's
    duration. ``window_ns`` spans first op start to last op end.

    ``wait_ns`` (from :func:`straggler_rows`) is the union of the rank's wait intervals.
    """
    cols = trace.columns
    kinds, durations, starts = cols["kind"], cols["duration_ns"], cols["start_ns"]
    ct = trace.collective_table
    async_ops = {
        int(op): (int(i), int(c))
        for op, a, i, c in zip(ct["op"], ct["is_async"], ct["issue_ns"], ct["complete_ns"])
        if a and c >= 0
    }
    compute = 0
    intervals = []
    for i, (k, d) in enumerate(zip(kinds, durations)):
        if k == "collective":
            intervals.append(async_ops.get(i, (starts[i], starts[i] + d)))
        else:
            compute += d
    comm = union_ns(intervals)
    window = (max(s + d for s, d in zip(starts, durations)) - min(starts)) if starts else 0
    return {
        "step": step,
        "rank": rank,
        "ops": len(kinds),
        "compute_ns": compute,
        "comm_ns": comm,
        "wait_ns": waits_ns,
        "window_ns": window,
    }
