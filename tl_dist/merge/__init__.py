"""Merging rank-local shards into one global trace: ``tl.merge_ranks`` and ``tl.load_merged``.

Analyzers are small modules the :class:`MergedTrace` facade delegates to: ``match`` (joins and verdicts),
``clocks`` (offsets), ``timing`` (skew, wait, stragglers), ``views``, ``draw``, ``perfetto``, ``persist``.
Reference: ``docs/merge.md``.
"""

from .graph import MergedTrace, load_merged, merge_ranks
from .match import Finding, Joined

__all__ = ["Finding", "Joined", "MergedTrace", "load_merged", "merge_ranks"]
