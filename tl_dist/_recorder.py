"""The per-op hot path of a capture: turns each dispatched op into one row of the trace table.

Cost matters here more than anywhere: every ATen op of the user's model passes through :meth:`Recorder.on_op`.
Rows are tuples in ``schema.OP_FIELDS`` order (one append per op), transposed into columns once at the end.
Tensors are identified by a tag attribute ``_tl_src = (capture token, op index, output position)`` set on each
output, so identity survives ``id()`` reuse and in-place ops simply re-tag their output.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Any

import torch

from ._common import (
    DEVICE_NAMES,
    DTYPE_NAMES,
    RowView,
    arg_tensors,
    device_name,
    dtype_name,
    flat_outputs,
    shape_of,
)
from ._common import FIELD_INDEX as _FIELD_INDEX
from ._common import TAG as _TAG
from ._fastpath import available, module_hooks, rows_to_columns
from ._kept import KeptValues
from ._modes import CaptureMode, SubclassMode
from ._modules import ModuleTracker
from ._opinfo import OPINFO_CACHE, flop_count, mutated_tensors, op_info
from ._phases import SPECIAL as _SPECIAL_PHASE
from ._phases import PhaseTracker, accumulating_param
from ._source import SourceLocator
from .collectives import CollectiveLog
from .errors import TlDistError
from .schema import OP_FIELDS, field_names
from .training import TrainingState, backward_link

Tensor = torch.Tensor
# The captures running now (at most one: windows do not nest); capture.py pushes and pops, arm's post-mortem reads.
ACTIVE: list[Any] = []
_perf_ns = time.perf_counter_ns
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_node_seq_now = torch._C._autograd._get_sequence_nr  # the autograd node counter of this thread
# Row values are plain tuples of ints and strs (shapes as tuples, not torch.Size; an int capture token in tags)
# so that CPython's GC untracks them: a long capture then leaves no pile of containers for a full collection.
_TOKENS = itertools.count(1)

_MODULE = _FIELD_INDEX["module"]
_MODULE_STACK = _FIELD_INDEX["module_stack"]


class Recorder(KeptValues):
    """Owns the rows, saved tensors and module tracker of one capture."""

    # The state every op reads and writes: slots, which the compiled path (_csrc) reads at a fixed offset in
    # the object instead of looking each name up in the instance dict; the rest stays in __dict__.
    __slots__ = (
        "n_ops",
        "phase",
        "pending",
        "edits",
        "_last_write",
        "step_source",
        "writes_generation",
        "__dict__",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        save: Any,
        keep_graph: bool,
        source: bool,
        roots: list[tuple[str, torch.nn.Module]],
        save_grads: Any = None,
        stats: Any = None,
    ) -> None:
        self.rows: list[tuple] = []
        self.n_ops = 0
        self.token = next(_TOKENS)
        self.phase = "forward"
        self.save_all = save is True
        self.save_selector = None if save is True or save is None else save
        self.saving = save is not None  # True or a selector: outputs may be kept
        self.keep_graph = keep_graph
        self.saved: dict[int, list[Tensor | None]] = {}
        self.replay_records: dict[int, tuple[Any, tuple, dict, list, list]] = {}
        self.edits: Any = None  # tl_dist._intervene.Interventions while a window has op-site edits
        self.output_of: dict[int, list[str]] = {}
        self._storage_refs: dict[int, list[tuple[int, int, int]]] = {}
        # storage address -> (op, first byte, end byte) of each in-place write into it, and a weak reference to
        # the storage those writes went to: the caching allocator hands a freed buffer's address to the next
        # tensor, and writes into the dead storage say nothing about the new one's value.
        self._writes: dict[int, list[tuple[int, int, int]]] = {}
        self._written_storage: dict[int, weakref.ref] = {}
        self._last_write = -1  # index of the latest in-place op
        # Counts the write log's additions made here: the compiled path's address filter over the log
        # (_csrc/writes.c, written_spans) is rebuilt when it moves.
        self.writes_generation = 0
        self._label_counts: dict[str, int] = {}
        # TL_DIST_PURE_PYTHON, read once per window (the environment lookup costs ~10 us with cold caches).
        self.compiled = available()
        self.modules = ModuleTracker(self, roots, compiled_hooks=module_hooks() if self.compiled else None)
        self._backward_sources: dict[int, str] = {}  # autograd graph task -> where backward() was called
        self.locate = SourceLocator(self.modules) if source else None
        self.params = self.modules.params
        self.cuda_events: list[tuple[int, Any, Any]] = []
        self.failed_op: dict[str, Any] | None = None
        self._comm: CollectiveLog | None = None  # made at the first collective (most windows have none)
        # Made at the first subclass op (most windows have none).
        self._subclass_mode: SubclassMode | None = None
        # Training (tl_dist.training): phase hooks, backward links, gradients, statistics.
        self.pending: tuple[tuple, list[Tensor]] | None = None
        # Forward ops linked to their autograd node by its sequence number (training.py, "backward -> forward").
        self.node_ops: dict[int, int] = {}
        # The sequence numbers of the nodes tagged in their metadata (training.tag_node).
        self.tagged_nodes: set[int] = set()
        self.seq_floor = _node_seq_now()
        self.training = TrainingState(self, save_grads=save_grads, stats=stats)
        self.phases = PhaseTracker(self)
        self.step_source: str | None = None  # where the running optimizer.step() was called
        self.stats_on = stats is not None
        self.clock_offset_ns = time.time_ns() - _perf_ns()

    @property
    def comm(self) -> CollectiveLog:
        """The window's collectives (made when first asked for: :attr:`collective_rows` does not make it)."""
        log = self._comm
        if log is None:
            log = self._comm = CollectiveLog(self)
        return log

    @property
    def collective_rows(self) -> list:
        """The collective table's rows so far (none, without making the log, when no collective ran)."""
        return self._comm.rows if self._comm is not None else []

    # -- the hot path -------------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple, kwargs: dict, subclass: bool = False) -> Any:
        cached = OPINFO_CACHE.get(id(func))  # by id: OpOverload's __hash__ is Python code
        info = cached[1] if cached is not None and cached[0] is func else op_info(func)
        if self.pending is not None:  # the previous op's outputs now have their grad_fn
            self.training.link_pending()
        if info.tensor_lists:
            tensors = arg_tensors(args, kwargs)
        else:
            tensors = [a for a in args if isinstance(a, Tensor)]
            if kwargs:
                tensors += [a for a in kwargs.values() if isinstance(a, Tensor)]

        token = self.token
        parents: dict[int, None] = {}
        param_names: list[str] = []
        # Where each input's value comes from (op, output position), for replay; only when outputs may be saved.
        srcs: list[tuple[int, int] | None] | None = [] if self.saving else None
        writes = self._writes
        for t in tensors:
            tag = getattr(t, _TAG, None)
            if tag is not None and tag[0] == token:
                parents[tag[1]] = None
                if writes and self._last_write > tag[1] and (writer := self._written_since(t, tag[1])) >= 0:
                    # An alias of t was written in place after t was made (v = y.view(..); y.relu_(); v * 2):
                    # t's value now comes from that write, and t's producer no longer holds it.
                    parents[writer] = None
                    if srcs is not None:
                        srcs.append(None)
                elif srcs is not None:
                    srcs.append((tag[1], tag[2]))
            else:
                if srcs is not None:
                    srcs.append(None)
                name = self.params.get(id(t))
                if name is not None:
                    param_names.append(name)
                if writes and (writer := self._written_since(t, -1)) >= 0:
                    parents[writer] = None  # e.g. a parameter the optimizer updated earlier in the window

        if self.stats_on and self.training.in_flight:  # reading a collective's buffer: its result is there
            for p in parents:
                self.training.arrived(p, reader=True)
        grad_on = _grad_enabled()  # an op cannot change it: read once
        if subclass and self.comm.unlinked >= 0 and grad_on:
            # The first subclass op since a forward collective: the autograd nodes between them (DTensor's
            # redistribution) have no op; their backward collectives belong to that collective's module.
            self.training.link_unowned(tensors, self.comm.unlinked)
            self.comm.unlinked = -1
        inplace = bool(info.mutated)
        pre_write = None
        if inplace:
            written = mutated_tensors(info, args, kwargs)
            pre_write = self._before_write(written, tensors, srcs)

        # The op's autograd node, if it makes one, is numbered before this dispatch: the counter minus one.
        task = _graph_task_id()  # -1 outside the autograd engine
        by_number = (
            grad_on
            and task == -1
            and not (
                inplace
                or subclass
                or self.training.hooks_on
                or self.edits is not None
                or info.comm is not None
            )
        )
        number = _node_seq_now() - 1 if by_number else -1

        # Device time from CUDA events, except for views: they launch no kernel, and two events cost more host
        # time than the view itself (~40% of a transformer step's ops are views).
        cuda = tensors and tensors[0].is_cuda and info.kind != "view"
        if cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        t0 = _perf_ns()
        try:
            if subclass:
                if self._subclass_mode is None:
                    self._subclass_mode = SubclassMode(self)
                with self._subclass_mode:
                    out = info.call(*args, **kwargs)
            else:
                out = info.call(*args, **kwargs)
        except BaseException as exc:
            if not (subclass and self.failed_op is not None):  # else a collective inside it failed: keep that
                self._record_failure(info, exc)
            raise
        t1 = _perf_ns()
        # Numbered after it ran: a subclass's dispatch records the collectives it issued as ops before this one.
        index = self.n_ops
        if cuda:
            end_event.record()
            self.cuda_events.append((index, start_event, end_event))

        outs: list[Tensor] = [out] if isinstance(out, Tensor) else flat_outputs(out)
        if inplace:
            self._note_writes(index, written)
            if outs:
                outs = self._with_written_bases(written, outs)

        n = self._label_counts.get(info.func, 0) + 1
        self._label_counts[info.func] = n
        if outs:
            first = outs[0]
            dtype = DTYPE_NAMES.get(first.dtype) or dtype_name(first.dtype)
            device = "cpu" if first.is_cpu else DEVICE_NAMES.get(first.device) or device_name(first.device)
            if len(outs) == 1:
                out_bytes = first.nelement() * first.element_size()
                link = (token, index, 0)  # its tag, and the link of its autograd node (see link_pending)
                setattr(first, _TAG, link)
            else:
                out_bytes = 0
                for pos, o in enumerate(outs):
                    out_bytes += o.nelement() * o.element_size()
                    setattr(o, _TAG, (token, index, pos))
                link = (token, index)
            kind = info.kind if tensors or info.kind == "collective" else "factory"
        else:
            dtype = device = ""
            out_bytes = 0
            link = (token, index)  # a collective's outputs may still come (the tensors c10d wrote)
            kind = info.kind if info.kind == "collective" else "other"
        out_shapes = None
        if not subclass:
            try:
                in_shapes = tuple([tuple(t.shape) for t in tensors])
                out_shapes = (
                    (tuple(outs[0].shape),) if len(outs) == 1 else tuple([tuple(o.shape) for o in outs])
                )
            except RuntimeError:  # a nested tensor: its ragged dimensions have no size
                pass
        if out_shapes is None:  # that, or a subclass with symbolic sizes (a jagged nested tensor): plain ints
            in_shapes = tuple([shape_of(t) for t in tensors])
            out_shapes = tuple([shape_of(o) for o in outs])
        flops = 0 if info.flop_fn is None else flop_count(info, args, kwargs, out)
        modules = self.modules
        if task == -1:
            phase, fwd_op = self.phase, -1
            if info.func in _SPECIAL_PHASE:
                phase = self.phases.special(info.func, args, phase)
            address, stack, call = modules.current_address, modules.address_stack, modules.current_call
            if info.kind == "collective" and (owner := modules.hook_owner()) is not None:
                address, stack, call = owner  # issued by a module's own forward hook, after its call ended
            if self.locate is None:
                source = ""
            elif modules.current_builtin:  # inside nn.Linear & co: no user frame below its call site
                source = modules.current_source
            elif phase == "optimizer" and self.step_source is not None:  # every op of one step() call
                source = self.step_source
            else:
                source = self.locate()
        elif grad_on and (recomputed := modules.recomputed()) is not None:
            # Checkpoint recomputation: forward code run again by the engine; its module is the forward call's.
            phase, fwd_op, call = "recompute", -1, -1
            address, stack = recomputed
            source = self.locate() if self.locate is not None else ""
        else:
            phase, fwd_op, call = "backward", backward_link(self), -1
            if fwd_op >= 0:  # the module of the forward op this op differentiates
                forward_row = self.rows[fwd_op]
                address, stack = forward_row[_MODULE], forward_row[_MODULE_STACK]
            else:
                address, stack = modules.owner_of(accumulating_param())
            # Every op of one backward pass has the same Python stack above the engine: the .backward() call.
            source = self._backward_sources.get(task)
            if source is None:
                source = self.locate() if self.locate is not None else ""
                self._backward_sources[task] = source
        row = (
            index,
            f"{info.func}_{n}",
            info.func,
            info.aten,
            kind,
            phase,
            fwd_op,
            address,
            stack,
            call,
            out_shapes,
            dtype,
            device,
            out_bytes,
            in_shapes,
            tuple(parents),
            inplace,
            flops,
            t0,
            t1 - t0,
            source,
            tuple(param_names),
        )
        self.rows.append(row)
        if self.edits is not None:  # interventions (tl_dist._intervene) may replace the outputs
            out, outs = self.edits.on_op(index, row, info, out, outs, tensors)
        if info.comm is not None:  # collectives: the collective table, and the tensors c10d wrote in place
            outs = self.comm.record(index, info.comm, args, kwargs, out, outs, t0, t1)
        if outs:
            if by_number:
                if number >= self.seq_floor and number not in self.node_ops:  # else made no node of its own
                    self.node_ops[number] = index
            elif grad_on:
                self.pending = (link, outs)
            if self.stats_on:
                self.training.out_stats(index, outs, row)
        self.n_ops = index + 1

        if self.saving and outs:
            self._save_op(index, row, outs, func, args, kwargs, tensors, srcs, pre_write)
        return out

    def module_output(self, address: str, leaves: list) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Called when a module call returns: which ops produced its output leaves; saves them if selected."""
        token = self.token
        ops: list[int] = []
        poss: list[int] = []
        # The last op's outputs are linked first: a leaf's node the loop then finds unlinked is not that op's.
        if self.pending is not None:
            self.training.link_pending()
        for leaf in leaves:
            tag = getattr(leaf, _TAG, None) if isinstance(leaf, Tensor) else None
            if tag is None or tag[0] != token:
                ops.append(-1)
                poss.append(-1)
                continue
            index, pos = tag[1], tag[2]
            if leaf.requires_grad:
                self.training.link_module_output(leaf, tag)
            ops.append(index)
            poss.append(pos)
            modules_out = self.output_of.setdefault(index, [])
            if address not in modules_out:  # several output leaves of one module from one op count once
                modules_out.append(address)
            self.training.module_out_stats(index, leaf)
            selector = self.save_selector
            if selector is not None and index not in self.saved:
                view = RowView(self.rows[index], tuple(self.output_of[index]))
                if selector.match(view):
                    # The leaf still holds the op's value: a later in-place op would have re-tagged it.
                    n_out = len(self.rows[index][_FIELD_INDEX["out_shapes"]])
                    saved: list[Tensor | None] = [None] * n_out
                    saved[pos] = leaf if self.keep_graph else leaf.detach()
                    self.saved[index] = saved
                    self.watch(leaf, (index, 0, pos))
        return tuple(ops), tuple(poss)

    def _record_failure(self, info: Any, exc: BaseException) -> None:
        modules = self.modules
        self.failed_op = {
            "index": self.n_ops,
            "func": info.func,
            "aten": info.aten,
            "module": modules.current_address,
            "module_stack": list(modules.address_stack),
            "source": self.locate() if self.locate is not None else "",
            "error": f"{type(exc).__name__}: {exc}",
        }

    # -- after the window ----------------------------------------------------------------------------------
    def log_backward(self, loss: Tensor) -> dict[str, Any]:
        """Runs ``loss.backward()`` under this recorder; returns the trace's tables, grown by its ops (see
        :meth:`tl_dist.trace.Trace.log_backward`)."""
        if not isinstance(loss, Tensor):
            raise ValueError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ValueError(
                "loss must require grad: build it from trace.output (or keep_graph=True activations) "
                "with autograd enabled, not under torch.no_grad()"
            )
        if ACTIVE:
            raise TlDistError("log_backward cannot run inside an active tl_dist capture window")
        training = self.training
        training.open = True
        # Everything loss.backward() dispatches is backward here, the seed gradient (ones_like) included.
        self.phase = "backward"
        try:
            with CaptureMode(self):
                loss.backward()
        finally:
            training.open = False
            self.phase = "forward"
        columns = self.columns()
        return {
            "columns": columns,
            "collective_table": self.comm.columns(columns),  # DDP's bucket all-reduces run in backward
            "grads": training.grads,
            "stats_table": training.finish(),
        }

    # -- end of capture -----------------------------------------------------------------------------------
    def columns(self) -> dict[str, list]:
        """The rows as columns (schema order), start times moved to the epoch clock, CUDA times resolved."""
        columns = rows_to_columns(self.rows, field_names(OP_FIELDS), "start_ns", self.clock_offset_ns)
        if self.cuda_events:
            torch.cuda.synchronize()
            durations = columns["duration_ns"]
            for index, start, end in self.cuda_events:
                durations[index] = int(start.elapsed_time(end) * 1e6)
        return columns
