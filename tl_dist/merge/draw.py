"""Graphviz drawing of a merged trace: each (step, rank)'s graph, planned as ``trace.draw`` plans one (module
collapsing, bookkeeping ops left out, inputs, parameters and outputs), in its own cluster, and every joined
collective as an edge across the rank clusters, red when its verdict is not ``matched``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SelectionError
from ..views.draw import DrawNote, check_format, dot_document, plan_lines, quote, render
from ..views.graph import check_plan_options, plan_all

if TYPE_CHECKING:
    from .graph import MergedTrace


def _wanted(name: str, value: Any, known: list[int]) -> list[int]:
    if value is None:
        return known
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple, set)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"{name} must be None, an int or a list of ints; got {value!r}")
    unknown = sorted(set(values) - set(known))
    if unknown or not values:
        raise SelectionError(
            f"{name}={value!r}: no shard for {name} {unknown or values}; the run has {known}"
        )
    return sorted(set(values))


def merged_source(
    g: MergedTrace,
    *,
    depth: int | str | None = "auto",
    rank: int | Sequence[int] | None = None,
    step: int | Sequence[int] | None = None,
    phase: str | Sequence[str] | None = None,
    show_all: bool = False,
) -> str:
    """The DOT source :meth:`MergedTrace.draw` lays out (see there for the options)."""
    return _source(g, depth=depth, rank=rank, step=step, phase=phase, show_all=show_all)[0]


def _source(
    g: MergedTrace, *, depth: Any, rank: Any, step: Any, phase: Any, show_all: Any
) -> tuple[str, str]:
    phases = check_plan_options(depth, phase, show_all)
    ranks = set(_wanted("rank", rank, g.ranks))
    steps = _wanted("step", step, sorted({s for s, _ in g.keys()}))
    keys = [key for key in g.keys() if key[0] in steps and key[1] in ranks]
    traces = [g.rank(r, step=s) for s, r in keys]
    plans, note = plan_all(traces, depth=depth, phases=phases, show_all=show_all)
    body: list[str] = []
    node_of: dict[tuple[int, int], list[str | None]] = {}
    for (s, r), plan in zip(keys, plans):
        prefix = f"s{s}r{r}_"
        node_of[(s, r)] = [None if n is None else prefix + n for n in plan.node_of_op]
        body.append(f"  subgraph cluster_{prefix}rank {{")
        body.append(f'    label={quote(f"rank {r} step {s}")} style="bold" color="#1f4e79" fontsize=12')
        body.extend(plan_lines(plan, prefix=prefix, indent="    "))
        body.append("  }")
    drawn_steps = sorted({s for s, _ in keys})
    for j in (j for s in drawn_steps for j in g.joined_step(s)):
        nodes = []
        for r, e in sorted(j.entries.items()):
            ops = node_of.get((j.step, r))
            if ops is not None and 0 <= e.op < len(ops) and ops[e.op] is not None:
                nodes.append(ops[e.op])
        colour = "#2e7d32" if j.verdict == "matched" else "#c62828"
        label = f"{j.func} #{j.seq}" + ("" if j.verdict == "matched" else f" {j.verdict}")
        for a, b in zip(nodes, nodes[1:]):
            body.append(
                f"  {a} -> {b} [dir=none constraint=false style=dashed penwidth=1.5 color={quote(colour)} "
                f"tooltip={quote(label)}]"
            )
    # No newrank and no edge labels: with cross-cluster constraint=false edges either makes dot fail
    # ("trouble in init_rank", "lost edge") on real multi-step graphs.
    phases = set().union(*(p.phases_drawn for p in plans))
    return dot_document("merged", body, note, newrank=False, phases=phases), note


def draw(
    g: MergedTrace,
    path: str | os.PathLike,
    *,
    format: str = "svg",
    depth: int | str | None = "auto",
    rank: int | Sequence[int] | None = None,
    step: int | Sequence[int] | None = None,
    phase: str | Sequence[str] | None = None,
    show_all: bool = False,
) -> str:
    """Lay out :func:`merged_source` with Graphviz's ``dot`` and write ``path``. Returns ``path``."""
    check_format(format)
    source, note = _source(g, depth=depth, rank=rank, step=step, phase=phase, show_all=show_all)
    if note:
        warnings.warn(f"g.draw: {note}", DrawNote, stacklevel=3)
    return render(source, path, format=format)
