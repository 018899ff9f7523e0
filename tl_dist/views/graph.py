"""What a drawing of a trace shows: which ops get a node, which module calls collapse into one, and the
parameter, input and output nodes around them. :mod:`.draw` turns a :class:`GraphPlan` into DOT text.

Rules (``docs/views.md`` says the same for users):

- Each op is drawn in a module call, its *home*: a forward op in the call that ran it; a backward op in the call
  of its forward op (``fwd_op``), or, when it has none (gradient hooks, DDP's bucket copies), in its first
  parent's home; an optimizer op in the call of the module owning the parameters it updates. A collective in
  the call of its owner module, the one rule every view names it by (:func:`tl_dist.schema.module_address`:
  DDP's gradient all_reduce in the module whose backward made the bucket ready): its own call when it ran in
  one, else the owner's first call (of its nearest called ancestor), else top level.
- A call nested deeper than ``depth`` collapses, with its whole subtree and every phase of its ops, into one node;
  but a collective keeps its own node (a merged drawing joins it across ranks): a collapsed call owning
  collectives is a cluster holding its collapsed node and, in the nested clusters of their owner calls, its
  collectives.
- Bookkeeping ops (views, ``detach``, allocations, profiler markers) get no node unless ``show_all``; the edges
  through them are kept (an op reading a view of ``x`` gets an edge from ``x``'s producer).
- One node per module owning parameters (or buffers) read by drawn ops (a module never called itself, such as
  MultiheadAttention's ``out_proj``, in its nearest called ancestor's cluster; a tied parameter, having one
  name, is one node), one per external input shape and one per output of each outermost module call.

Example:
    >>> plan = plan_graph(trace, depth=1)
    >>> len(plan.nodes), plan.node_of_op[trace["all_reduce_1"].index]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..schema import PHASES, is_profiler_marker, module_address
from .summary import format_count, format_ns, format_shape

if TYPE_CHECKING:
    from ..trace import Trace

# Above this many nodes dot's pictures stop fitting a screen (and its layout takes minutes).
AUTO_NODE_LIMIT = 300
_ALLOCATION = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"})
_PHASE_TAG = {"backward": "bwd", "optimizer": "opt", "forward": "fwd", "recompute": "rec"}


def is_bookkeeping(func: str, aten: str, kind: str) -> bool:
    """Ops that move no values of their own: views (``t``, ``view``, ``detach``, ``as_strided`` ...),
    allocations (``empty``) and profiler markers (``_record_function_enter``)."""
    return kind == "view" or func in _ALLOCATION or is_profiler_marker(aten)


@dataclass
class Node:
    """One node of a drawing: ``kind`` is ``op``, ``module`` (a collapsed call), ``params``, ``input`` or
    ``output``; ``cluster`` the module-call row whose cluster holds it (-1: top level)."""

    name: str
    kind: str
    cluster: int
    text: str
    op_kind: str = ""  # the op's kind (compute, view, ...) for op nodes: the fill colour
    phase: str = "forward"


@dataclass
class GraphPlan:
    """The nodes, edges and module clusters of one trace's drawing (see the module doc)."""

    nodes: dict[str, Node]
    edges: dict[tuple[str, str], None]
    node_of_op: list[str | None]  # per op: the node standing for it (None: filtered out or passed through)
    clusters: list[int]  # expanded module-call rows holding at least one node, in pre-order
    cluster_parent: dict[int, int]  # expanded row -> enclosing expanded row (-1: top level)
    depth: int | None
    ops_drawn: int = 0  # ops of the phases drawn, bookkeeping included
    titles: dict[int, str] = field(default_factory=dict)  # call row -> cluster / node title
    edge_labels: dict[tuple[str, str], str] = field(default_factory=dict)  # rolled loops: "×4"
    dashed: set[tuple[str, str]] = field(default_factory=set)  # rolled loops: from one iteration to the next

    @property
    def phases_drawn(self) -> set[str]:
        """Phases of the op nodes drawn."""
        return {n.phase for n in self.nodes.values() if n.kind == "op"}


def call_title(address: str, mtype: str, call: int) -> str:
    """``layer1.0 (BasicBlock)``, with ``call N`` for a module's later calls."""
    return f"{address or '<root>'} ({mtype})" + (f" call {call}" if call else "")


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _first_calls(trace: Trace) -> dict[str, int]:
    """Module address -> the row of its first call."""
    first_call: dict[str, int] = {}
    for row, address in enumerate(trace.module_table["address"]):
        first_call.setdefault(address, row)
    return first_call


def _host_call(address: str, first_call: dict[str, int]) -> int:
    """The first call of the module at ``address``, or of its nearest called ancestor when it never ran as a
    module itself (MultiheadAttention's ``out_proj``, whose parameters functional code reads); -1: none."""
    while address not in first_call and address:
        address = _owner(address)
    return first_call.get(address, -1)


