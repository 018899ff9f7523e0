"""Time analysis on aligned clocks: per-collective arrival skew and wait, stragglers, compute vs communication.

All times here are on each rank's reference clock (its times minus its offset from :mod:`.clocks`). A member's
*arrival* is when it issued the collective; its *wait* is the time from its arrival to the last member's arrival,
i.e. the time it spent blocked on others. The last member to arrive *caused* the others' waits: summed per step,
that ranks the stragglers (HTA's straggler view).

A wait no longer than the clock uncertainty between the two ranks (:meth:`.clocks.ClockSolution.rank_arrays`)
could be an artefact of the offsets: it is reported apart (``uncertain``) and blames nobody. Ranks on one clock
have no uncertainty between them. Computed for a whole step at once, on :class:`~.members.Members` arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..schema import P2P_ROLES
from ..step_facts import FACTS, window_facts
from .clocks import ClockSolution
from .match import Joined
from .members import Members, grouped_union

_MIN = np.iinfo(np.int64).min


@dataclass
class StepTiming:
    """Per collective of a step: start_ns (first arrival), skew_ns (last - first), duration_ns (last completion
    - first arrival; -1 when none completed), last_rank (the last to arrive; -1 unless its lead over some member
    exceeds their clock uncertainty), uncertainty_ns (largest clock uncertainty between the last arriver and a
    member; -1 when some member is not comparable). Per member row: wait (beyond the uncertainty, else 0) and
    uncertain (a wait within the uncertainty, else 0)."""

    start: np.ndarray
    skew: np.ndarray
    duration: np.ndarray
    last_rank: np.ndarray
    uncertainty: np.ndarray
    wait: np.ndarray
    uncertain: np.ndarray
    members: Members

    def collective(self, k: int) -> dict[str, Any]:
        """Collective ``k`` as a dict: the fields above, with ``waits`` / ``uncertain`` keyed by rank."""
        m = self.members
        rows = slice(m.starts[k], m.starts[k + 1])
        ranks = m.rank[rows].tolist()
        return {
            "start_ns": int(self.start[k]),
            "skew_ns": int(self.skew[k]),
            "duration_ns": int(self.duration[k]),
            "last_rank": int(self.last_rank[k]),
            "uncertainty_ns": int(self.uncertainty[k]),
            "waits": dict(zip(ranks, self.wait[rows].tolist())),
            "uncertain": {r: w for r, w in zip(ranks, self.uncertain[rows].tolist()) if w > 0},
        }


def step_timing(joined: list[Joined], clocks: ClockSolution, members: Members | None = None) -> StepTiming:
    """Aligned timing of every joined collective of one step (see :class:`StepTiming`)."""
    m = members if members is not None else Members.of(joined)
    n = len(joined)
    if not len(m.rank):
        empty = np.full(n, -1, dtype=np.int64)
        return StepTiming(empty, empty, empty, empty, empty, m.issue, m.issue, m)
    clock, offset, unc, ref = clocks.rank_arrays(int(m.rank.max()) + 1)
    heads = m.starts[:-1]
    arrival = m.issue - offset[m.rank]
    first = np.minimum.reduceat(arrival, heads)
    last = np.maximum.reduceat(arrival, heads)
    # The last to arrive: the lowest rank among those arriving last.
    big = np.iinfo(np.int64).max
    last_rank = np.minimum.reduceat(np.where(arrival == last[m.coll], m.rank, big), heads)
    lr = last_rank[m.coll]
    same = clock[m.rank] == clock[lr]
    comparable = same | ((unc[m.rank] >= 0) & (unc[lr] >= 0) & (ref[m.rank] == ref[lr]))
    u = np.where(same, 0, unc[m.rank] + unc[lr])
    w = last[m.coll] - arrival
    other = m.rank != lr
    clear = other & comparable & (w > u)
    wait = np.where(clear, w, 0)
    uncertain = np.where(other & ~clear & (w > 0), w, 0)
    blamed = np.maximum.reduceat(clear.astype(np.int64), heads) > 0
    per_member = np.where(other, np.where(comparable, u, -1), 0)
    uncertainty = np.where(
        np.minimum.reduceat(per_member, heads) < 0, -1, np.maximum.reduceat(per_member, heads)
    )
    done = np.maximum.reduceat(np.where(m.complete >= 0, m.complete - offset[m.rank], _MIN), heads)
    return StepTiming(
        first,
        last - first,
        np.where(done == _MIN, -1, done - first),
        np.where(blamed, last_rank, -1),
        uncertainty,
        wait,
        uncertain,
        m,
    )


def member_waits(joined: list[Joined], timing: StepTiming) -> Iterator[tuple[int, int, Any, int]]:
    """``(collective index, rank, that member's Entry, its wait ns)`` for every member row of a step's timing, in
    the rows' order (``Members.of``: each collective's entries in their dict order)."""
    wait = timing.wait.tolist()
    row = 0
    for k, j in enumerate(joined):
        for rank, entry in j.entries.items():
            yield k, rank, entry, wait[row]
            row += 1


def straggler_rows(step: int, joined: list[Joined], st: StepTiming) -> list[dict[str, Any]]:
    """Per rank of one step: the time others waited for it (as last arriver), how often it was last, its own
    wait, and its waits within the clock uncertainty. Waits are intervals [own arrival, last arrival];
    overlapping ones (async collectives such as DDP's buckets in flight together) count once per waiting rank.
    Point-to-point pairs count too, the receiver waiting for a late sender (pipeline stages)."""
    m = st.members
    eligible = np.array(
        [len(j.entries) >= 2 and j.verdict not in ("not_completed", "shifted") for j in joined], dtype=bool
    )
    if not eligible.any():
        return []
    # A send/recv pair: only the receiver waits (for a late sender); a send posted before its receive is
    # buffered or completes when the receiver gets there, and nobody waited for that receiver.
    sender = np.array([j.p2p and P2P_ROLES.get(e.func) == "send" for j in joined for e in j.entries.values()])
    last_all = st.last_rank.copy()
    for k, j in enumerate(joined):
        if j.p2p and last_all[k] >= 0 and P2P_ROLES.get(j.entries[int(last_all[k])].func) == "recv":
            last_all[k] = -1
    rows = eligible[m.coll]
    rank, end = m.rank[rows], (st.start + st.skew)[m.coll][rows]
    wait, unsure = np.where(sender, 0, st.wait)[rows], np.where(sender, 0, st.uncertain)[rows]
    last = last_all[m.coll][rows]
    ranks, own = grouped_union(rank, end - wait, end)
    width = int(m.rank.max()) + 1
    blame = (wait > 0) & (last >= 0)
    pairs, caused_pairs = grouped_union(last[blame] * width + rank[blame], (end - wait)[blame], end[blame])
    caused = np.zeros(width, dtype=np.int64)
    np.add.at(caused, pairs // width, caused_pairs)
    u_ranks, u_total = grouped_union(rank[unsure > 0], (end - unsure)[unsure > 0], end[unsure > 0])
    uncertain = dict(zip(u_ranks.tolist(), u_total.tolist()))
    lasts = last_all[eligible]
    last_count = np.bincount(lasts[lasts >= 0], minlength=width)
    return [
        {
            "step": step,
            "rank": r,
            "caused_wait_ns": int(caused[r]),
            "last_count": int(last_count[r]),
            "wait_ns": w,
            "uncertain_wait_ns": uncertain.get(r, 0),
        }
        for r, w in zip(ranks.tolist(), own.tolist())
    ]


def breakdown_row(step: int, rank: int, ops: int, facts: dict[str, int], wait_ns: int) -> dict[str, Any]:
    """One row of ``MergedTrace.time_breakdown``: the window's step facts (:func:`tl_dist.step_facts.local_facts`)
    and its wait on the aligned clock (:func:`straggler_rows`)."""
    return {"step": step, "rank": rank, "ops": ops, **{k: facts[k] for k in FACTS}, "wait_ns": wait_ns}


BREAKDOWN_COLUMNS = ("step", "rank", "ops", *FACTS, "wait_ns")
"""The columns of ``MergedTrace.time_breakdown()`` (docs/telemetry.md, "Step facts")."""


def trace_breakdown(step: int, rank: int, trace: Any, wait_ns: int = 0) -> dict[str, Any]:
    """:func:`breakdown_row` of one trace in memory, e.g. for a one-trace report."""
    return breakdown_row(step, rank, len(trace), window_facts(trace), wait_ns)
