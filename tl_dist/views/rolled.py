"""Rolled drawings: a loop that repeats the same ops in the same modules is drawn once, with counts.

``trace.draw(..., rolled=True)`` takes the :class:`~tl_dist.views.graph.GraphPlan` of the unrolled graph and
folds it: the drawn nodes, in execution order, get a signature (phase, op name and module address for an op;
the module address for a collapsed call), and each run of consecutive repetitions of one block of signatures
(an RNN cell's step, a Python loop over one block) becomes a single copy of the block. The nodes of the later
iterations merge into the first iteration's; their edges merge too, labelled with how many edges each stands for
(``×4``), and the edges that carry a value from one iteration to the next (the recurrence) are dashed. Module
calls whose ops merged show the iteration count in their cluster title (``inp (Linear) ×4``).

Example:
    >>> rolled = roll(plan_graph(trace), trace)
    >>> rolled.edge_labels[("op7", "op9")]
    '×3'
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .graph import GraphPlan
from .summary import format_ns, format_shape

if TYPE_CHECKING:
    from ..trace import Trace

_MAX_PERIOD = 256  # nodes in one loop body; longer repetitions are left unrolled (and the search stays cheap)


def _sequence(plan: GraphPlan, trace: Trace) -> tuple[list[str], list[tuple]]:
    """The op and collapsed-call nodes in the order they first ran, with their signatures."""
    cols, table = trace.columns, trace.module_table
    order: list[str] = []
    seen: set[str] = set()
    signatures: list[tuple] = []
    for i, name in enumerate(plan.node_of_op):
        if name is None or name in seen:
            continue
        seen.add(name)
        order.append(name)
        if name.startswith("m"):
            signatures.append(("module", table["address"][int(name[1:])], cols["phase"][i]))
        else:
            signatures.append((cols["phase"][i], cols["func"][i], cols["module"][i]))
    return order, signatures


def find_loops(signatures: list[tuple], *, max_period: int = _MAX_PERIOD) -> list[tuple[int, int, int]]:
    """Runs of a block repeated back to back: ``(start, period, count)`` with ``count >= 2``, left to right,
    each the longest run (``period * count``) starting at the earliest position, ties to the shorter period.

    Example:
        >>> find_loops(list("zabcabcabcq"))
        [(1, 3, 3)]
    """
    n = len(signatures)
    positions: dict[tuple, list[int]] = {}
    for k, s in enumerate(signatures):
        positions.setdefault(s, []).append(k)
    loops = []
    i = 0
    while i < n:
        best: tuple[int, int] | None = None
        for j in positions[signatures[i]]:
            period = j - i
            if period <= 0:
                continue
            if period > max_period or i + 2 * period > n:
                break
            count = 1
            while (
                i + (count + 1) * period <= n
                and signatures[i + count * period : i + (count + 1) * period] == signatures[i : i + period]
            ):
                count += 1
            if count >= 2 and (best is None or count * period > best[0] * best[1]):
                best = (period, count)
        if best is None:
            i += 1
            continue
        loops.append((i, best[0], best[1]))
        i += best[0] * best[1]
    return loops


def roll(plan: GraphPlan, trace: Trace) -> GraphPlan:
    """``plan`` with each loop (see :func:`find_loops`) folded into its first iteration."""
    order, signatures = _sequence(plan, trace)
    loops = find_loops(signatures)
    if not loops:
        return plan
    rep: dict[str, str] = {}  # merged node -> the first iteration's node
    members: dict[str, list[str]] = {}  # first iteration's node -> every node it stands for
    iteration: dict[str, tuple[int, int]] = {}  # node -> (loop, iteration)
    for n_loop, (start, period, count) in enumerate(loops):
        for offset in range(period):
            first = order[start + offset]
            members[first] = [order[start + k * period + offset] for k in range(count)]
            for k, name in enumerate(members[first]):
                rep[name] = first
                iteration[name] = (n_loop, k)
    nodes = {name: node for name, node in plan.nodes.items() if rep.get(name, name) == name}
    titles = dict(plan.titles)
    for first, names in members.items():
        node = nodes[first]
        if node.kind == "op":
            nodes[first] = replace(node, text=_op_text(trace, plan, names))
        else:
            nodes[first] = replace(node, text=f"{node.text}\n×{len(names)}")
        # The calls holding the first iteration's node that the other iterations' nodes are not in (different
        # calls of one module, and of the modules around it, merged into the first): they ran once per iteration.
        chains = [set(_ancestors(plan, plan.nodes[n].cluster)) for n in names[1:]]
        for row in _ancestors(plan, node.cluster):
            if not all(row in chain for chain in chains):
                titles[row] = f"{plan.titles[row]} ×{len(names)}"
    counts: dict[tuple[str, str], int] = {}
    recurrent: set[tuple[str, str]] = set()
    for a, b in plan.edges:
        edge = (rep.get(a, a), rep.get(b, b))
        counts[edge] = counts.get(edge, 0) + 1
        ia, ib = iteration.get(a), iteration.get(b)
        if ia is not None and ib is not None and ia[0] == ib[0] and ib[1] == ia[1] + 1:
            recurrent.add(edge)
    edges = {edge: None for edge in counts}
    holding = {n.cluster for n in nodes.values() if n.cluster >= 0}
    for row in list(holding):
        parent = plan.cluster_parent.get(row, -1)
        while parent >= 0 and parent not in holding:
            holding.add(parent)
            parent = plan.cluster_parent.get(parent, -1)
    clusters = [r for r in plan.clusters if r in holding]
    return replace(
        plan,
        nodes=nodes,
        edges=edges,
        node_of_op=[None if n is None else rep.get(n, n) for n in plan.node_of_op],
        clusters=clusters,
        cluster_parent={r: plan.cluster_parent[r] for r in clusters},
        titles=titles,
        edge_labels={edge: f"×{n}" for edge, n in counts.items() if n > 1},
        dashed=recurrent,
    )


def _ancestors(plan: GraphPlan, row: int) -> list[int]:
    chain = []
    while row >= 0:
        chain.append(row)
        row = plan.cluster_parent.get(row, -1)
    return chain


def _op_text(trace: Trace, plan: GraphPlan, names: list[str]) -> str:
    cols = trace.columns
    ops = [int(n[2:]) for n in names]
    labels = cols["label"]
    shapes = cols["out_shapes"][ops[0]]
    total = sum(cols["duration_ns"][i] for i in ops)
    return (
        f"{labels[ops[0]]} … {labels[ops[-1]]} ×{len(ops)}\n"
        f"{format_shape(tuple(shapes[0]) if shapes else None)}\n{format_ns(total)} total"
    )
