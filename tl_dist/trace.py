"""The trace: a columnar table of the ops one capture recorded, with thin views over its rows.

Example:
    >>> trace = tl.trace(model, x)
    >>> len(trace), trace["relu_2"].out.shape, trace[0].flops
    >>> trace.module("layer1.0.conv1").out
    >>> df = trace.to_pandas()
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_unflatten

from ._common import FLOAT_DTYPES as _FLOATS
from ._common import STAT_NAMES as _STAT_NAMES
from .errors import SchemaError, TlDistError
from .schema import COLLECTIVE_FIELDS, COMPILED_OP_FIELDS, OP_FIELDS, STAT_FIELDS, EmptyUntilSet, field_names
from .selectors import Selector

Tensor = torch.Tensor
_OP_FIELD_NAMES = frozenset(field_names(OP_FIELDS))
_COLLECTIVE_FIELD_NAMES = frozenset(field_names(COLLECTIVE_FIELDS))


class Op:
    """One op of a trace: a view over row ``index``. Attributes are the schema's fields (``.label``, ``.func``,
    ``.module``, ``.flops``, ``.duration_ns``, ``.parents``, ...) plus ``.shape``, ``.out``, ``.children``."""

    __slots__ = ("_trace", "index")

    def __init__(self, trace: Trace, index: int) -> None:
        self._trace = trace
        self.index = index

    def __getattr__(self, name: str) -> Any:
        if name in _OP_FIELD_NAMES:
            return self._trace.columns[name][self.index]
        raise AttributeError(f"Op has no attribute {name!r}; fields: {', '.join(sorted(_OP_FIELD_NAMES))}")

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Shape of the first tensor output (None when the op returned no tensor)."""
        shapes = self.out_shapes
        return tuple(shapes[0]) if shapes else None

    @property
    def out(self) -> torch.Tensor | tuple | None:
        """The saved output (a tuple for multi-output ops); None if not saved."""
        saved = self._trace.saved.get(self.index)
        if saved is None:
            return None
        return saved[0] if len(saved) == 1 else tuple(saved)

    @property
    def grad(self) -> torch.Tensor | tuple | None:
        """Gradient of the loss w.r.t. this op's output (tuple for multi-output ops); None if not captured.

        Example:
            >>> with tl.capture(save_grads=tl.func("relu")) as cap:
            ...     model(x).sum().backward()
            >>> cap.trace["relu_2"].grad.shape
        """
        grads = _recorded_grads(self._trace).get(self.index)
        if grads is None:
            return None
        return grads[0] if len(grads) == 1 else tuple(grads)

    @property
    def stats(self) -> dict[str, dict[str, float]]:
        """Recorded statistics: ``{"out": {"mean": ..., "nan": ...}, "grad": {...}}`` (``stats=`` option)."""
        return op_stats(self._trace, self.index)

    @property
    def children(self) -> tuple[int, ...]:
        """Indices of the ops that read this op's output."""
        return self._trace.children[self.index]

    @property
    def output_of(self) -> tuple[str, ...]:
        """Addresses of the module calls whose output this op produced."""
        return self._trace.output_of.get(self.index, ())

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "-"
        where = f" in {self.module}" if self.module else ""
        return f"<Op {self.index} {self.label} {shape} {self.dtype}{where}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Op) and other._trace is self._trace and other.index == self.index

    def __hash__(self) -> int:
        return hash((id(self._trace), self.index))


