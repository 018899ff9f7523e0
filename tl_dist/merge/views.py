"""Tables and the text summary of a :class:`~tl_dist.merge.graph.MergedTrace`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import SelectionError
from ..schema import OP_FIELDS, OUTSIDE
from ..step_facts import straggler
from ..views.summary import timing_caveat
from .steps import COLLECTIVE_COLUMNS, collective_row  # noqa: F401 (moved to steps; old path)

if TYPE_CHECKING:
    from .graph import MergedTrace


def collectives_frame(rows: list[tuple]) -> Any:
    """One row per joined collective (columns: ``COLLECTIVE_COLUMNS``); times aligned, ns."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))
    for name in ("group_name", "func", "verdict", "dtype"):
        frame[name] = pd.Categorical(frame[name])
    return frame


CLOCK_COLUMNS = ("step", "rank", "host", "offset_ns", "uncertainty_ns", "method", "collectives", "reference")


def clocks_frame(g: MergedTrace) -> Any:
    """``g.clocks``: per (step, rank) its clock offset against ``reference`` and how it was found."""
    import pandas as pd

    rows = []
    for step, sol in sorted(g.clock_solutions.items()):
        for r in sorted(sol.offsets):
            unc = sol.uncertainty[r]
            rows.append(
                (
                    step,
                    r,
                    g.metadata(step, r).get("host", ""),
                    sol.offsets[r],
                    pd.NA if unc is None else unc,
                    sol.method[r],
                    sol.collectives.get(r, 0),
                    sol.reference[r],
                )
            )
    frame = pd.DataFrame(rows, columns=list(CLOCK_COLUMNS))
    frame["uncertainty_ns"] = frame["uncertainty_ns"].astype("Int64")
    frame["method"] = pd.Categorical(frame["method"], categories=["same-host", "estimated", "none"])
    return frame


def ops_frame(g: MergedTrace, step: int | None = None) -> Any:
    """Every op of every (step, rank) (of ``step`` only, when given) with ``step``, ``rank`` and
    ``aligned_start_ns`` in front."""
    import pandas as pd

    if step is not None and step not in g.steps:
        raise SelectionError(f"step: {step!r} is not a step of this merge; steps: {g.steps}")
    frames = []
    offsets = g.offsets
    for (at, rank), trace in g.iter_traces(step=step):
        frame = trace.to_pandas()
        frame.insert(0, "aligned_start_ns", frame["start_ns"] - offsets.get((at, rank), 0))
        frame.insert(0, "rank", rank)
        frame.insert(0, "step", at)
        frames.append(frame)
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    for f in OP_FIELDS:  # concat turns per-rank categoricals with different categories into objects
        if f.kind == "str":
            out[f.name] = out[f.name].astype("category")
    return out


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


_MAX_LINES = 8  # per finding's ranks, per step's clocks: more are counted, not listed


def _clock_lines(g: MergedTrace) -> list[str]:
    clocks = g.clocks
    if not len(clocks):
        return ["clocks: no ranks"]
    lowest = clocks.groupby("step")["rank"].transform("min")
    unlinked = clocks[
        (clocks.method == "same-host")
        & (clocks["reference"] != lowest)
        & (clocks["rank"] == clocks["reference"])
    ]
    if (clocks.method == "same-host").all() and not len(unlinked):
        return ["clocks: every rank on its reference's clock (same host and boot): offsets 0 by construction"]
    lines = ["clocks (offset vs reference rank, ms, +- uncertainty; method, collectives used):"]
    for step, frame in unlinked.groupby("step", sort=True):
        listed = ", ".join(str(r) for r in frame["rank"].head(_MAX_LINES))
        more = len(frame) - _MAX_LINES
        lines.append(
            f"  step {step}: no collective links the clock of rank(s) {listed}"
            + (f", ... {more} more" if more > 0 else "")
            + " to the others: each is its own reference, not aligned"
        )
    for step, frame in clocks[clocks.method != "same-host"].groupby("step", sort=True):
        frame = frame.sort_values("uncertainty_ns", ascending=False, na_position="first")
        parts = [
            f"rank {r.rank} "
            + (
                f"{_ms(r.offset_ns)} +- {_ms(r.uncertainty_ns)} vs rank {r.reference} ({r.collectives})"
                if r.method == "estimated"
                else "none (no collective bounds it both ways)"
            )
            for r in frame.head(_MAX_LINES).itertuples()
        ]
        more = len(frame) - _MAX_LINES
        lines.append(f"  step {step}: " + ", ".join(parts) + (f", ... {more} more" if more > 0 else ""))
    violation = {s: sol for s, sol in g.clock_solutions.items() if sol.violation_ns}
    for step, sol in sorted(violation.items()):
        v = sol.violation_ns
        if sol.unresolved:
            lines.append(
                f"  step {step}: recorded times contradicted causality by more than {_ms(v)} ms (a clock stepped?); "
                "too much to widen: no clock estimated"
            )
            continue
        lines.append(
            f"  step {step}: recorded times contradicted causality by {_ms(v)} ms (a clock stepped?); "
            "uncertainties widened by that much"
        )
    return lines


