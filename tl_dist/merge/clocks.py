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

from ..schema import P2P_ROLES
from .match import Joined
from .members import Members

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
    # True when the bounds contradicted each other by more than widening may repair (a clock stepped by days
    # inside the window): violation_ns is then the widening that still failed, and no clock is estimated.
    unresolved: bool = False
    _clock: dict[int, int] = field(default_factory=dict)  # rank -> clock index

    def rank_arrays(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per rank (index) < ``size``: clock index, offset, uncertainty (-1: not estimated) and reference rank.

        Aligned times of ranks r and s may be off against each other by 0 when they share a clock, else by
        uncertainty[r] + uncertainty[s] when both are estimated against the same reference; otherwise they are
        not comparable.
        """
        clock = np.full(size, -1, dtype=np.int64)
        offset = np.zeros(size, dtype=np.int64)
        unc = np.full(size, -1, dtype=np.int64)
        ref = np.full(size, -1, dtype=np.int64)
        for r, c in self._clock.items():
            if r < size:
                clock[r], offset[r], ref[r] = c, self.offsets[r], self.reference[r]
                u = self.uncertainty[r]
                unc[r] = -1 if u is None else u
        return clock, offset, unc, ref


def dependency(j: Joined) -> tuple[str, int, int] | None:
    """How a matched collective's members depend on each other: ("all", -1, -1) (every member on every member),
    ("from", root, -1) (the others on the root), ("to", root, -1) (the root on everyone) or ("p2p", sender,
    receiver); None when it bounds nothing."""
    if j.verdict != "matched" or len(j.entries) < 2:
        return None
    if j.p2p:
        senders = [r for r, e in j.entries.items() if P2P_ROLES.get(e.func) == "send"]
        receivers = [r for r, e in j.entries.items() if P2P_ROLES.get(e.func) == "recv"]
        return ("p2p", senders[0], receivers[0]) if len(senders) == 1 and len(receivers) == 1 else None
    func = j.func
    if func in ALL_MEMBERS:
        return "all", -1, -1
    roots = {e.root for e in j.entries.values()}
    root = roots.pop() if len(roots) == 1 else -1
    if root not in j.entries:
        return None
    if func in FROM_ROOT:
        return "from", root, -1
    if func in TO_ROOT:
        return "to", root, -1
    return None


def estimate_clocks(
    joined: list[Joined], clock_of: dict[int, tuple], members: Members | None = None
) -> ClockSolution:
    """Offsets of one step's ranks (``clock_of``: rank -> :func:`clock_key`) from its joined collectives
    (``members``: the same as :class:`~.members.Members`, when already built).

    Example:
        >>> sol = estimate_clocks(g.joined_step(0), {0: ("rank", 0), 1: ("rank", 1)})
        >>> sol.offsets[1], sol.uncertainty[1], sol.method[1]
    """
    ranks = sorted(clock_of)
    index: dict[tuple, int] = {}
    for r in ranks:  # clocks numbered by their lowest rank
        index.setdefault(clock_of[r], len(index))
    clock = {r: index[clock_of[r]] for r in ranks}
    n_clocks = len(index)
    clock_of_rank = np.full(max(ranks, default=-1) + 1, -1, dtype=np.int64)
    clock_of_rank[ranks] = [clock[r] for r in ranks]
    m = members if members is not None else Members.of(joined)
    edges = _edges(joined, m, clock_of_rank, n_clocks)
    sol = ClockSolution(_clock=clock)
    taking_part = np.bincount(m.rank[edges.evidence[m.coll]], minlength=len(clock_of_rank))
    sol.collectives = {r: int(taking_part[r]) for r in ranks}
    # Components of clocks linked by evidence; each is measured against the clock of its lowest rank.
    parent = list(range(n_clocks))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in edges.links:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = sorted({find(c) for c in range(n_clocks)})  # clock i's lowest rank is lower than clock i+1's
    upper, lower_neg, violation, resolved = _solve(edges, n_clocks, roots)
    sol.violation_ns, sol.unresolved = violation, not resolved
    lowest = {}
    for r in ranks:
        lowest.setdefault(clock[r], r)
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
    evidence: np.ndarray  # per joined collective: used as evidence
    links: list[tuple[int, int]]  # clock pairs that share evidence


_KINDS = {"all": 0, "from": 1, "to": 2, "p2p": 3}


def _edges(joined: list[Joined], m: Members, clock_of_rank: np.ndarray, n_clocks: int) -> _Edges:
    n = len(joined)
    kind = np.full(n, -1, dtype=np.int64)
    a = np.full(n, -1, dtype=np.int64)
    b = np.full(n, -1, dtype=np.int64)
    for k, j in enumerate(joined):
        dep = dependency(j)
        if dep is not None:
            kind[k], a[k], b[k] = _KINDS[dep[0]], dep[1], dep[2]
    mk, ma, mb = kind[m.coll], a[m.coll], b[m.coll]
    is_a = m.rank == ma
    source = (mk == 0) | (mk == 2) | ((mk == 1) & is_a) | ((mk == 3) & is_a)
    sink = (mk == 0) | ((mk == 1) & ~is_a) | ((mk == 2) & is_a) | ((mk == 3) & (m.rank == mb))
    source &= (mk >= 0) & (m.issue >= 0)
    sink &= (mk >= 0) & m.completed
    clk = clock_of_rank[m.rank]
    # Per (collective, clock): the latest issue among its sources binds, and the earliest completion among its
    # sinks.
    src_key, latest = _reduce(m.coll[source] * n_clocks + clk[source], m.issue[source], np.maximum)
    snk_key, earliest = _reduce(m.coll[sink] * n_clocks + clk[sink], m.complete[sink], np.minimum)
    pairs = np.union1d(src_key, snk_key)
    clocks_in = np.bincount(pairs // n_clocks, minlength=n)
    evidence = (
        (clocks_in >= 2)
        & (np.bincount(src_key // n_clocks, minlength=n) > 0)
        & (np.bincount(snk_key // n_clocks, minlength=n) > 0)
    )
    renumber = np.cumsum(evidence) - 1
    keep_src = evidence[src_key // n_clocks]
    keep_snk = evidence[snk_key // n_clocks]
    in_w, out_w = -latest[keep_src], earliest[keep_snk]
    if len(in_w) and len(out_w):
        # Path weights are complete - issue: a common base keeps the numbers far from int64's limits.
        base = -int(in_w.max())
        in_w, out_w = in_w + base, out_w - base
    used = pairs[evidence[pairs // n_clocks]]
    first_clock = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(first_clock, used // n_clocks, -(used % n_clocks) - 1)  # the lowest clock, negated
    links = set(zip((-first_clock[used // n_clocks] - 1).tolist(), (used % n_clocks).tolist()))
    return _Edges(
        src_key[keep_src] % n_clocks,
        renumber[src_key[keep_src] // n_clocks],
        in_w,
        renumber[snk_key[keep_snk] // n_clocks],
        snk_key[keep_snk] % n_clocks,
        out_w,
        int(evidence.sum()),
        evidence,
        sorted(links),
    )


def _reduce(keys: np.ndarray, values: np.ndarray, ufunc: np.ufunc) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``keys`` and ``ufunc`` (np.maximum / np.minimum) of their ``values``."""
    if not len(keys):
        return keys, values
    order = np.argsort(keys, kind="stable")
    k, v = keys[order], values[order]
    first = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    return k[first], ufunc.reduceat(v, first)


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


def _solve(edges: _Edges, n_clocks: int, roots: list[int]) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """(dist(root -> k), dist(k -> root), widening, resolved) for every clock; widening > 0 when the bounds
    contradict; resolved False when no widening up to the limit repairs them (widening: the last one tried)."""

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
        return found[0], found[1], 0, True
    # Contradictory bounds: the least widening of every bound that makes them agree (doubling, then bisection to
    # the ns).
    hi = 1_000
    while (found := attempt(hi)) is None:
        if hi * 2 > 2**50:
            never = np.full(n_clocks, _INF, dtype=np.int64)
            never[roots] = 0
            return never, never, hi, False
        hi *= 2
    lo = hi // 2 if hi > 1_000 else 0  # the last widening that failed
    best = found
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best[0], best[1], hi, True
