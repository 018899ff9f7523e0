"""Per-rank clock offsets of one captured step: exact where ranks share a clock, bounded by causality elsewhere.

Times in a shard are the rank's wall clock (``time.time_ns``). Ranks whose shards name the same host and boot id
read one clock: their offset is 0 by construction. Between clocks nothing is assumed about how fast a collective
completes; only causality is used: a collective cannot complete on a member before every member it depends on
has issued it. For a matched collective j, members s (sources) and r (sinks) with issue time i_s and observed
completion c_r, each on its own clock (offset o = own clock - reference clock):

    c_r - o_r  >=  i_s - o_s        so        o_r - o_s  <=  c_r - i_s

(all-reduce, all-gather, reduce-scatter, barrier: every member depends on every member; broadcast, scatter:
the others on the root; reduce, gather: the root on everyone; send/recv: the receiver on the sender. All-to-all
is left out: a rank may send nothing to some peer.) A completion observed late (an async collective waited on
later) only loosens its bound; a recorded issue is never later than the real one, so every bound holds.

All bounds of the step form a system of difference constraints over the clocks. Written with one extra
variable per collective (minus its true release time), it is a graph with an edge clock -> collective per source
clock and collective -> clock per sink clock, and the tightest bounds of each clock against the reference are
shortest paths (Bellman-Ford, vectorised over the edges): ``upper = dist(ref -> k)``, ``lower = -dist(k -> ref)``.
The offset is the interval's midpoint and the uncertainty its half-width: the true offset lies within
``offset +- uncertainty``. Bounds that contradict each other (a clock stepped during the window) are all widened
by the smallest amount that makes them agree, reported as ``violation_ns`` and included in the uncertainty.

The reference is the clock of the lowest rank; ranks that share no usable collective with it, directly or
through others, are measured against the lowest rank of the set they do share collectives with. A clock bounded
on one side only (only broadcasts from it, say) gets no estimate (method ``none``).

Worked example: ``docs/merge.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .match import P2P_FUNCS, Joined

ALL_MEMBERS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "barrier"})
FROM_ROOT = frozenset({"broadcast", "scatter"})
TO_ROOT = frozenset({"reduce", "gather"})
_INF = np.int64(2**62)
_HALF = np.int64(2**61)  # anything above is unreachable


def clock_key(rank: int, metadata: dict[str, Any]) -> tuple:
    """Which clock a shard's times are on: (host, boot id) when the shard records a boot id, else its own."""
    boot = metadata.get("boot_id") or ""
    host = metadata.get("host") or ""
    return ("host", host, boot) if boot else ("rank", rank)


@dataclass
class ClockSolution:
    """The clocks of one step: per rank its offset (ns, own clock minus its reference's), uncertainty
    (half-width; None when not estimated), method, reference rank and evidence."""

    offsets: dict[int, int] = field(default_factory=dict)
    uncertainty: dict[int, int | None] = field(default_factory=dict)
    method: dict[int, str] = field(default_factory=dict)
    reference: dict[int, int] = field(default_factory=dict)
    collectives: dict[int, int] = field(default_factory=dict)
    violation_ns: int = 0
    _clock: dict[int, int] = field(default_factory=dict)  # rank -> clock index

    def pair(self, r: int, s: int) -> int | None:
        """How far aligned times of ranks r and s may be off against each other (ns); None: not comparable."""
        if self._clock.get(r) == self._clock.get(s):
            return 0
        ur, us = self.uncertainty.get(r), self.uncertainty.get(s)
        if ur is None or us is None or self.reference.get(r) != self.reference.get(s):
            return None
        return ur + us


