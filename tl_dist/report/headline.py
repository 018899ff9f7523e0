"""The report's headline: the answer for the slowest step -- which rank, which phase, which module, how long.

Example:
    >>> headline(Run.of(tl.merge_ranks("runs/job42")))["rank"]
"""

from __future__ import annotations

from typing import Any

from ..step_facts import straggler
from .data import Run


def headline(run: Run) -> dict[str, Any] | None:
    """The answer for the slowest step (largest window on any rank): which rank (the straggler, as
    :func:`tl_dist.step_facts.straggler` defines it, else the rank with that window), how long (the others'
    wait for it, else its window), which phase (that rank's phase with the most op time, or its idle time
    before its first op when longer) and which module (of the collective the others waited at longest,
    else of that rank's slowest op). None without windows."""
    rows = run.breakdown()
    if not rows:
        return None
    worst = max(rows, key=lambda b: (b["window_ns"], -b["step"], -b["rank"]))
    step = worst["step"]
    late = straggler([s for s in run.stragglers() if s["step"] == step])
    rank, module, collective = worst["rank"], "", ""
    if late is not None:
        rank = late[0]
        waited = [c for c in run.collectives() if c["step"] == step and c["last_rank"] == rank]
        if waited:
            c = max(waited, key=lambda c: c["skew_ns"])
            module, collective = c["module"], c["func"]
    if not module:
        mine = [o for o in run.slowest_ops() if (o["step"], o["rank"]) == (step, rank)]
        module = mine[0]["module"] if mine else ""
    facts = next(b for b in rows if (b["step"], b["rank"]) == (step, rank))
    phases = run.scan().phase_ns.get((step, rank), {})
    phase, phase_ns = max(phases.items(), key=lambda kv: kv[1], default=("", 0))
    if facts["idle_before_ns"] > phase_ns:
        phase, phase_ns = "idle before its first op", facts["idle_before_ns"]
    return {
        "step": step,
        "window_ns": worst["window_ns"],
        "rank": rank,
        "straggler": late is not None,
        "wait_ns": late[1] if late is not None else 0,
        "collective": collective,
        "module": module,
        "phase": phase,
        "phase_ns": phase_ns,
    }