def home_calls(trace: Trace) -> list[int]:
    """Per op, the module-call row it is drawn in (-1: top level); see the module doc."""
    cols = trace.columns
    first_call = _first_calls(trace)
    parent_of = trace.module_table["parent"]

    def ancestors(row: int) -> list[int]:
        chain = []
        while row >= 0:
            chain.append(row)
            row = parent_of[row]
        return chain

    def params_call(names: Sequence[str]) -> int:
        # The innermost call enclosing every owner of `names` (their common ancestor).
        rows = {_host_call(_owner(n), first_call) for n in names}
        if not names or -1 in rows:
            return -1
        chains = [ancestors(r) for r in rows]
        common = set(chains[0]).intersection(*chains[1:])
        return next((r for r in chains[0] if r in common), -1)

    home = [-1] * len(trace)
    phases, fwd, own, kinds = cols["phase"], cols["fwd_op"], cols["module_call"], cols["kind"]
    parents, params, modules, stacks = cols["parents"], cols["params"], cols["module"], cols["module_stack"]
    for i in range(len(trace)):
        call = own[i]
        if kinds[i] == "collective":
            if call < 0:  # no call of its own (a gradient hook's in backward): its owner module's
                address = module_address({"module": modules[i], "module_stack": stacks[i]})
                call = -1 if address is None else _host_call(address, first_call)
        else:
            phase = phases[i]
            if phase == "backward" and fwd[i] >= 0:
                call = home[fwd[i]]
            elif phase == "optimizer" and call < 0:
                call = params_call(params[i])
            if call < 0 and phase != "forward":
                call = next((home[p] for p in parents[i] if home[p] >= 0), -1)
        home[i] = call
    return home


def _check_phases(phase: str | Iterable[str] | None) -> frozenset[str]:
    if phase is None:
        return frozenset(PHASES)
    wanted = (
        (phase,)
        if isinstance(phase, str)
        else tuple(phase)
        if isinstance(phase, (list, tuple, set))
        else None
    )
    if not wanted or any(p not in PHASES for p in wanted):
        raise ValueError(f"phase must be None, one of {PHASES} or a list of them; got {phase!r}")
    return frozenset(wanted)


def check_plan_options(depth: Any, phase: Any, show_all: Any) -> frozenset[str]:
    """Check ``depth``, ``phase`` and ``show_all`` of a drawing; returns the phases to draw."""
    if (
        depth != "auto"
        and depth is not None
        and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0)
    ):
        raise ValueError(
            f"depth must be 'auto', None (every op) or a non-negative int (module nesting level), got {depth!r}"
        )
    if not isinstance(show_all, bool):
        raise ValueError(f"show_all must be a bool, got {show_all!r}")
    return _check_phases(phase)


def _input_shapes(trace: Trace, i: int, param_shapes: dict[str, tuple]) -> list[tuple | None]:
    """Shapes of the tensors op ``i`` read that no op of the trace made and that are no parameters (the model's
    inputs, a training step's data). None stands for an input whose shape the columns cannot tell apart from an
    unknown parameter's. NB: a tensor read twice by one op (``x * x``) looks like a parent and an input."""
    cols = trace.columns
    shapes = [tuple(s) for s in cols["in_shapes"][i]]
    parents, params = cols["parents"][i], cols["params"][i]
    extra = len(shapes) - len(params) - len(parents) - (1 if cols["inplace"][i] else 0)
    if extra <= 0:
        return []
    out_shapes = cols["out_shapes"]
    rest = list(shapes)
    for p in parents:  # each parent's tensor accounts for one argument of its shape
        for s in out_shapes[p]:
            if tuple(s) in rest:
                rest.remove(tuple(s))
                break
    unknown = 0
    for name in params:
        known = param_shapes.get(name)
        if known is not None and known in rest:
            rest.remove(known)
        else:
            unknown += 1
    if unknown == 0 and len(rest) == extra:
        return rest
    # Parameters of unknown shape among the candidates: an input shares the output's leading (batch) dimension,
    # a weight or bias rarely does (conv(x, w, b), embedding(w, ids), batch_norm(x, w, b, ...)).
    outs = out_shapes[i]
    batch = outs[0][0] if outs and len(outs[0]) else None
    leading = [s for s in rest if batch is not None and len(s) and s[0] == batch]
    if len(leading) == extra:
        return leading
    return [None] * min(extra, len(rest))