def dependencies(j: Joined) -> tuple[list[int], list[int]] | None:
    """(sources, sinks) of a matched collective: sinks cannot complete before sources issued; None if unusable."""
    if j.verdict != "matched" or len(j.entries) < 2:
        return None
    if j.p2p:
        senders = [r for r, e in j.entries.items() if P2P_FUNCS.get(e.func) == "send"]
        receivers = [r for r, e in j.entries.items() if P2P_FUNCS.get(e.func) == "recv"]
        return (senders, receivers) if len(senders) == 1 and len(receivers) == 1 else None
    func = j.func
    members = list(j.entries)
    if func in ALL_MEMBERS:
        return members, members
    roots = {e.root for e in j.entries.values()}
    root = roots.pop() if len(roots) == 1 else -1
    if root not in j.entries:
        return None
    others = [r for r in members if r != root]
    if func in FROM_ROOT:
        return [root], others
    if func in TO_ROOT:
        return members, [root]
    return None


def estimate_clocks(joined: list[Joined], clock_of: dict[int, tuple]) -> ClockSolution:
    """Offsets of one step's ranks (``clock_of``: rank -> :func:`clock_key`) from its joined collectives.

    Example:
        >>> sol = estimate_clocks(joined, {0: ("rank", 0), 1: ("rank", 1)})
        >>> sol.offsets[1], sol.uncertainty[1], sol.method[1]
        (3000004500, 30500, 'estimated')
    """
    ranks = sorted(clock_of)
    keys = sorted({clock_of[r] for r in ranks}, key=lambda k: min(r for r in ranks if clock_of[r] == k))
    index = {k: i for i, k in enumerate(keys)}
    clock = {r: index[clock_of[r]] for r in ranks}
    n_clocks = len(keys)
    edges = _edges(joined, clock)
    sol = ClockSolution(_clock=clock)
    used = {r: 0 for r in ranks}
    for j, clocks in edges.evidence:
        for r in j.entries:
            if r in used and len(clocks) > 1:
                used[r] += 1
    sol.collectives = used
    # Components of clocks linked by evidence; each is measured against the clock of its lowest rank.
    parent = list(range(n_clocks))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for _, clocks in edges.evidence:
        first = find(clocks[0])
        for c in clocks[1:]:
            other = find(c)
            if other != first:
                parent[max(first, other)] = min(first, other)
                first = min(first, other)
    roots = sorted({find(c) for c in range(n_clocks)})  # clock i's lowest rank is lower than clock i+1's
    upper, lower_neg, violation = _solve(edges, n_clocks, roots)
    sol.violation_ns = violation
    lowest = {k: min(r for r in ranks if clock[r] == k) for k in range(n_clocks)}
    for r in ranks:
        c = clock[r]
        root = find(c)
        sol.reference[r] = lowest[root]
        if c == root:
            sol.offsets[r], sol.uncertainty[r], sol.method[r] = 0, 0, "same-host"
            continue
        d, e = int(upper[c]), int(lower_neg[c])
        if d >= _HALF or e >= _HALF:
            sol.offsets[r], sol.uncertainty[r], sol.method[r] = 0, None, "none"
            continue
        # [lower, upper] = [-e, d]: midpoint and half-width (rounded up, so the interval stays covered); bounds
        # that had to be widened to agree leave that much doubt on top.
        sol.offsets[r] = (d - e) // 2
        sol.uncertainty[r] = (d + e + 1) // 2 + violation
        sol.method[r] = "estimated"
    return sol


@dataclass
class _Edges:
    """The constraint graph: clock -> collective (weight -issue) and collective -> clock (weight +complete)."""

    in_clock: np.ndarray
    in_coll: np.ndarray
    in_w: np.ndarray
    out_coll: np.ndarray
    out_clock: np.ndarray
    out_w: np.ndarray
    n_colls: int
    evidence: list[tuple[Joined, list[int]]]


