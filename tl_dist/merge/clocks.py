"""Per-rank clock offsets from matched collectives.

A blocking collective completes at nearly the same instant on every member: the last member to arrive releases
them all. So for each matched, completed collective the members' completion times differ by (clock offset +
small jitter). Offsets are the values that make completions agree best, found by alternating medians:

    centre_c = median over members m of (complete_{c,m} - offset_m)
    offset_r = median over collectives c of r of (complete_{c,r} - centre_c)

then shifted so the lowest rank has offset 0. Medians shrug off the odd late observation; a few rounds suffice
because a good start (offset 0 on one host) is already close. Async collectives are used only when there are no
blocking ones: their completion is observed when the user waits, which may be long after the fact.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .match import Joined

_ROUNDS = 8


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
    if not usable or not ranks:
        return offsets
    index = {r: i for i, r in enumerate(ranks)}
    slot_ids, rank_ids, times = [], [], []
    for c, j in enumerate(usable):
        for r, e in j.entries.items():
            if r in index:
                slot_ids.append(c)
                rank_ids.append(index[r])
                times.append(e.complete_ns)
    slot_ids_a = np.asarray(slot_ids)
    rank_ids_a = np.asarray(rank_ids)
    t = np.asarray(times, dtype=np.int64)
    base = int(t.min())
    # Relative times fit float64 exactly for runs shorter than ~100 days.
    tf = (t - base).astype(np.float64)
    n_slots, n_ranks = len(usable), len(ranks)
    off = np.zeros(n_ranks)
    slot_keys = pd.Index(slot_ids_a)
    rank_keys = pd.Index(rank_ids_a)
    for _ in range(_ROUNDS):
        centre = (
            pd.Series(tf - off[rank_ids_a]).groupby(slot_keys).median().reindex(range(n_slots)).to_numpy()
        )
        dev = pd.Series(tf - centre[slot_ids_a]).groupby(rank_keys).median()
        new = dev.reindex(range(n_ranks)).fillna(0.0).to_numpy()
        done = np.allclose(new, off, atol=1.0)
        off = new
        if done:
            break
    has = np.bincount(rank_ids_a, minlength=n_ranks) > 0
    ref = int(np.argmax(has))  # lowest rank with evidence
    off = off - off[ref]
    return {r: (int(round(off[i])) if has[i] else 0) for r, i in index.items()}
