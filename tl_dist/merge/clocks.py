"""Per-rank clock offsets from matched collectives.

A blocking collective completes at nearly the same instant on every member: the last member to arrive releases
them all. So for a matched, completed collective, member r's completion time minus the lowest member's is
(offset_r - offset_lo) + small jitter. Per pair (lo, r) the median of those differences shrugs off the odd late
observation; the offsets are then the least-squares solution of

    offset_r - offset_lo = median_diff(lo, r)      (weighted by sqrt(number of collectives))

with the lowest rank of each connected set of ranks fixed at 0. Ranks that never share a collective with the
reference are chained through the groups they do share (0-1, 1-2, 2-3 gives rank 3's offset). Async collectives
are used only when there are no blocking ones: their completion is observed when the user waits, which may be
long after the fact.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .match import Joined


def estimate_offsets(joined: list[Joined], ranks: list[int]) -> dict[int, int]:
    """Clock offset of each rank in ns (its clock minus the lowest rank's); 0 for ranks without evidence.

    Example:
        >>> offsets = estimate_offsets(joined, [0, 1])   # {0: 0, 1: 5_000_123}
    """
    usable = [
        j
        for j in joined
        if j.verdict == "matched"
        and len(j.entries) >= 2
        and all(e.state == "completed" and e.complete_ns >= 0 for e in j.entries.values())
    ]
    blocking = [j for j in usable if not any(e.is_async for e in j.entries.values())]
    usable = blocking or usable
    offsets = {r: 0 for r in ranks}
    index = {r: i for i, r in enumerate(ranks)}
    lo_ids, r_ids, diffs = [], [], []
    for j in usable:
        members = sorted(r for r in j.entries if r in index)
        if len(members) < 2:
            continue
        lo = members[0]
        base = j.entries[lo].complete_ns
        for r in members[1:]:
            lo_ids.append(index[lo])
            r_ids.append(index[r])
            diffs.append(j.entries[r].complete_ns - base)
    if not diffs:
        return offsets
    frame = pd.DataFrame({"lo": lo_ids, "r": r_ids, "d": np.asarray(diffs, dtype=np.int64)})
    pairs = frame.groupby(["lo", "r"]).d.agg(["median", "size"]).reset_index()
    n = len(ranks)
    # Connected sets of ranks (union-find over the pairs): each one's lowest rank is its reference.
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in zip(pairs["lo"], pairs["r"]):
        ra, rb = find(int(a)), find(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    involved = sorted(set(pairs["lo"]) | set(pairs["r"]))
    roots = sorted({find(int(i)) for i in involved})
    rows = len(pairs) + len(roots)
    a_mat = np.zeros((rows, n))
    b_vec = np.zeros(rows)
    w = np.sqrt(pairs["size"].to_numpy(dtype=np.float64))
    k = np.arange(len(pairs))
    a_mat[k, pairs["r"].to_numpy()] = w
    a_mat[k, pairs["lo"].to_numpy()] = -w
    b_vec[: len(pairs)] = w * pairs["median"].to_numpy(dtype=np.float64)
    for m, root in enumerate(roots):
        a_mat[len(pairs) + m, root] = 1e6  # pins the reference of each connected set at 0
    solution = np.linalg.lstsq(a_mat, b_vec, rcond=None)[0]
    for i in involved:
        offsets[ranks[int(i)]] = int(round(solution[int(i)]))
    return offsets
