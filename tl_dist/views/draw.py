"""Render a trace's op graph with Graphviz: one node per op, data edges, nested clusters per module call.

The DOT text is built directly as a string (one pass over the ops and module calls) and laid out by Graphviz's
``dot`` through the ``graphviz`` package; building it stays in the milliseconds for thousands of ops, so the
layout itself is what costs.

Example:
    >>> trace.draw("graph.svg")                      # every op, clusters for every module call
    >>> trace.draw("top.png", format="png", depth=1)  # module calls below depth 1 as one node each
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import graphviz

from ..errors import MissingToolError, TlDistError
from .summary import format_count, format_ns, format_shape

if TYPE_CHECKING:
    from ..trace import Trace

_KIND_COLOURS = {
    "compute": "#dbe9f6",
    "view": "#eeeeee",
    "collective": "#fbd9a6",
    "factory": "#e3f1dc",
    "other": "#ffffff",
}
_COLLAPSED_COLOUR = "#f3e3f7"


def _quote(text: str) -> str:
    # A DOT double-quoted string: backslash and quote escaped; newlines become DOT's centred line break.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _call_title(address: str, mtype: str, call: int) -> str:
    name = address or "<root>"
    return f"{name} ({mtype})" + (f" call {call}" if call else "")


def graph_source(trace: Trace, *, depth: int | None = None) -> str:
    """The DOT source :func:`draw` lays out (see there for ``depth``)."""
    cols = trace.columns
    table = trace.module_table
    n_ops = len(trace)
    n_calls = len(table["address"])
    parent_of = table["parent"]
    call_depth = table["depth"]
    first_op, end_op = table["first_op"], table["end_op"]

    # Which call each op's innermost *visible* call is, and which calls collapse into one node. A call deeper
    # than `depth` whose parent is visible becomes a node; its descendants vanish inside it.
    collapsed: dict[int, None] = {}
    visible_call = list(range(n_calls))
    for row in range(n_calls):  # rows are in pre-order: a parent's row precedes its children's
        parent = parent_of[row]
        if parent >= 0 and (parent in collapsed or visible_call[parent] != parent):
            visible_call[row] = visible_call[parent]
        elif depth is not None and call_depth[row] > depth:
            collapsed[row] = None
    op_call = cols["module_call"]
    node_of = [0] * n_ops  # op index -> node id (an op's own, or its collapsed call's)
    members: dict[int, list[str]] = {}  # visible call row -> node lines directly inside it
    top_level: list[str] = []
    durations = cols["duration_ns"]
    for i in range(n_ops):
        call = op_call[i]
        visible = visible_call[call] if call >= 0 else -1
        if visible in collapsed:
            node_of[i] = -1 - visible
            continue
        node_of[i] = i
        shapes = cols["out_shapes"][i]
        text = f"{cols['label'][i]}\n{format_shape(tuple(shapes[0]) if shapes else None)}\n{format_ns(durations[i])}"
        line = (
            f"op{i} [label={_quote(text)} fillcolor={_quote(_KIND_COLOURS.get(cols['kind'][i], '#ffffff'))}]"
        )
        (top_level if visible < 0 else members.setdefault(visible, [])).append(line)
    for row in collapsed:
        first, end = first_op[row], end_op[row]
        if first == end:  # a call that ran no op (Dropout in eval, Identity) has nothing to stand for
            continue
        flops = sum(cols["flops"][first:end])
        outs = [op for op in table["out_ops"][row] if op >= 0]
        shapes = cols["out_shapes"][outs[0]] if outs else ()
        shape = format_shape(tuple(shapes[0]) if shapes else None)
        text = (
            f"{_call_title(table['address'][row], table['type'][row], table['call'][row])}\n"
            f"{end - first} ops, {shape}\n{format_ns(sum(durations[first:end]))}, {format_count(flops, 'FLOP')}"
        )
        line = f"m{row} [label={_quote(text)} shape=box3d fillcolor={_quote(_COLLAPSED_COLOUR)}]"
        parent = parent_of[row]
        (top_level if parent < 0 else members.setdefault(visible_call[parent], [])).append(line)

    # Nest clusters: a visible call's cluster holds its own nodes and its visible child calls' clusters.
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for row in range(n_calls):
        if visible_call[row] != row or row in collapsed:
            continue
        parent = parent_of[row]
        (roots if parent < 0 else children.setdefault(parent, [])).append(row)
    nonempty = [first_op[r] < end_op[r] for r in range(n_calls)]

    out = [
        "digraph trace {",
        '  graph [rankdir=TB fontname="Helvetica" fontsize=11 newrank=true]',
        '  node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=10 margin="0.08,0.03"]',
        '  edge [arrowsize=0.6 color="#555555"]',
    ]

    def emit_cluster(row: int, indent: str) -> None:
        title = _call_title(table["address"][row], table["type"][row], table["call"][row])
        out.append(f"{indent}subgraph cluster_m{row} {{")
        out.append(f'{indent}  label={_quote(title)} style="rounded" color="#7a7a7a" fontsize=10')
        out.extend(indent + "  " + line for line in members.get(row, ()))
        for child in children.get(row, ()):
            if nonempty[child]:
                emit_cluster(child, indent + "  ")
        out.append(f"{indent}}}")

    out.extend("  " + line for line in top_level)
    for row in roots:
        if nonempty[row]:
            emit_cluster(row, "  ")

    edges: dict[tuple[int, int], None] = {}
    for i, parents in enumerate(cols["parents"]):
        dst = node_of[i]
        for p in parents:
            src = node_of[p]
            if src != dst:  # ops inside one collapsed call: no self loop
                edges[(src, dst)] = None

    def node_name(node: int) -> str:
        return f"op{node}" if node >= 0 else f"m{-1 - node}"

    out.extend(f"  {node_name(a)} -> {node_name(b)}" for a, b in edges)
    out.append("}")
    return "\n".join(out) + "\n"


def draw(trace: Trace, path: str | os.PathLike, *, format: str = "svg", depth: int | None = None) -> str:
    """Lay out ``trace``'s op graph with Graphviz and write it to exactly ``path``.

    One node per op (label, output shape, duration; coloured by kind), an edge from each op to every op that
    read its output (``parents``), and ops grouped in nested clusters, one per module call.

    Args:
        trace: the trace to draw.
        path: the file to write, as given (no extension is added).
        format: any Graphviz output format: ``svg``, ``png``, ``pdf``, ``dot``, ...
        depth: ``None`` draws every op. With ``depth=d``, each module call nested deeper than ``d`` (the
            outermost call has depth 0) collapses into one node showing its op count, output shape, time and
            FLOPs; edges into and out of it are rerouted to that node.

    Returns:
        ``path`` as a string.

    Raises:
        ValueError: ``format`` is not a Graphviz format, or ``depth`` is not None or a non-negative int.
        MissingToolError: Graphviz's ``dot`` executable is not installed (nothing is written).
        TlDistError: ``dot`` failed.

    Example:
        >>> trace = tl.trace(model, x)
        >>> trace.draw("out/graph.svg", depth=2)
        'out/graph.svg'
    """
    check_draw_options(format, depth)
    return render(graph_source(trace, depth=depth), path, format=format)


GRAPHVIZ_HINT = "apt-get install graphviz, brew install graphviz or conda install graphviz"


def check_draw_options(format: str, depth: int | None) -> None:
    """The checks ``trace.draw`` and ``g.draw`` share: a Graphviz format and a module depth."""
    if not isinstance(format, str) or format not in graphviz.FORMATS:
        raise ValueError(
            f"format must be a Graphviz output format such as 'svg', 'png' or 'pdf'; got {format!r} "
            f"(known: {', '.join(sorted(graphviz.FORMATS))})"
        )
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth must be None or a non-negative int (module nesting level), got {depth!r}")


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