class ModuleCall:
    """One call of a module: ``.address .type .call .ops .out`` (its output rebuilt from saved op outputs)."""

    __slots__ = ("_trace", "row")

    def __init__(self, trace: Trace, row: int) -> None:
        self._trace = trace
        self.row = row

    def _get(self, name: str) -> Any:
        return self._trace.module_table[name][self.row]

    address = property(lambda self: self._get("address"), doc="Module address ('' for the root).")
    type = property(lambda self: self._get("type"), doc="Module class name.")
    call = property(lambda self: self._get("call"), doc="Which call of the module this is, from 0.")
    depth = property(lambda self: self._get("depth"), doc="Nesting depth, 0 for outermost calls.")

    @property
    def parent(self) -> ModuleCall | None:
        row = self._get("parent")
        return None if row < 0 else ModuleCall(self._trace, row)

    @property
    def ops(self) -> list[Op]:
        """The ops run inside this call, its submodules' included, in execution order."""
        return [Op(self._trace, i) for i in range(self._get("first_op"), self._get("end_op"))]

    @property
    def out(self) -> Any:
        """The call's output, with the structure the module returned; tensors not saved are None."""
        return self._leaves(self._trace.saved)

    @property
    def grad(self) -> Any:
        """Gradient of the loss w.r.t. the call's output, with the structure the module returned (``save_grads``
        covering the ops producing it); None where not captured.

        Example:
            >>> with tl.capture(save_grads=tl.module("layer1")) as cap:
            ...     model(x).sum().backward()
            >>> cap.trace.module("layer1").grad.shape
        """
        return self._leaves(_recorded_grads(self._trace))

    def _leaves(self, values_of: dict[int, list]) -> Any:
        tree = self._trace.out_trees.get(self.row)
        if tree is None:
            return None
        spec, leaves = tree
        values = []
        for leaf, op, pos in zip(leaves, self._get("out_ops"), self._get("out_pos")):
            if op < 0:
                values.append(None if values_of is self._trace.grads else leaf)
            else:
                outs = values_of.get(op)
                values.append(outs[pos] if outs is not None and pos < len(outs) else None)
        return tree_unflatten(values, spec)

    def __repr__(self) -> str:
        return f"<ModuleCall {self.address or '<root>'} ({self.type}) call {self.call}>"


class Collective:
    """One collective of a trace: a view over a row of ``trace.collective_table``. Attributes are
    ``schema.COLLECTIVE_FIELDS`` (``.func .group_ranks .seq .state .complete_ns`` ...) plus ``.label`` and
    ``.children`` of its op.

    Example:
        >>> c = trace.collectives[0]
        >>> c.func, c.seq, c.label, [trace[i].func for i in c.children]
    """

    __slots__ = ("_trace", "row")

    def __init__(self, trace: Trace, row: int) -> None:
        self._trace = trace
        self.row = row

    def __getattr__(self, name: str) -> Any:
        if name in _COLLECTIVE_FIELD_NAMES:
            return self._trace.collective_table[name][self.row]
        raise AttributeError(
            f"Collective has no attribute {name!r}; fields: {', '.join(sorted(_COLLECTIVE_FIELD_NAMES))}"
        )

    @property
    def label(self) -> str:
        """Label of the collective's op row (``all_reduce_2``)."""
        return self._trace.columns["label"][self.op]

    @property
    def children(self) -> tuple[int, ...]:
        """Indices of the ops that read the collective's result."""
        return self._trace.children[self.op]

    def __repr__(self) -> str:
        return (
            f"<Collective {self.label} group={list(self.group_ranks)} seq={self.seq} "
            f"{self.out_numel} x {self.dtype} {self.state}>"
        )


def _recorded_grads(trace: Trace) -> dict[int, list]:
    """``trace.grads`` for ``.grad``; the first time a trace that recorded no backward is asked, a warning: a
    plain ``loss.backward()`` after ``tl.trace`` runs outside any window, so no gradient is recorded and every
    ``.grad`` is None."""
    if not trace.grads and not trace.__dict__.get("_warned_no_backward"):
        if "backward" not in trace.columns["phase"]:
            trace._warned_no_backward = True
            warnings.warn(
                "tl_dist: this trace recorded no backward, so .grad is None: run the backward through "
                "trace.log_backward(loss) (tl.trace, with save_grads=) or inside the capture window; a plain "
                "loss.backward() afterwards records nothing",
                UserWarning,
                stacklevel=3,
            )
    return trace.grads