def _param_shapes(trace: Trace) -> dict[str, tuple]:
    # An op whose tensors, parents' aside, are all parameters tells their shapes, in argument order (t(weight),
    # an optimizer's add_(param, grad)).
    cols = trace.columns
    out_shapes = cols["out_shapes"]
    known: dict[str, tuple] = {}
    for i, names in enumerate(cols["params"]):
        if not names:
            continue
        rest = [tuple(s) for s in cols["in_shapes"][i]]
        for p in cols["parents"][i]:
            for s in out_shapes[p]:
                if tuple(s) in rest:
                    rest.remove(tuple(s))
                    break
        if len(rest) == len(names):
            for name, shape in zip(names, rest):
                known.setdefault(name, shape)
    return known


def plan_graph(
    trace: Trace,
    *,
    depth: int | None = None,
    phases: frozenset[str] = frozenset(PHASES),
    show_all: bool = False,
) -> GraphPlan:
    """The :class:`GraphPlan` of ``trace`` at ``depth`` (None: no call collapses) for the ops of ``phases``."""
    cols = trace.columns
    table = trace.module_table
    n_calls = len(table["address"])
    parent_of, call_depth = table["parent"], table["depth"]
    titles = {r: call_title(table["address"][r], table["type"][r], table["call"][r]) for r in range(n_calls)}

    # visible_call[row]: the row itself when expanded or collapsed, else its collapsed ancestor.
    collapsed: set[int] = set()
    visible_call = list(range(n_calls))
    for row in range(n_calls):  # pre-order: a parent's row precedes its children's
        parent = parent_of[row]
        if parent >= 0 and (parent in collapsed or visible_call[parent] != parent):
            visible_call[row] = visible_call[parent]
        elif depth is not None and call_depth[row] > depth:
            collapsed.add(row)

    home = home_calls(trace)
    nodes: dict[str, Node] = {}
    edges: dict[tuple[str, str], None] = {}
    node_of_op: list[str | None] = [None] * len(trace)
    src: list[tuple[str, ...]] = [()] * len(trace)  # the nodes standing for each op's value
    members: dict[int, list[int]] = {}  # collapsed row -> its drawn ops
    opened: set[int] = set()  # collapsed rows owning a collective: a cluster around their node
    param_names: dict[str, dict[str, None]] = {}  # params node -> parameter names read
    param_key: dict[str, str] = {}  # owning module's address -> its params node
    first_call = _first_calls(trace)
    param_shapes = _param_shapes(trace)
    labels, funcs, atens, kinds, phase_col = (
        cols["label"],
        cols["func"],
        cols["aten"],
        cols["kind"],
        cols["phase"],
    )
    durations, out_shapes = cols["duration_ns"], cols["out_shapes"]
    ops_drawn = 0

    def param_node(name: str) -> str:
        # One node per module owning parameters, keyed by the owner's address (names are unique per tensor: a
        # tied parameter has one name, so it is one node), in the cluster of the owner's call or, for an owner
        # that never ran as a module, of its nearest called ancestor.
        address = _owner(name)
        owner = _host_call(address, first_call)
        if owner >= 0 and visible_call[owner] in collapsed:
            return f"m{visible_call[owner]}"  # the parameter lives inside that collapsed node
        key = param_key.get(address)
        if key is None:
            key = f"p{owner}" if owner >= 0 else "p_"
            if key in nodes:  # the host's own parameters, or another uncalled module's, have that name
                key = f"{key}_{len(param_key)}"
            param_key[address] = key
            nodes[key] = Node(key, "params", owner, "")
        param_names.setdefault(key, {})[name] = None
        return key

    def input_node(shape: tuple | None) -> str:
        key = "in_" + ("x".join(map(str, shape)) if shape is not None else "unknown")
        if key not in nodes:
            nodes[key] = Node(
                key, "input", -1, "input" + (f"\n{format_shape(shape)}" if shape is not None else "")
            )
        return key

    for i in range(len(trace)):
        if phase_col[i] not in phases:
            continue
        ops_drawn += 1
        h = home[i]
        v = visible_call[h] if h >= 0 else -1
        absorbed = v in collapsed and kinds[i] != "collective"
        if v in collapsed and not absorbed:
            opened.add(v)
            v = h  # a collective keeps its node, in its owner's cluster: the collapsed call's or one inside it
        if absorbed:
            name = f"m{v}"
            members.setdefault(v, []).append(i)
        elif show_all or not is_bookkeeping(funcs[i], atens[i], kinds[i]):
            name = f"op{i}"
            shapes = out_shapes[i]
            text = f"{labels[i]}\n{format_shape(tuple(shapes[0]) if shapes else None)}\n{format_ns(durations[i])}"
            nodes[name] = Node(name, "op", v, text, kinds[i], phase_col[i])
        else:
            name = None
        sources: dict[str, None] = {}
        for p in cols["parents"][i]:
            for s in src[p]:
                sources[s] = None
        for pname in cols["params"][i]:
            sources[param_node(pname)] = None
        for shape in _input_shapes(trace, i, param_shapes):
            sources[input_node(shape)] = None
        if name is None:  # passed through: readers of this op's value read its sources
            src[i] = tuple(sources)
            continue
        node_of_op[i] = name
        src[i] = (name,)
        for s in sources:
            if s != name:
                edges[(s, name)] = None

    for row in sorted(members):
        ops = members[row]
        by_phase = {p: sum(1 for i in ops if phase_col[i] == p) for p in PHASES}
        split = [f"{n} {_PHASE_TAG.get(p, p)}" for p, n in by_phase.items() if n]
        count = f"{len(ops)} ops" + (f" ({', '.join(split)})" if len(split) > 1 else "")
        outs = [op for op in table["out_ops"][row] if op >= 0]
        shapes = out_shapes[outs[0]] if outs else ()
        flops = sum(cols["flops"][i] for i in ops)
        text = (
            f"{titles[row]}\n{count}, {format_shape(tuple(shapes[0]) if shapes else None)}\n"
            f"{format_ns(sum(durations[i] for i in ops))}, {format_count(flops, 'FLOP')}"
        )
        parent = parent_of[row]
        cluster = row if row in opened else visible_call[parent] if parent >= 0 else -1
        nodes[f"m{row}"] = Node(f"m{row}", "module", cluster, text)
    for key, names in param_names.items():
        owner = nodes[key].cluster
        prefix = f"{table['address'][owner]}." if owner >= 0 and table["address"][owner] else ""
        listed = [n[len(prefix) :] if prefix and n.startswith(prefix) else n for n in names]
        shown = [
            n + (f" {format_shape(param_shapes[full])}" if full in param_shapes else "")
            for n, full in zip(listed, names)
        ]
        nodes[key].text = "\n".join(shown[:6] + ([f"+{len(shown) - 6} more"] if len(shown) > 6 else []))
    # Outputs of the outermost calls (the model's output in tl.trace).
    for row in range(n_calls):
        if parent_of[row] >= 0:
            continue
        outs = [op for op in table["out_ops"][row] if op >= 0 and phase_col[op] in phases]
        feeding = {s: None for op in outs for s in src[op]}
        if feeding:
            shapes = out_shapes[outs[0]]
            name = f"out{row}"
            nodes[name] = Node(
                name, "output", -1, f"output\n{format_shape(tuple(shapes[0]) if shapes else None)}"
            )
            for s in feeding:
                edges[(s, name)] = None

    # Expanded calls that hold a node, themselves or in a descendant.
    holding = {n.cluster for n in nodes.values() if n.cluster >= 0}
    for row in list(holding):
        parent = parent_of[row]
        while parent >= 0 and parent not in holding:
            holding.add(parent)
            parent = parent_of[parent]
    clusters = [r for r in range(n_calls) if r in holding]
    return GraphPlan(
        nodes=nodes,
        edges=edges,
        node_of_op=node_of_op,
        clusters=clusters,
        cluster_parent={r: parent_of[r] for r in clusters},
        depth=depth,
        ops_drawn=ops_drawn,
        titles=titles,
    )


