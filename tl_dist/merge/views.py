"""Tables and the text summary of a :class:`~tl_dist.merge.graph.MergedTrace`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..schema import OP_FIELDS
from ..views.summary import NO_MODULE

if TYPE_CHECKING:
    from .graph import MergedTrace

COLLECTIVE_COLUMNS = (
    "step",
    "group",
    "group_name",
    "seq",
    "func",
    "verdict",
    "ranks",
    "missing",
    "absent",
    "dtype",
    "bytes",
    "start_ns",
    "skew_ns",
    "duration_ns",
    "last_rank",
    "label",
    "module",
    "source",
    "detail",
)


def collectives_frame(g: MergedTrace) -> Any:
    """One row per joined collective (columns: ``COLLECTIVE_COLUMNS``); times aligned, ns."""
    import pandas as pd

    rows = []
    for j, t in zip(g.joined, g.timings):
        entries = list(j.entries.values())
        first = entries[0]
        rows.append(
            (
                j.step,
                j.group,
                j.group_name,
                j.seq,
                j.func,
                j.verdict,
                tuple(sorted(j.entries)),
                j.missing,
                j.absent,
                "/".join(sorted({e.dtype for e in entries})),
                max(e.nbytes for e in entries),
                t["start_ns"],
                t["skew_ns"],
                t["duration_ns"],
                t["last_rank"],
                first.label,
                first.module,
                first.source,
                j.detail,
            )
        )
    frame = pd.DataFrame(rows, columns=list(COLLECTIVE_COLUMNS))
    for name in ("group_name", "func", "verdict", "dtype"):
        frame[name] = pd.Categorical(frame[name])
    return frame


def ops_frame(g: MergedTrace) -> Any:
    """Every op of every (step, rank) with ``step``, ``rank`` and ``aligned_start_ns`` in front."""
    import pandas as pd

    frames = []
    for (step, rank), trace in sorted(g.traces().items()):
        frame = trace.to_pandas()
        frame.insert(0, "aligned_start_ns", frame["start_ns"] - g.offsets.get(rank, 0))
        frame.insert(0, "rank", rank)
        frame.insert(0, "step", step)
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


def summary(g: MergedTrace) -> str:
    """The text report ``g.summary()`` returns."""
    lines = [
        f"tl_dist merged trace: {len(g.ranks)}/{g.world_size} ranks, steps {g.steps}, "
        f"{sum(len(t) for t in g.tables().values())} ops, {len(g.joined)} collectives",
    ]
    verdicts: dict[str, int] = {}
    for j in g.joined:
        verdicts[j.verdict] = verdicts.get(j.verdict, 0) + 1
    lines.append("collectives by verdict: " + ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())))
    off = {r: o for r, o in g.offsets.items() if o}
    lines.append(
        "clock offsets (ms vs lowest rank): "
        + (", ".join(f"rank {r} {_ms(o)}" for r, o in sorted(off.items())) if off else "none")
    )
    if g.incomplete:
        lines.append(f"incomplete shards (step, rank): {sorted(g.incomplete)}")
    lines.append("")
    if g.findings:
        lines.append(f"FINDINGS ({len(g.findings)}):")
        for f in g.findings:
            lines.append(f"  {'' if f.primary else '(consequence) '}{f}")
            for r, w in f.where.items():
                if w.get("absent"):
                    last = w.get("last_label")
                    lines.append(
                        f"      rank {r}: did not issue it"
                        + (
                            f"; last op {last} in {w.get('last_module') or NO_MODULE} ({w.get('last_source')})"
                            if last
                            else ""
                        )
                    )
                else:
                    lines.append(
                        f"      rank {r}: {w['label']} seq {w['seq']} {w['state']} in "
                        f"{w['module'] or NO_MODULE} ({w['source'] or 'no source'})"
                    )
    else:
        lines.append("no findings: every collective matched on every rank")
    lines.append("")
    strag = g.stragglers()
    if len(strag):
        lines.append("stragglers (others' wait caused, ms; own wait, ms):")
        for step, frame in strag.groupby("step", sort=True):
            top = ", ".join(
                f"rank {int(r.rank)} {_ms(r.caused_wait_ns)} ({_ms(r.wait_ns)})"
                for r in frame.head(4).itertuples()
            )
            lines.append(f"  step {step}: {top}")
    tb = g.time_breakdown()
    if len(tb):
        lines.append("time per rank (ms): compute / communication / waiting / window")
        for r in tb.itertuples():
            lines.append(
                f"  step {r.step} rank {r.rank}: {_ms(r.compute_ns)} / {_ms(r.comm_ns)} / {_ms(r.wait_ns)} / "
                f"{_ms(r.window_ns)}  ({r.ops} ops)"
            )
    return "\n".join(lines)
