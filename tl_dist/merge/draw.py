"""Graphviz drawing of a merged trace: each rank's graph (as ``trace.draw`` lays it out, module collapsing
included) in its own cluster, and every joined collective as an edge across the rank clusters, red when its
verdict is not ``matched``."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from ..views.draw import check_draw_options, graph_source, render

if TYPE_CHECKING:
    from .graph import MergedTrace

_QUOTED = re.compile(r'("(?:[^"\\]|\\.)*")')
_IDENT = re.compile(r"\b(op\d+|m\d+|cluster_m\d+)\b")
_DEFINED = re.compile(r"^\s*(op\d+|m\d+) \[")


def _prefixed(source: str, prefix: str) -> tuple[list[str], set[str]]:
    """The body of one rank's DOT source with every node and cluster name prefixed; and the node names."""
    lines = source.strip().splitlines()[1:-1]  # drop "digraph trace {" and "}"
    body, defined = [], set()
    for line in lines:
        if line.lstrip().startswith(("graph [", "node [", "edge [")):
            continue
        m = _DEFINED.match(line)
        if m:
            defined.add(m.group(1))
        parts = _QUOTED.split(line)
        parts[::2] = [
            _IDENT.sub(
                lambda mm: (
                    f"{prefix}{mm.group(1)}"
                    if not mm.group(1).startswith("cluster_")
                    else f"cluster_{prefix}{mm.group(1)[8:]}"
                ),
                p,
            )
            for p in parts[::2]
        ]
        body.append("  " + "".join(parts))
    return body, defined


def _node_of(op: int, defined: set[str], trace: object) -> str | None:
    if f"op{op}" in defined:
        return f"op{op}"
    table = trace.module_table  # type: ignore[attr-defined]
    for row, (first, end) in enumerate(zip(table["first_op"], table["end_op"])):
        if first <= op < end and f"m{row}" in defined:
            return f"m{row}"
    return None


def merged_source(g: MergedTrace, *, depth: int | None = 1) -> str:
    """The DOT source :meth:`MergedTrace.draw` lays out."""
    out = [
        "digraph merged {",
        # No newrank and no edge labels: with cross-cluster constraint=false edges either makes dot fail
        # ("trouble in init_rank", "lost edge") on real multi-step graphs.
        '  graph [rankdir=TB fontname="Helvetica" fontsize=11]',
        '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=10 margin="0.08,0.03"]',
        '  edge [arrowsize=0.6 color="#555555"]',
    ]
    names: dict[tuple[int, int], tuple[str, set[str]]] = {}
    for (step, rank), trace in sorted(g.traces().items()):
        prefix = f"s{step}r{rank}_"
        body, defined = _prefixed(graph_source(trace, depth=depth), prefix)
        names[(step, rank)] = (prefix, defined)
        out.append(f"  subgraph cluster_{prefix}rank {{")
        out.append(f'    label="rank {rank} step {step}" style="bold" color="#1f4e79" fontsize=12')
        out.extend("  " + line for line in body)
        out.append("  }")
    traces = g.traces()
    for j in g.joined:
        members = sorted(j.entries.items())
        nodes = []
        for rank, e in members:
            prefix, defined = names[(j.step, rank)]
            node = _node_of(e.op, defined, traces[(j.step, rank)])
            if node is not None:
                nodes.append(prefix + node)
        colour = "#2e7d32" if j.verdict == "matched" else "#c62828"
        label = f"{j.func} #{j.seq}" + ("" if j.verdict == "matched" else f" {j.verdict}")
        for a, b in zip(nodes, nodes[1:]):
            out.append(
                f'  {a} -> {b} [dir=none constraint=false style=dashed penwidth=1.5 color="{colour}" '
                f'tooltip="{label}"]'
            )
    out.append("}")
    return "\n".join(out) + "\n"


def draw(g: MergedTrace, path: str | os.PathLike, *, format: str = "svg", depth: int | None = 1) -> str:
    """Lay out :func:`merged_source` with Graphviz's ``dot`` and write ``path`` (see ``trace.draw`` for
    ``format`` and ``depth``). Returns ``path``."""
    check_draw_options(format, depth)
    return render(merged_source(g, depth=depth), path, format=format)
