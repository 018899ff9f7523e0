"""Replay, fork and rerun: a trace's forward graph re-executed with edits.

- :func:`replay` runs the recorded forward ops again, without the model's code: each op is called with the
  arguments it was recorded with, its tensor inputs taken from the replayed outputs of the ops it read (the
  recorder's replay records, the same ones ``validate()`` uses) and its parameters and inputs as recorded.
  Edits (``tl.when``) are applied where the capture would apply them: an op-site edit right after the op, a
  module-site edit when the module's call ends (ops inside the call still see the unedited value, as with a
  forward hook). In-place ops write into the replayed tensors, so views and aliases behave as in the model.
- What a replay cannot know it reports instead of guessing, in the new trace's ``metadata["not_replayed"]``
  (label -> why): a value read on the host (``.item()``, ``bool(t)``, an ``if`` on a tensor) that depends on
  the edits -- the model's code may branch differently there; random ops and collectives, whose recorded
  outputs are reused; an output whose shape the edits changed (data-dependent shapes).
- :class:`Fork` collects edits (``trace.fork().do(site, edit)``) for :meth:`Fork.replay` or
  :meth:`Fork.rerun` (the model run again with them, through ``tl.trace``).

Example:
    >>> trace = tl.trace(model, x)
    >>> assert torch.equal(trace.replay().output, trace.output)
    >>> edited = trace.fork().do(tl.module("layer2"), tl.zero_ablate()).replay()
    >>> edited.metadata["not_replayed"]
    {}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_unflatten

from ._common import RowView, arg_tensors, clone_strided, flat_outputs, storage_key
from ._opinfo import draws_random, mutated_tensors, op_info
from ._reexec import fill_args
from .capture import trace as tl_trace
from .causal import selector_parts
from .edits import Edit, Site, When, check_result, when
from .errors import TlDistError
from .schema import OP_FIELDS, field_names
from .selectors import Selector, label, module

if TYPE_CHECKING:
    from .trace import Trace

Tensor = torch.Tensor
_NAMES = field_names(OP_FIELDS)

_HOST_READ = (
    "reads a value on the host (.item(), bool(tensor), an if on a tensor) that depends on the edits: the "
    "model's code may take another path from here; rerun(model, x) runs it"
)


class Fork:
    """Edits to replay or rerun a trace with: ``trace.fork().do(site, edit)`` (starts from the trace's own edits).

    Example:
        >>> fork = trace.fork().do("relu_2", tl.zero_ablate()).do(tl.module("fc"), tl.scale(2.0))
        >>> replayed, rerun = fork.replay(), fork.rerun(model, x)
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.interventions: list[When] = list(trace.interventions)

    def do(self, site: str | int | Selector, edit: Edit | Callable, *, output: int | str = 0) -> Fork:
        """Add an edit at ``site``: an op label (``"relu_2"``), an op index, or a selector (``tl.module(...)`` for a
        module's output; ``tl.downstream(...)`` and other selectors are resolved against this trace's ops).
        ``output`` as in :func:`tl_dist.when`. Returns the fork, so calls chain."""
        self.interventions.append(when(_site_selector(self.trace, site), edit, output=output))
        return self

    def replay(self) -> Trace:
        """The recorded forward graph re-executed with the fork's edits (see :func:`replay`)."""
        return replay(self.trace, tuple(self.interventions))

    def rerun(
        self, model: torch.nn.Module, inputs: Any, *, kwargs: dict[str, Any] | None = None, save: Any = True
    ) -> Trace:
        """``tl.trace(model, inputs, intervene=<the fork's edits>)``: the model's code run again with the edits, in
        the grad mode the trace was captured in (as :meth:`replay`): under ``torch.no_grad()`` fused kernels take
        other paths than with autograd recording (MultiheadAttention's fast path), and the ops would not line up.
        """
        with capture_grad_mode(self.trace):
            return tl_trace(
                model, inputs, kwargs=kwargs, save=save, intervene=list(self.interventions) or None
            )

    def __repr__(self) -> str:
        return f"<Fork of a {len(self.trace)}-op trace, {len(self.interventions)} edit(s)>"


def capture_grad_mode(trace: Trace) -> Any:
    """A context running code in the grad mode ``trace``'s window started in (its ``metadata["grad_enabled"]``):
    kernels take other paths with grad on (mkldnn_rnn_layer keeps a workspace; MultiheadAttention leaves its fast
    path), so replay and rerun repeat it. The caller's mode for a trace that does not say (a loaded one)."""
    grad = trace.metadata.get("grad_enabled")
    return contextlib.nullcontext() if grad is None else torch.set_grad_enabled(bool(grad))


def _site_selector(trace: Trace, site: Any) -> Any:
    if site is True:
        return True
    if isinstance(site, str) or (isinstance(site, int) and not isinstance(site, bool)):
        return label(trace[site].label)  # trace[...] raises naming close labels / the valid range
    if not isinstance(site, Selector):
        raise ValueError(f"site must be an op label, an op index or a selector; got {site!r}")
    parts = list(selector_parts(site))
    if not any(getattr(p, "needs_trace", False) for p in parts):
        return site
    if any(isinstance(p, module) for p in parts):
        raise ValueError(
            f"site {site!r}: a causal selector (tl.upstream/tl.downstream) cannot be combined with tl.module; "
            "select the module's output op by label instead"
        )
    labels = [op.label for op in trace.select(site)]
    if not labels:
        raise ValueError(f"site {site!r} matches no op of this trace")
    return label(*labels)


def replay(trace: Trace, interventions: tuple[When, ...] = ()) -> Trace:
    """Re-execute ``trace``'s forward ops with ``interventions``; a new trace with the replayed outputs.

    Args:
        trace: a trace recorded in this process with every output saved (``tl.trace``'s default ``save=True``).
        interventions: ``tl.when(...)`` edits, applied in order.

    Returns:
        A :class:`~tl_dist.trace.Trace` with the same ops, the replayed values as saved outputs, ``output``
        rebuilt from them, ``metadata["edited"]`` and ``metadata["not_replayed"]`` (label -> why).

    Raises:
        TlDistError: the trace lacks replay records (saved with ``save=None`` or a selector, or loaded), or an
            op failed to run.
    """
    records = trace._replay
    cols = trace.columns
    phases, out_shapes = cols["phase"], cols["out_shapes"]
    forward = [i for i in range(len(trace)) if phases[i] == "forward"]
    missing = [i for i in forward if out_shapes[i] and i not in records]
    if missing or (forward and not records):
        first = cols["label"][missing[0]] if missing else cols["label"][forward[0]]
        raise TlDistError(
            f"replay needs every forward op's inputs, recorded when all outputs are saved: {len(missing)} ops "
            f"lack them (first {first}). Trace again in this process with save=True (tl.trace's default); a "
            "trace captured with save=None or a selector, or loaded from a shard, cannot be replayed"
        )
    run = _Replay(trace, interventions)
    # No graph is built in either grad mode: the constants are detached and the replayed values start from them.
    with capture_grad_mode(trace):
        run.all(forward)
        saved = run.produced()
    output = _output(trace, saved)
    metadata = dict(trace.metadata)
    labels = cols["label"]
    metadata["edited"] = {labels[i]: "; ".join(e) for i, e in sorted(run.edited.items())}
    metadata["not_replayed"] = run.not_replayed
    return type(trace)(
        dict(cols),
        trace.module_table,
        collective_table=trace.collective_table,
        saved=saved,
        replay_records=records,
        output_of=trace.output_of,
        out_trees=trace.out_trees,
        output=output,
        metadata=metadata,
        interventions=interventions,
    )


class _Replay:
    """The state of one replay: values per op, which ops the edits may have changed, what was not replayed."""

    def __init__(self, trace: Trace, interventions: tuple[When, ...]) -> None:
        self.trace = trace
        self.cols = trace.columns
        self.op_rules = [w for w in interventions if not w.module_site]
        self.module_rules = [w for w in interventions if w.module_site]
        self.values: dict[int, list[Tensor | None]] = {}
        self.returned: dict[int, int] = {}  # op -> outputs it returned (the rest: bases it wrote into)
        # The values the replay computes with are live tensors an in-place op may write into later; the values it
        # reports are those the ops produced (copy-before-write, as the recorder keeps saved outputs).
        self._in_storage: dict[int, list[tuple[int, int]]] = {}  # storage -> (op, output) of values in it
        self._produced: dict[tuple[int, int], Tensor] = {}  # (op, output) -> its value before a later write
        self.changed: set[int] = set()  # ops whose value may differ from the recording
        self.edited: dict[int, list[str]] = {}
        self.not_replayed: dict[str, str] = {}
        table = trace.module_table
        # Module calls in the order their post-hooks ran: by end, inner (later-starting) calls first.
        self.ends = sorted(range(len(table["address"])), key=lambda r: (table["end_op"][r], -r))
        self.ends = self.ends if self.module_rules else []

    def row(self, i: int) -> tuple:
        cols = self.cols
        return tuple([cols[name][i] for name in _NAMES])

    def all(self, forward: list[int]) -> None:
        ends, end_op, k = self.ends, self.trace.module_table["end_op"], 0
        for i in forward:
            while k < len(ends) and end_op[ends[k]] <= i:
                self.module_end(ends[k])
                k += 1
            self.op(i)
        for row in ends[k:]:
            self.module_end(row)

    def op(self, i: int) -> None:
        cols, labels = self.cols, self.cols["label"]
        record = self.trace._replay.get(i)
        for src in record[3] if record is not None else ():
            if src is not None and src[0] not in self.values:
                self.reuse(src[0], i)
        affected = any(p in self.changed for p in cols["parents"][i])
        if record is None:  # no tensor output: a host read, an assert, a profiler marker
            if affected and cols["kind"][i] != "view" and cols["in_shapes"][i]:
                self.not_replayed[labels[i]] = _HOST_READ
            return
        func, skeleton_args, skeleton_kwargs, srcs, consts = record
        info = op_info(func)
        communicates = info.kind == "collective" or getattr(func, "communicates", False)
        if communicates or draws_random(info, func, skeleton_args, skeleton_kwargs):
            why = "collective (it needs every member rank)" if communicates else "random op"
            self.not_replayed[labels[i]] = f"{why}: its recorded output is reused"
            self.values[i] = [None if t is None else t.clone() for t in self.trace.saved.get(i, ())]
            self.returned[i] = len(self.values[i])
        else:
            self.values[i] = self.run(i, func, info, skeleton_args, skeleton_kwargs, srcs, consts, affected)
        self.index_storage(i)
        if affected:
            self.changed.add(i)
            got = tuple(tuple(t.shape) for t in self.values[i] if t is not None)
            if got != tuple(tuple(s) for s in cols["out_shapes"][i][: len(got)]):
                self.not_replayed[labels[i]] = (
                    "its output shape changed with the edits (a data-dependent shape): later ops' recorded "
                    "arguments may not fit; rerun(model, x) runs the model's code"
                )
        if self.op_rules and cols["phase"][i] == "forward":
            self.op_edits(i, info)

    def run(
        self,
        i: int,
        func: Any,
        info: Any,
        skeleton_args: tuple,
        skeleton_kwargs: dict,
        srcs: list,
        consts: list,
        affected: bool,
    ) -> list[Tensor | None]:
        values, parents = self.values, self.cols["parents"][i]
        originals = arg_tensors(skeleton_args, skeleton_kwargs)
        tensors: list[Tensor] = []
        # id of the tensor the model passed -> the recorded constant standing for it
        external: dict[int, Tensor] = {}
        for k, (src, const) in enumerate(zip(srcs, consts)):
            if src is not None:
                tensors.append(values[src[0]][src[1]])
                continue
            alias = self.alias(const, parents) if affected else None
            if alias is not None:
                tensors.append(alias)
                continue
            # One object per tensor the model passed: kernels take other paths when arguments are the same
            # tensor (self-attention's query is key is value).
            if id(originals[k]) not in external:
                external[id(originals[k])] = const.detach() if const.requires_grad else const
            tensors.append(external[id(originals[k])])
        external_ids = {id(t) for t in external.values()}
        args, kwargs = fill_args(skeleton_args, skeleton_kwargs, tensors)
        written = mutated_tensors(info, args, kwargs) if info.mutated else []
        if any(id(t) in external_ids for t in written):
            # Never write into the model's parameters or the trace's constants: into copies.
            copies = {id(t): clone_strided(t) for t in written if id(t) in external_ids}
            tensors = [copies.get(id(t), t) for t in tensors]
            args, kwargs = fill_args(skeleton_args, skeleton_kwargs, tensors)
            written = mutated_tensors(info, args, kwargs)
        if written:
            self.before_write(written)
        try:
            raw = func(*args, **kwargs)
        except Exception as exc:
            label = self.cols["label"][i]
            raise TlDistError(
                f"replay of {label} ({self.cols['aten'][i]}) failed: {type(exc).__name__}: {exc}. The edits may "
                "have changed what this op receives; rerun(model, x) runs the model's code instead"
            ) from exc
        outs: list[Tensor | None] = list(flat_outputs(raw))
        # Outputs a kernel leaves undefined (None: mkldnn_rnn_layer's workspace without grad) are absent, as in
        # the recorder's list: the same op gets the same outputs in a trace and its replay.
        self.returned[i] = len(outs)
        n_recorded = len(self.cols["out_shapes"][i])
        # An in-place write into a view: its base is an extra output (Recorder._with_written_bases).
        for t in written:
            base = t._base
            if len(outs) >= n_recorded:
                break
            if base is not None and not any(base is o for o in outs):
                outs.append(base)
        return outs

    def reuse(self, p: int, reader: int) -> None:
        """Op ``p``, not a forward op (replay runs those only), feeds forward op ``reader``: a gradient
        ``torch.autograd.grad(..., create_graph=True)`` computed inside ``forward`` (a MAML inner step). Its
        recorded value is reused, and listed in ``not_replayed`` (stale when the edits changed what it was
        computed from: then it counts as changed, so what reads it is flagged too)."""
        labels = self.cols["label"]
        saved = self.trace.saved.get(p)
        if saved is None:
            raise TlDistError(
                f"replay of {labels[reader]} needs the output of {labels[p]} ({self.cols['phase'][p]} phase), "
                "which replay does not re-execute, and the trace did not save it: trace with save=True"
            )
        self.values[p] = [None if t is None else t.clone() for t in saved]
        self.returned[p] = len(saved)
        self.index_storage(p)
        why = (
            f"computed by autograd ({self.cols['phase'][p]} phase) inside the forward (torch.autograd.grad): "
            "its recorded value is reused"
        )
        if self._from_changed(p, {}):
            self.changed.add(p)
            why += ", although the edits changed what it was computed from; rerun(model, x) recomputes it"
        self.not_replayed[labels[p]] = why

    def _from_changed(self, p: int, seen: dict[int, bool]) -> bool:
        """Whether a value replay does not re-execute was computed from one the edits changed (through other
        such values: the backward graph between them)."""
        if p not in seen:
            seen[p] = False  # a cycle cannot occur (parents come first); this only bounds the walk
            phases, values = self.cols["phase"], self.values
            seen[p] = any(
                q in self.changed
                or (phases[q] != "forward" and q not in values and self._from_changed(q, seen))
                for q in self.cols["parents"][p]
            )
        return seen[p]

    def alias(self, const: Tensor, parents: tuple[int, ...]) -> Tensor | None:
        """For an argument recorded as a constant although an in-place op of the trace wrote its memory before (read
        through an alias after the write: ``v = y.view(-1); y.relu_(); v * 2``): the same view of that op's replayed
        output. None for a true constant (a parameter, an input)."""
        key = storage_key(const)
        if key is None:
            return None
        records, inplace = self.trace._replay, self.cols["inplace"]
        for p in reversed(parents):
            if not inplace[p] or p not in records or not self.values.get(p):
                continue
            func, args, kwargs = records[p][:3]
            if any(storage_key(w) == key for w in mutated_tensors(op_info(func), args, kwargs)):
                return self.values[p][0].as_strided(const.shape, const.stride(), const.storage_offset())
        return None

    def index_storage(self, i: int) -> None:
        for pos, t in enumerate(self.values[i]):
            key = storage_key(t) if t is not None else None
            if key is not None:
                self._in_storage.setdefault(key, []).append((i, pos))

    def before_write(self, written: list[Tensor], keep: tuple[int, int] | None = None) -> None:
        """Keep the current value of every earlier output in the memory an in-place write is about to change."""
        for t in written:
            key = storage_key(t)
            for entry in self._in_storage.pop(key, ()):
                if entry != keep and entry not in self._produced:
                    self._produced[entry] = self.values[entry[0]][entry[1]].clone()
            if keep is not None:
                self._in_storage.setdefault(key, []).append(keep)

    def produced(self) -> dict[int, list[Tensor | None]]:
        """Each op's outputs as it produced them (the live value, or the copy taken before a later write)."""
        saved = {i: list(outs) for i, outs in self.values.items()}
        for (i, pos), value in self._produced.items():
            saved[i][pos] = value
        return saved

    def op_edits(self, i: int, info: Any) -> None:
        view = RowView(self.row(i))
        outs = self.values[i]
        for rule in self.op_rules:
            if rule.selector is not True and not rule.selector.match(view):
                continue
            for pos in rule.positions(self.returned[i], self.cols["label"][i]):
                value = outs[pos]
                new = check_result(rule.edit(value, Site(view, pos)), value, Site(view, pos), rule.edit)
                if info.mutated:
                    self.before_write([value], keep=(i, pos))
                    value.copy_(new)
                else:
                    outs[pos] = new
                self.note(i, rule)

    def module_end(self, row: int) -> None:
        table = self.trace.module_table
        tree = self.trace.out_trees.get(row)
        if tree is None:
            return
        address = table["address"][row]
        tensor_k = -1
        for leaf, op, pos in zip(tree[1], table["out_ops"][row], table["out_pos"][row]):
            if op < 0:
                tensor_k += isinstance(leaf, Tensor)
                continue
            tensor_k += 1
            if op not in self.values:
                continue
            view = RowView(self.row(op), (address,))
            for rule in self.module_rules:
                if rule.selector.match(view) and (rule.output == "all" or rule.output == tensor_k):
                    value = self.values[op][pos]
                    site = Site(view, pos)
                    self.values[op][pos] = check_result(rule.edit(value, site), value, site, rule.edit)
                    self.note(op, rule)

    def note(self, i: int, rule: When) -> None:
        self.edited.setdefault(i, []).append(repr(rule.edit))
        self.changed.add(i)


def _output(trace: Trace, values: dict[int, list]) -> Any:
    """The model's output (``tl.trace``'s root call) rebuilt from replayed values; None for capture windows."""
    if trace.output is None:
        return None
    table = trace.module_table
    root = next((r for r in range(len(table["address"])) if table["parent"][r] < 0), None)
    tree = trace.out_trees.get(root) if root is not None else None
    if tree is None:
        return None
    spec, leaves = tree
    rebuilt = []
    for leaf, op, pos in zip(leaves, table["out_ops"][root], table["out_pos"][root]):
        rebuilt.append(leaf if op < 0 else values.get(op, [None] * (pos + 1))[pos])
    return tree_unflatten(rebuilt, spec)
