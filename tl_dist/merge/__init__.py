"""Merging rank-local shards into one global trace: ``tl.merge_ranks`` and ``tl.load_merged``.

``build`` streams the merge a step at a time: ``sources`` reads shards (interned strings, numpy columns),
``steps`` runs one step's analysis over small modules -- ``match`` (joins and verdicts), ``members`` (one
step's collectives as arrays), ``clocks`` (offsets: same host, or causality bounds), ``timing`` (skew, wait,
stragglers). ``graph`` holds :class:`MergedTrace` (data and queries); ``api`` attaches its methods that delegate to
``views``, ``draw``, ``perfetto``, ``persist`` and the report.
Reference: ``docs/merge.md``.
"""

from .build import load_merged, merge_ranks
from .graph import MergedTrace
from .match import Finding, Joined

__all__ = ["Finding", "Joined", "MergedTrace", "load_merged", "merge_ranks"]
