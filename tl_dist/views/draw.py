"""Render a trace's op graph with Graphviz: one node per op, data edges, nested clusters per module call.

The DOT text is built directly as a string (one pass over the ops and module calls) and laid out by Graphviz's
``dot`` through the ``graphviz`` package; building it stays in the milliseconds for thousands of ops, so the
layout itself is what costs.

Example:
    >>> trace.draw("graph.svg")                      # every op, or collapsed modules past ~300 nodes
    >>> trace.draw("top.png", format="png", depth=1)  # module calls below depth 1 as one node each
    >>> trace.draw("fwd.svg", phase="forward", show_all=True)  # forward ops only, views included
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import graphviz

from ..errors import MissingToolError, TlDistError
from .graph import GraphPlan, Node, check_plan_options, plan_all
from .rolled import roll

if TYPE_CHECKING:
    from ..trace import Trace

_KIND_COLOURS = {
    "compute": "#dbe9f6",
    "view": "#eeeeee",
    "collective": "#fbd9a6",
    "factory": "#e3f1dc",
    "compiled": "#d9d2f3",
    "other": "#ffffff",
}
_PHASE_BORDER = {"forward": "#555555", "backward": "#b35900", "optimizer": "#6a1b9a", "recompute": "#2e7d32"}
_BORDER_NAMES = {"backward": "orange", "optimizer": "purple", "recompute": "green"}
_NODE_STYLE = {
    "module": 'shape=box3d fillcolor="#f3e3f7"',
    "params": 'shape=note fillcolor="#fff8dc" fontsize=9',
    "input": 'shape=oval fillcolor="#c8e6c9"',
    "output": 'shape=oval fillcolor="#ffcdd2"',
}
HEADER = (
    '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=10 margin="0.08,0.03"]',
    '  edge [arrowsize=0.6 color="#555555"]',
)


def quote(text: str) -> str:
    """A DOT double-quoted string: backslash and quote escaped; newlines become DOT's centred line break."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node_line(node: Node, prefix: str) -> str:
    if node.kind == "op":
        style = f"fillcolor={quote(_KIND_COLOURS.get(node.op_kind, '#ffffff'))}"
        if node.phase != "forward":
            style += f" color={quote(_PHASE_BORDER.get(node.phase, '#555555'))} penwidth=1.5"
    else:
        style = _NODE_STYLE[node.kind]
    return f"{prefix}{node.name} [label={quote(node.text)} {style}]"


def plan_lines(plan: GraphPlan, *, prefix: str = "", indent: str = "  ") -> list[str]:
    """The DOT statements of ``plan`` (nodes in nested module clusters, then edges), every name prefixed."""
    by_cluster: dict[int, list[Node]] = {}
    for node in plan.nodes.values():
        by_cluster.setdefault(node.cluster, []).append(node)
    children: dict[int, list[int]] = {}
    for row in plan.clusters:
        children.setdefault(plan.cluster_parent[row], []).append(row)
    out = [indent + _node_line(n, prefix) for n in by_cluster.get(-1, ())]

    def emit(row: int, pad: str) -> None:
        out.append(f"{pad}subgraph cluster_{prefix}m{row} {{")
        out.append(f'{pad}  label={quote(plan.titles[row])} style="rounded" color="#7a7a7a" fontsize=10')
        out.extend(f"{pad}  {_node_line(n, prefix)}" for n in by_cluster.get(row, ()))
        for child in children.get(row, ()):
            emit(child, pad + "  ")
        out.append(f"{pad}}}")

    for row in children.get(-1, ()):
        emit(row, indent)
    for a, b in plan.edges:
        style = _edge_style(plan, a, b)
        # Data flowing both ways (forward and backward through a collapsed call) as one edge; not a rolled loop's
        # edge into the next iteration, which is drawn on its own.
        if (b, a) in plan.edges and a != b and not ({(a, b), (b, a)} & plan.dashed):
            if a < b:
                out.append(f"{indent}{prefix}{a} -> {prefix}{b} [dir=both{style}]")
            continue
        out.append(f"{indent}{prefix}{a} -> {prefix}{b}" + (f" [{style.lstrip()}]" if style else ""))
    return out


def _edge_style(plan: GraphPlan, a: str, b: str) -> str:
    """Attributes of a rolled loop's edges: how many edges it stands for, dashed when it feeds the next iteration;
    and of an edge out of a backward collective (DDP's bucket all_reduce, FSDP's reduce_scatter), which does not
    rank the layout: drawn in its owner module's cluster, it would otherwise pull every module whose gradients it
    writes back beside that cluster (the demo's DDP step: 4,400 px wide instead of 3,300)."""
    style = ""
    if (a, b) in plan.edge_labels:
        style += f" label={quote(plan.edge_labels[(a, b)])} fontsize=9"
    if (a, b) in plan.dashed:
        style += " style=dashed constraint=false"
    else:
        node = plan.nodes.get(a)
        if node is not None and node.op_kind == "collective" and node.phase == "backward":
            style += " constraint=false"
    return style


def graph_source(
    trace: Trace,
    *,
    depth: int | str | None = "auto",
    phase: str | Sequence[str] | None = None,
    show_all: bool = False,
    rolled: bool = False,
) -> str:
    """The DOT source :func:`draw` lays out (see there for the options)."""
    plan, note = _plan(trace, depth, phase, show_all, rolled)
    return dot_document("trace", plan_lines(plan), note, newrank=True, phases=plan.phases_drawn)