def _edges(joined: list[Joined], clock: dict[int, int]) -> _Edges:
    in_clock, in_coll, in_w, out_coll, out_clock, out_w = [], [], [], [], [], []
    evidence = []
    for j in joined:
        deps = dependencies(j)
        if deps is None:
            continue
        sources, sinks = deps
        latest: dict[int, int] = {}  # per clock, the latest issue among its sources: the binding one
        for s in sources:
            e = j.entries[s]
            c = clock.get(s)
            if c is not None and e.issue_ns >= 0 and e.issue_ns > latest.get(c, -1):
                latest[c] = e.issue_ns
        earliest: dict[int, int] = {}  # per clock, the earliest observed completion among its sinks
        for r in sinks:
            e = j.entries[r]
            c = clock.get(r)
            if c is not None and e.state == "completed" and e.complete_ns >= 0:
                if c not in earliest or e.complete_ns < earliest[c]:
                    earliest[c] = e.complete_ns
        clocks = sorted(set(latest) | set(earliest))
        if len(clocks) < 2 or not latest or not earliest:
            continue
        k = len(evidence)
        evidence.append((j, clocks))
        for c, t in latest.items():
            in_clock.append(c)
            in_coll.append(k)
            in_w.append(-t)
        for c, t in earliest.items():
            out_coll.append(k)
            out_clock.append(c)
            out_w.append(t)
    arr = np.asarray
    in_w_a, out_w_a = arr(in_w, dtype=np.int64), arr(out_w, dtype=np.int64)
    if len(in_w_a) and len(out_w_a):
        # Path weights are complete - issue: a common base keeps the numbers far from int64's limits.
        base = -int(in_w_a.max())
        in_w_a = in_w_a + base
        out_w_a = out_w_a - base
    return _Edges(
        arr(in_clock, dtype=np.int64),
        arr(in_coll, dtype=np.int64),
        in_w_a,
        arr(out_coll, dtype=np.int64),
        arr(out_clock, dtype=np.int64),
        out_w_a,
        len(evidence),
        evidence,
    )


def _relax(
    dist: np.ndarray,
    a_src: np.ndarray,
    a_dst: np.ndarray,
    a_w: np.ndarray,
    b_src: np.ndarray,
    b_dst: np.ndarray,
    b_w: np.ndarray,
    n_mid: int,
    limit: int,
) -> np.ndarray | None:
    """Shortest distances from the zeros of ``dist`` over clock -a-> collective -b-> clock hops; None when they
    do not settle within ``limit`` rounds (a negative cycle: contradictory bounds)."""
    for _ in range(limit):
        mid = np.full(n_mid, _INF, dtype=np.int64)
        via = dist[a_src]
        np.minimum.at(mid, a_dst, np.where(via >= _HALF, _INF, via + a_w))
        reach = mid[b_src]
        cand = np.full(len(dist), _INF, dtype=np.int64)
        np.minimum.at(cand, b_dst, np.where(reach >= _HALF, _INF, reach + b_w))
        new = np.minimum(dist, cand)
        if np.array_equal(new, dist):
            return dist
        dist = new
    return None


def _solve(edges: _Edges, n_clocks: int, roots: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(dist(root -> k), dist(k -> root), widening) for every clock; widening > 0 when the bounds contradict."""

    def attempt(widen: int) -> tuple[np.ndarray, np.ndarray] | None:
        start = np.full(n_clocks, _INF, dtype=np.int64)
        start[roots] = 0
        out_w = edges.out_w + widen
        limit = n_clocks + 1
        e = edges
        fwd = _relax(start, e.in_clock, e.in_coll, e.in_w, e.out_coll, e.out_clock, out_w, e.n_colls, limit)
        if fwd is None:
            return None
        bwd = _relax(start, e.out_clock, e.out_coll, out_w, e.in_coll, e.in_clock, e.in_w, e.n_colls, limit)
        if bwd is None or (fwd[roots] < 0).any() or (bwd[roots] < 0).any():
            return None
        return fwd, bwd

    found = attempt(0)
    if found is not None:
        return found[0], found[1], 0
    # Contradictory bounds: the least widening of every bound that makes them agree (doubling, then bisection to
    # the ns).
    hi = 1_000
    while (found := attempt(hi)) is None:
        hi *= 2
        if hi > 2**50:
            never = np.full(n_clocks, _INF, dtype=np.int64)
            never[roots] = 0
            return never, never, 0
    lo = hi // 2 if hi > 1_000 else 0  # the last widening that failed
    best = found
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best[0], best[1], hi