def _where_lines(f: Any) -> list[str]:
    if not f.group:  # rank-level findings say it all in their message
        return []
    lines = []
    for r, w in list(f.where.items())[:_MAX_LINES]:
        if w.get("absent"):
            last = w.get("last_label")
            line = f"      rank {r}: did not issue it" + (
                f"; last op {last} in {w.get('last_module') or OUTSIDE} ({w.get('last_source')})"
                if last
                else ""
            )
        else:
            line = (
                f"      rank {r}: {w['label']} seq {w['seq']} {w['state']} in "
                f"{w['module'] or OUTSIDE} ({w['source'] or 'no source'})"
            )
        if w.get("stack_at"):
            line += f"; thread at {w['stack_at']}"
        lines.append(line)
    if len(f.where) > _MAX_LINES:
        lines.append(f"      ... {len(f.where) - _MAX_LINES} more ranks")
    return lines


def summary(g: MergedTrace) -> str:
    """The text report ``g.summary()`` returns."""
    tb = g.time_breakdown()
    lines = [
        f"tl_dist merged trace: {len(g.ranks)}/{g.world_size} ranks, steps {g.steps}, "
        f"{int(tb.ops.sum()) if len(tb) else 0} ops, {len(g.collectives)} collectives",
    ]
    caveats: dict[str, set[int]] = {}  # the same caveat on many ranks is one line
    for step, rank in g.keys():
        caveat = timing_caveat(g.metadata(step, rank))
        if caveat:
            caveats.setdefault(caveat, set()).add(rank)
    lines.extend(f"rank(s) {sorted(ranks)}: {caveat}" for caveat, ranks in caveats.items())
    verdicts = g.collectives.verdict.value_counts()
    lines.append("collectives by verdict: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items()) if v))
    lines.extend(_clock_lines(g))
    if g.incomplete:
        lines.append(f"incomplete shards (step, rank): {sorted(g.incomplete)}")
    lines.append("")
    if g.findings:
        lines.append(f"FINDINGS ({len(g.findings)}):")
        for f in g.findings:
            lines.append(f"  {'' if f.primary else '(consequence) '}{f}")
            lines.extend(_where_lines(f))
    else:
        lines.append("no findings: every collective matched on every rank")
    lines.append("")
    strag = g.stragglers()
    blamed = strag[strag.caused_wait_ns > 0]
    if len(blamed):
        lines.append("stragglers (others' wait caused, ms; own wait, ms):")
        for step, frame in blamed.groupby("step", sort=True):
            rank, caused = straggler(frame.to_dict("records"))
            top = ", ".join(
                f"rank {int(r.rank)} {_ms(r.caused_wait_ns)} ({_ms(r.wait_ns)})"
                for r in frame.head(4).itertuples()
            )
            lines.append(f"  step {step}: straggler rank {rank}, the others waited {_ms(caused)} ms; {top}")
    else:
        lines.append("stragglers: none beyond the clock uncertainty")
    if len(strag):
        for step, ns in strag.groupby("step").uncertain_wait_ns.sum().items():
            if ns:
                lines.append(
                    f"  step {step}: {_ms(ns)} ms of waits within the clock uncertainty, blamed on nobody"
                )
    if len(tb):
        lines.append("time per rank (ms): compute / communication / waiting / window (idle before first op)")
        if len(tb) <= 4 * _MAX_LINES:
            for r in tb.itertuples():
                lines.append(
                    f"  step {r.step} rank {r.rank}: {_ms(r.compute_ns)} / {_ms(r.comm_ns)} / "
                    f"{_ms(r.wait_ns)} / {_ms(r.window_ns)} ({_ms(r.idle_before_ns)})  ({r.ops} ops)"
                )
        else:
            for step, frame in tb.groupby("step", sort=True):
                cols = ("compute_ns", "comm_ns", "wait_ns", "window_ns")
                med = " / ".join(_ms(frame[c].median()) for c in cols)
                top = frame.loc[frame.wait_ns.idxmax()]
                lines.append(
                    f"  step {step}, median of {len(frame)} ranks: {med}; most waiting: rank {int(top['rank'])} "
                    f"{_ms(top['wait_ns'])}"
                )
    return "\n".join(lines)