def max_call_depth(trace: Trace) -> int:
    """Deepest module-call nesting of ``trace`` (-1 without module calls)."""
    return max(trace.module_table["depth"], default=-1)


def plan_all(
    traces: Sequence[Trace],
    *,
    depth: Any,
    phases: frozenset[str],
    show_all: bool,
    limit: int = AUTO_NODE_LIMIT,
) -> tuple[list[GraphPlan], str]:
    """Plans of ``traces`` drawn together; ``depth="auto"`` picks the deepest depth whose nodes (all traces
    together) stay within ``limit``. Returns the plans and a note saying which depth was chosen and why ('' when
    nothing had to collapse)."""
    if depth != "auto":
        return [plan_graph(t, depth=depth, phases=phases, show_all=show_all) for t in traces], ""
    full = [plan_graph(t, depth=None, phases=phases, show_all=show_all) for t in traces]
    n_full = sum(len(p.nodes) for p in full)
    if n_full <= limit:
        return full, ""
    deepest = max((max_call_depth(t) for t in traces), default=-1)
    plans, n = full, n_full
    for d in range(deepest - 1, -1, -1):
        plans = [plan_graph(t, depth=d, phases=phases, show_all=show_all) for t in traces]
        n = sum(len(p.nodes) for p in plans)
        if n <= limit:
            break
    if plans is full:  # only outermost calls: nothing to collapse
        return full, f"{n_full:,} nodes, over {limit}, and no module call to collapse: narrow it with phase="
    chosen = plans[0].depth
    note = (
        f"depth={chosen} chosen automatically: {n:,} nodes (every op would be {n_full:,} nodes, over {limit}); "
        "pass depth=None to draw every op or depth=N to choose"
    )
    if n > limit:
        note += "; still large: narrow it with phase=" + (", rank= or step=" if len(traces) > 1 else "")
    return plans, note
