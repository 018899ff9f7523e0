"""Merging rank-local shards into one global trace: ``tl.merge_ranks`` and ``tl.load_merged``.

``graph`` streams the merge a step at a time: ``sources`` reads shards (interned strings, numpy columns),
``steps`` runs one step's analysis over small modules -- ``match`` (joins and verdicts), ``members`` (one
step's collectives as arrays), ``clocks`` (offsets: same host, or causality bounds), ``timing`` (skew, wait,
stragglers). The :class:`MergedTrace` facade delegates views to ``views``, ``draw``, ``perfetto``, ``persist``.
Reference: ``docs/merge.md``.
"""

from .graph import MergedTrace, load_merged, merge_ranks
from .match import Finding, Joined

__all__ = ["Finding", "Joined", "MergedTrace", "load_merged", "merge_ranks"]
