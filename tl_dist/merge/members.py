"""One step's joined collectives as flat arrays, one row per (collective, member): what the clock estimate and the
timing analysis compute on, vectorised (a step of 1,024 ranks x 500 collectives is half a million rows)."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from .match import Joined


@dataclass
class Members:
    """Rows grouped by collective (its index in the step's ``joined``), in each its entries' order."""

    coll: np.ndarray  # int64: index of the joined collective
    rank: np.ndarray  # int64
    issue: np.ndarray  # int64, rank's clock
    complete: np.ndarray  # int64, rank's clock; -1 when never seen complete
    completed: np.ndarray  # bool: state completed with a completion time
    starts: np.ndarray  # int64: first row of each collective (len(joined) + 1 entries)

    @classmethod
    def of(cls, joined: list[Joined]) -> Members:
        sizes = np.fromiter((len(j.entries) for j in joined), dtype=np.int64, count=len(joined))
        entries = [e for j in joined for e in j.entries.values()]
        n = len(entries)

        def column(name: str) -> np.ndarray:
            return np.fromiter(map(attrgetter(name), entries), dtype=np.int64, count=n)

        complete = column("complete_ns")
        states = np.fromiter(map(attrgetter("state"), entries), dtype=object, count=n)
        starts = np.zeros(len(joined) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        return cls(
            np.repeat(np.arange(len(joined), dtype=np.int64), sizes),
            column("rank"),
            column("issue_ns"),
            complete,
            (states == "completed") & (complete >= 0),
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
