"""One step's joined collectives as flat arrays, one row per (collective, member): what the clock estimate and the
timing analysis compute on, vectorised (a step of 1,024 ranks x 500 collectives is half a million rows)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .match import Joined


@dataclass
class Members:
    """Rows sorted by collective (its index in the step's ``joined``), then rank."""

    coll: np.ndarray  # int64: index of the joined collective
    rank: np.ndarray  # int64
    issue: np.ndarray  # int64, rank's clock
    complete: np.ndarray  # int64, rank's clock; -1 when never seen complete
    completed: np.ndarray  # bool: state completed with a completion time
    starts: np.ndarray  # int64: first row of each collective (len(joined) + 1 entries)

    @classmethod
    def of(cls, joined: list[Joined]) -> Members:
        coll, rank, issue, complete, completed = [], [], [], [], []
        for k, j in enumerate(joined):
            for r in sorted(j.entries):
                e = j.entries[r]
                coll.append(k)
                rank.append(r)
                issue.append(e.issue_ns)
                complete.append(e.complete_ns)
                completed.append(e.state == "completed" and e.complete_ns >= 0)
        coll_a = np.asarray(coll, dtype=np.int64)
        starts = np.searchsorted(coll_a, np.arange(len(joined) + 1))
        return cls(
            coll_a,
            np.asarray(rank, dtype=np.int64),
            np.asarray(issue, dtype=np.int64),
            np.asarray(complete, dtype=np.int64),
            np.asarray(completed, dtype=bool),
            starts,
        )


def grouped_union(keys: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct key, the total length of the union of its [start, end) intervals: (keys, totals)."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort((starts, keys))
    k, s, e = keys[order], starts[order], ends[order]
    first = np.concatenate(([True], k[1:] != k[:-1]))
    group = np.cumsum(first) - 1
    # Running max of the ends within each group, on the ends' ranks so that group offsets never overflow.
    values, ranked = np.unique(e, return_inverse=True)
    shifted = ranked.astype(np.int64) + group * (len(values) + 1)
    covered = values[np.maximum.accumulate(shifted) - group * (len(values) + 1)]
    # Sorted by start within a group, what its earlier intervals cover beyond this one's start is [start, their
    # max end]: only the part past that counts.
    before = np.concatenate(([0], covered[:-1]))
    before = np.where(first, np.iinfo(np.int64).min, before)
    parts = np.maximum(0, e - np.maximum(s, before))
    return k[first], np.add.reduceat(parts, np.flatnonzero(first))