def dot_document(name: str, body: list[str], note: str, *, newrank: bool, phases: Iterable[str] = ()) -> str:
    """A whole DOT graph: the shared header, ``body`` statements, and as the graph's title ``note`` and the
    border colours of the ``phases`` drawn other than forward."""
    graph = '  graph [rankdir=TB fontname="Helvetica" fontsize=11 nodesep=0.15 ranksep=0.35'
    graph += " newrank=true" if newrank else ""
    legend = [f"{colour} border: {p} op" for p, colour in _BORDER_NAMES.items() if p in phases]
    title = "\n".join(([note] if note else []) + ([", ".join(legend)] if legend else []))
    if title:
        graph += f" label={quote(title)} labelloc=t"
    return "\n".join([f"digraph {name} {{", graph + "]", *HEADER, *body, "}"]) + "\n"


def draw(
    trace: Trace,
    path: str | os.PathLike,
    *,
    format: str = "svg",
    depth: int | str | None = "auto",
    phase: str | Sequence[str] | None = None,
    show_all: bool = False,
    rolled: bool = False,
) -> str:
    """Lay out ``trace``'s op graph with Graphviz and write it to exactly ``path``.

    One node per op (label, output shape, duration; filled by kind, backward ops with an orange border and
    optimizer ops a purple one), an edge from each op to every op that read its output, ops grouped in nested
    clusters, one per module call (backward and optimizer ops in the call of the forward op or the parameter
    they belong to), and nodes for the inputs, the parameters each module read, and the outputs.

    Args:
        trace: the trace to draw.
        path: the file to write, as given (no extension is added).
        format: any Graphviz output format: ``svg``, ``png``, ``pdf``, ``dot``, ...
        depth: ``"auto"`` draws every op while that stays within ~300 nodes, else the deepest module depth
            that does (it warns saying which). ``None`` draws every op. With ``depth=d``, each module call
            nested deeper than ``d`` (the outermost call has depth 0) collapses, with its backward and optimizer
            ops, into one node showing its op count, output shape, time and FLOPs.
        phase: only ops of this phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or a list of them.
        show_all: also draw bookkeeping ops (views, ``detach``, allocations, profiler markers), which are
            otherwise left out with the edges through them kept.
        rolled: draw each loop that repeats the same ops in the same modules (an RNN cell, a Python loop over
            one block) once, its edges labelled with iteration counts (``×4``) and the edges into the next
            iteration dashed (see :mod:`tl_dist.views.rolled`). Default False: every iteration.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: an option is not one of the values above.
        MissingToolError: Graphviz's ``dot`` executable is not installed (nothing is written).
        TlDistError: ``dot`` failed.

    Example:
        >>> trace = tl.trace(model, x)
        >>> trace.draw("out/graph.svg", depth=2)
        'out/graph.svg'
    """
    check_format(format)
    plan, note = _plan(trace, depth, phase, show_all, rolled)
    if note:
        warnings.warn(f"trace.draw: {note}", DrawNote, stacklevel=3)
    source = dot_document("trace", plan_lines(plan), note, newrank=True, phases=plan.phases_drawn)
    return render(source, path, format=format)


def _plan(trace: Trace, depth: Any, phase: Any, show_all: Any, rolled: Any) -> tuple[GraphPlan, str]:
    phases = check_plan_options(depth, phase, show_all)
    if not isinstance(rolled, bool):
        raise ValueError(f"rolled must be a bool, got {rolled!r}")
    (plan,), note = plan_all([trace], depth=depth, phases=phases, show_all=show_all)
    return (roll(plan, trace) if rolled else plan), note


class DrawNote(UserWarning):
    """What a drawing chose on its own (the automatic depth) or could not help (a graph still too large)."""


GRAPHVIZ_HINT = "apt-get install graphviz, brew install graphviz or conda install graphviz"


def check_format(format: str) -> None:
    """A Graphviz output format, or ValueError naming ``format``."""
    if not isinstance(format, str) or format not in graphviz.FORMATS:
        raise ValueError(
            f"format must be a Graphviz output format such as 'svg', 'png' or 'pdf'; got {format!r} "
            f"(known: {', '.join(sorted(graphviz.FORMATS))})"
        )


def render(source: str, path: str | os.PathLike, *, format: str) -> str:
    """Lay out DOT ``source`` with Graphviz's ``dot`` and write exactly ``path``; returns ``path``.

    Raises:
        MissingToolError: ``dot`` is not on PATH (nothing is written).
        TlDistError: ``dot`` failed.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    try:
        data = graphviz.pipe("dot", format, source.encode())
    except graphviz.ExecutableNotFound as exc:
        raise MissingToolError(
            f"Graphviz's `dot` executable was not found on PATH; drawing needs it. Install Graphviz "
            f"({GRAPHVIZ_HINT}) and retry."
        ) from exc
    except graphviz.CalledProcessError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise TlDistError(f"Graphviz `dot` failed to render {path!r} as {format}: {stderr}") from exc
    with open(path, "wb") as f:
        f.write(data)
    return path
