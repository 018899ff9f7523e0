"""The order modes run in within each round of a side-by-side benchmark.

A step leaves the next one something (heap layout, caches, the GC's counts, a freed trace), so a mode's time
depends on the mode before it. Rotating a fixed list (a b c, b c a, c a b) puts each mode after the same
predecessor in most rounds: in ``bench_telemetry.py`` the window followed the floor 4 rounds in 5, and the same
code read 1.061x or 1.072x of the floor by where it stood in the list. These orders are carryover-balanced
(a Williams design): over one cycle each mode runs first equally often and follows every other mode equally
often (once for an even number of modes, twice for an odd one, over twice as many orders).
"""

from __future__ import annotations


def balanced_orders(modes: list[str] | tuple[str, ...]) -> list[list[str]]:
    """One cycle of orders for ``modes``: ``len(modes)`` of them (twice that for an odd count).

    Example:
        >>> balanced_orders(["a", "b", "c", "d"])
        [['a', 'b', 'd', 'c'], ['b', 'c', 'a', 'd'], ['c', 'd', 'b', 'a'], ['d', 'a', 'c', 'b']]
    """
    n = len(modes)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [[(k + shift) % n for k in first] for shift in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[modes[k] for k in row] for row in rows]