def _saved_leaf(saved: Any, ref: dict) -> torch.Tensor | None:
    """The output leaf op ``ref["op"]`` produced: its saved output, None when it was not saved."""
    outs = saved.get(ref["op"])
    return None if outs is None else outs[ref["pos"]]


class PendingColumns(NamedTuple):
    """An op table made on first use: ``make()`` returns it (schema order), ``n_ops`` its length (the first
    ``n_ops`` rows of what ``make()`` returns, should its rows have grown since). A window's
    trace starts in this form: a window nobody reads costs no transpose of its rows on the training thread,
    and an armed one's is made where a sink first reads it (the sink worker).

    Example:
        >>> trace = Trace(PendingColumns(recorder.columns, len(recorder.rows)), recorder.modules.calls)
        >>> len(trace) == len(recorder.rows)  # no table made yet
        True
    """

    make: Callable[[], dict[str, list]]
    n_ops: int


class Trace:
    """The ops of one capture, in execution order. Built by ``tl.trace``, ``tl.capture`` or ``tl.load``."""

    collective_table = EmptyUntilSet(COLLECTIVE_FIELDS)
    stats_table = EmptyUntilSet(STAT_FIELDS)
    # The ATen ops inside each compiled region (kind `compiled` rows), from tl_dist.compiled.
    compiled_table = EmptyUntilSet(COMPILED_OP_FIELDS)

    def __init__(
        self,
        columns: dict[str, list] | PendingColumns,
        module_table: dict[str, list],
        *,
        collective_table: dict[str, list] | None = None,
        saved: dict[int, list] | None = None,
        replay_records: dict[int, tuple] | None = None,
        output_of: dict[int, tuple[str, ...]] | None = None,
        out_trees: dict[int, Any] | None = None,
        output: Any = None,
        metadata: dict[str, Any] | None = None,
        failed_op: dict[str, Any] | None = None,
        grads: dict[int, list] | None = None,
        stats_table: dict[str, list] | None = None,
        recorder: Any = None,
        param_grads: dict[str, torch.Tensor] | None = None,
        interventions: tuple = (),
    ) -> None:
        self._pending: PendingColumns | None = None
        if isinstance(columns, PendingColumns):
            self._pending, self._columns = columns, None
        else:
            self.columns = columns
        self.module_table = module_table
        self.collective_table = collective_table or None
        self.saved = saved or {}
        # op -> (func, argument skeleton, kwargs, parent slots, constants): what validate() and replay() run
        self._replay = replay_records or {}
        self.output_of = output_of or {}
        self.out_trees = out_trees or {}
        self._output = output
        # A loaded shard's output as (spec, leaves), resolved on first use of `output`.
        self._output_leaves: tuple[Any, list] | None = None
        # Output leaf -> (op, output position) that produced it (tl.trace): a shard refers to the saved output.
        self.output_refs: dict[int, tuple[int, int]] = {}
        self.metadata = metadata or {}
        self.failed_op = failed_op
        self.grads = grads if grads is not None else {}  # op -> gradient per output (tl_dist.training)
        self.stats_table = stats_table
        self.compiled_table = None
        self._recorder = recorder  # the live recorder, for log_backward; None for loaded traces
        # Parameter name -> its gradient at the end of the window's backward (save_grads asks for it).
        self.param_grads = param_grads if param_grads is not None else {}
        self.interventions = tuple(interventions)  # the tl.when(...) edits this trace ran with
        self._labels: dict[str, int] | None = None
        self._children: list[tuple[int, ...]] | None = None

    @property
    def columns(self) -> dict[str, list]:
        """The op table: one list per field of ``schema.OP_FIELDS``, item ``i`` of each being op ``i``'s."""
        columns = self._columns
        if columns is None:
            # Two threads may both get here (the training thread and a sink's): each makes an equal table, or
            # finds the other's made meanwhile.
            pending = self._pending
            if pending is None:
                return self._columns
            columns = pending.make()
            # rows added since (log_backward on the trace it came from) are not this trace's
            if len(columns["index"]) > pending.n_ops:
                columns = {name: values[: pending.n_ops] for name, values in columns.items()}
            self._columns, self._pending = columns, None
        return columns

    @columns.setter
    def columns(self, columns: dict[str, list]) -> None:
        missing = [n for n in field_names(OP_FIELDS) if n not in columns]
        if missing:
            raise SchemaError(f"columns lacks schema fields {missing} (see tl_dist.schema.OP_FIELDS)")
        self._columns, self._pending = columns, None

    def without_tensors(self) -> Trace:
        """This trace's tables and metadata without any tensor: no saved outputs, gradients, replay records or
        output (what a sink with ``needs_tensors = False`` gets). The tables are shared, not copied.

        Example:
            >>> bare = trace.without_tensors()
            >>> len(bare) == len(trace), bare.saved, bare.output
            (True, {}, None)
        """
        # A table still to be made is made from the recorder, which holds the window's tensors: made now
        # unless there are none to keep alive (a telemetry window's), so the table is made off this thread.
        pending = self._pending
        holds_tensors = (
            self.saved or self.grads or self._replay or self.param_grads or self._output is not None
        )
        return Trace(
            pending if pending is not None and not holds_tensors else self.columns,
            self.module_table,
            collective_table=self.collective_table,
            output_of=self.output_of,
            metadata=self.metadata,
            failed_op=self.failed_op,
            stats_table=self.stats_table,
            interventions=self.interventions,
        )

    @property
    def output(self) -> Any:
        """What the traced model returned (``tl.trace``; None for a ``tl.capture`` window). Loaded from a
        shard, a leaf an op produced is that op's saved output (None when it was not saved)."""
        if self._output_leaves is not None:
            spec, leaves = self._output_leaves
            self._output_leaves = None
            self._output = spec.unflatten(
                [_saved_leaf(self.saved, v) if isinstance(v, dict) else v for v in leaves]
            )
        return self._output

    @output.setter
    def output(self, value: Any) -> None:
        self._output, self._output_leaves = value, None

    # -- container protocol --------------------------------------------------------------------------------
    def __len__(self) -> int:
        pending = self._pending
        return pending.n_ops if pending is not None else len(self.columns["index"])

    def __iter__(self) -> Iterator[Op]:
        return (Op(self, i) for i in range(len(self)))

    def __getitem__(self, key: int | str) -> Op:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"trace[...] takes an op index (int) or label (str), got {type(key).__name__}")
        if isinstance(key, str):
            index = self.labels.get(key)
            if index is None:
                close = difflib.get_close_matches(key, list(self.labels), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise KeyError(f"no op labelled {key!r} in this trace of {len(self)} ops{hint}")
            return Op(self, index)
        n = len(self)
        if not -n <= key < n:
            raise IndexError(f"op index {key} out of range for a trace of {n} ops")
        return Op(self, key % n)

    def __repr__(self) -> str:
        return f"<Trace {len(self)} ops, {len(self.module_table['address'])} module calls, {len(self.saved)} saved>"

    # -- run metadata (set by tl.arm windows and tl.load) ----------------------------------------------------
    @property
    def rank(self) -> int | None:
        """Global rank of the process that captured this trace (None when not recorded: unarmed capture)."""
        return self.metadata.get("rank")

    @property
    def world_size(self) -> int | None:
        """World size of the run that captured this trace (None when not recorded)."""
        return self.metadata.get("world_size")

    @property
    def step(self) -> int | None:
        """Training step (or window number) of the capture window (None when not recorded)."""
        return self.metadata.get("step")

    @property
    def edited(self) -> dict[str, str]:
        """Label -> the edits (``intervene=``) that replaced that op's output in this trace."""
        return self.metadata.get("edited", {})

    @property
    def labels(self) -> dict[str, int]:
        """Label -> op index."""
        if self._labels is None:
            self._labels = {label: i for i, label in enumerate(self.columns["label"])}
        return self._labels

    @property
    def children(self) -> list[tuple[int, ...]]:
        """For each op, the indices of the ops that read its output."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(len(self))]
            for i, parents in enumerate(self.columns["parents"]):
                for p in parents:
                    kids[p].append(i)
            self._children = [tuple(k) for k in kids]
        return self._children

    # -- modules -------------------------------------------------------------------------------------------
    def module_calls(self, address: str | None = None) -> list[ModuleCall]:
        """All calls of the module at ``address`` in call order (all module calls when ``address`` is None)."""
        table = self.module_table["address"]
        return [ModuleCall(self, r) for r, a in enumerate(table) if address is None or a == address]

    def module(self, address: str, *, call: int | None = None) -> ModuleCall:
        """One call of the module at ``address``: ``call`` (0 is the first), or the first call when omitted,
        with a warning saying so when the module was called more than once.

        Example:
            >>> trace.module("layer1.0.conv1").out.shape
            >>> trace.module("act", call=1).out   # the second call of a module used twice
        """
        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise ValueError(f"call must be None or a non-negative int (which call, from 0), got {call!r}")
        calls = self.module_calls(address)
        if not calls:
            known = sorted(set(self.module_table["address"]))
            close = difflib.get_close_matches(address, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"module {address!r} was not called in this trace{hint}")
        if call is None:
            if len(calls) > 1:
                warnings.warn(
                    f"trace.module({address!r}): the module was called {len(calls)} times; returning its first "
                    f"call (call=0). Pass call=0..{len(calls) - 1} for another, or use "
                    f"trace.module_calls({address!r}) for all",
                    UserWarning,
                    stacklevel=2,
                )
            return calls[0]
        if call >= len(calls):
            raise KeyError(
                f"module {address!r} was called {len(calls)} time(s) in this trace; call={call} is none"
            )
        return calls[call]

    # -- queries and views -----------------------------------------------------------------------------------
    def select(self, selector: Selector) -> list[Op]:
        """The ops ``selector`` matches, in execution order.

        Example:
            >>> trace.select(tl.func("relu") & tl.in_module("layer1"))
        """
        if not isinstance(selector, Selector):
            raise TypeError(f"select() expects a selector such as tl.func('relu'), got {selector!r}")
        return [op for op in self if selector.match(op)]

    @property
    def collectives(self) -> list[Any]:
        """The collectives in issue order, as :class:`tl_dist.collectives.Collective` views (group, seq, ...).

        Example:
            >>> [(c.func, c.seq, c.state) for c in trace.collectives]
        """

        return [Collective(self, r) for r in range(len(self.collective_table["op"]))]

    def log_backward(self, loss: torch.Tensor) -> Trace:
        """Run ``loss.backward()`` and record its ops (and gradients, per ``save_grads``) into this trace.

        Backward ops are appended after the forward ops; labels keep counting. ``loss`` must be built from
        ``trace.output`` or activations saved with ``keep_graph=True``.

        Example:
            >>> trace = tl.trace(model, x, save_grads=True)
            >>> trace.log_backward(loss_fn(trace.output, y))
            >>> trace["relu_2"].grad
        """
        if self._recorder is None:
            raise TlDistError(
                "log_backward needs a trace recorded in this process by tl.trace or tl.capture; "
                "a trace loaded from a shard cannot run backward"
            )
        for name, table in self._recorder.log_backward(loss).items():
            setattr(self, name, table)
        self._labels = None
        self._children = None
        return self

    def first_nonfinite(self, *, forward_inf: bool = False) -> Op | None:
        """The first op, in the order values were computed, whose output or gradient held a non-finite value
        (None if none did): NaN anywhere, +-Inf in gradients, and +-Inf in forward values only with
        ``forward_inf=True`` (attention masks fill scores with -inf on purpose).

        Uses the ``stats=`` table; without it, the saved outputs and gradients. The op's ``.module`` and
        ``.source`` say where it ran.

        Example:
            >>> with tl.capture(stats=True) as cap:
            ...     model(x).sum().backward()
            >>> op = cap.trace.first_nonfinite(); op.label, op.module, op.source
        """
        if not isinstance(forward_inf, bool):
            raise ValueError(f"forward_inf must be a bool, got {forward_inf!r}")
        index = first_nonfinite(self, forward_inf=forward_inf)
        return None if index is None else Op(self, index)


# -- statistics queries (moved from training.py, which records the table) -------------------------------
def nonfinite_value(of: str, phase: str, nan: int, inf: int, *, forward_inf: bool = False) -> bool:
    """Whether a recorded value (a stats-table row: ``of``, the op's ``phase``, its NaN and Inf counts) counts as
    non-finite: NaN always; +-Inf in gradients and in backward / optimizer ops' outputs (a backward op's output
    is a gradient too), in forward values (recomputation repeats them) only with ``forward_inf``.

    Example:
        >>> nonfinite_value("out", "forward", nan=0, inf=12)  # an attention mask's -inf
        False
        >>> nonfinite_value("grad", "forward", nan=0, inf=1)
        True
    """
    if nan:
        return True
    return bool(inf) and (forward_inf or not (of == "out" and phase in ("forward", "recompute")))


def first_nonfinite(trace: Trace, *, forward_inf: bool = False) -> int | None:
    """Index of the first op, in the order values were computed, whose output or gradient held a non-finite
    value; None if none did. NaN counts everywhere, +-Inf in gradients (and in backward and optimizer ops'
    outputs); +-Inf in forward values only with
    ``forward_inf`` (attention masks fill scores with -inf on purpose: GPT-2's sdpa mask, T5's position
    buckets)."""
    table = trace.stats_table
    if table["op"]:
        best: tuple[int, int] | None = None
        phases = trace.columns["phase"]
        for op, of, at, nan, inf in zip(table["op"], table["of"], table["at"], table["nan"], table["inf"]):
            if nonfinite_value(of, phases[op], nan, inf, forward_inf=forward_inf) and (
                best is None or at < best[0]
            ):
                best = (at, op)
        return None if best is None else best[1]
    if not trace.saved and not trace.grads:
        raise TlDistError(
            "first_nonfinite needs values to inspect: capture with stats=True (cheap) or save=/save_grads="
        )
    # No statistics: inspect saved outputs in op order, then saved gradients (computed later, in backward).
    for index in sorted(trace.saved):
        if any(_nonfinite(t, inf=forward_inf) for t in trace.saved[index]):
            return index
    for index in sorted(trace.grads, reverse=True):  # backward visits the last forward op first
        if any(_nonfinite(t, inf=True) for t in trace.grads[index]):
            return index
    return None


def _nonfinite(t: Tensor | None, *, inf: bool) -> bool:
    if t is None or t.dtype not in _FLOATS:
        return False
    return not bool(torch.isfinite(t).all()) if inf else bool(torch.isnan(t).any())


def op_stats(trace: Trace, index: int) -> dict[str, dict[str, float]]:
    """``{"out": {...}, "grad": {...}}`` for op ``index`` (keys present only when recorded)."""
    table = trace.stats_table
    ops = table["op"]
    # op -> rows, built once per table (log_backward replaces the table, so the cache key is the list).
    cached = getattr(trace, "_stats_rows", None)
    if cached is None or cached[0] is not ops or cached[1] != len(ops):
        rows: dict[int, list[int]] = {}
        for k, op in enumerate(ops):
            rows.setdefault(op, []).append(k)
        cached = trace._stats_rows = (ops, len(ops), rows)
    return {table["of"][k]: {name: table[name][k] for name in _STAT_NAMES} for k in cached[2].get(index, ())}
