"""Training-step capture: phases, backward -> forward links, per-op gradients and on-device statistics.

The recorder owns one :class:`TrainingState`. It touches the per-op hot path in three cheap places:

- ``phase`` comes from one C call (``torch._C._current_graph_task_id()``: not -1 while the autograd engine runs
  a graph task) plus an attribute the optimizer step hooks set (``recorder.phase``); see ``_phases``.
- A forward op's autograd node is made and numbered (its ``_sequence_nr()``, a per-thread counter) by the
  autograd kernel before the dispatch mode sees the op, so the recorder links the common op to its node by
  number: the counter minus one at its dispatch, when grad is on and no earlier op of the window took that
  number (``recorder.node_ops``: number -> op index), with no node object made in the forward. In-place ops
  (a write into a view gets its ``CopySlices`` node after the op), ops whose outputs an intervention replaced,
  collectives, tensor subclasses and windows with gradient hooks link the node itself: their outputs get
  their ``grad_fn`` only after the dispatch mode returns, so the recorder parks them in ``recorder.pending``
  and :meth:`TrainingState.link_pending` tags their node's ``metadata`` with ``(token, op index)`` at the
  next dispatch (:func:`tag_node`, which notes the node's number in ``recorder.tagged_nodes``). A backward op
  reads the running node's tag when its number is a tagged one's, else looks its number up
  (:func:`backward_link`): an untagged node's metadata is never made.
  Neither keeps a graph alive.
- Gradients and gradient statistics come from a pre-hook on the forward op's node: it receives the gradient
  of the loss w.r.t. each of the node's outputs, i.e. w.r.t. the op's outputs as they were produced (an
  in-place op later rebases the tensor on a new node; the old node still receives the gradient of the old
  value).

Statistics are reductions kept as small device tensors and moved to the host once, when the window ends, so
there is no host sync per op. See :data:`tl_dist.schema.STAT_FIELDS` for the columns.

A backward op is attributed to the module of the forward op it differentiates (its ``module`` and
``module_stack`` are that op's); an ``AccumulateGrad`` op to the module owning the parameter.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._common import FLOAT_DTYPES as _FLOATS
from ._common import STAT_NAMES as _STAT_NAMES
from ._common import RowView, has_its_bytes, is_dense, local_tensor, map_local
from .schema import OP_FIELDS, STAT_FIELDS, empty_columns, field_names
from .trace import first_nonfinite, nonfinite_value, op_stats  # noqa: F401 (moved to trace; old path)

if TYPE_CHECKING:
    from ._recorder_state import RecorderState

Tensor = torch.Tensor
_KEY = "_tl_src"  # key in an autograd node's metadata: (capture token, forward op index)
_current_node = torch._C._current_autograd_node
_KIND = field_names(OP_FIELDS).index("kind")
_PHASE = field_names(OP_FIELDS).index("phase")
_FUNC = field_names(OP_FIELDS).index("func")
_ATEN = field_names(OP_FIELDS).index("aten")
_PARAMS = field_names(OP_FIELDS).index("params")
_OUT_SHAPES = field_names(OP_FIELDS).index("out_shapes")
_engine = torch.autograd.Variable._execution_engine
# Ops stats=True skips besides views: uninitialised memory (its "statistics" are garbage, NaN included, and
# would fool first_nonfinite) and copies/aliases whose values are their input's, already counted.
_NO_STATS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_unsafe_view",
        "clone",
        "alias",
    }
)


def _detached_copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def _stats_by_default(row: tuple) -> bool:
    """Whether stats=True covers this op: forward ops that compute new values, and collectives in any phase
    (DDP's and FSDP's reduced gradients: a NaN another rank contributed shows first there)."""
    if row[_KIND] == "collective":
        return True
    return row[_PHASE] == "forward" and row[_KIND] != "view" and row[_FUNC] not in _NO_STATS


def _module_output_stats(row: tuple) -> bool:
    """Whether stats=True covers this op as a module's output although :func:`_stats_by_default` skips it (a
    view, ``_unsafe_view``, ``clone``...: every ``nn.Linear`` on 3-D input ends in one): the tensor the module
    returned gets its norm. Uninitialised memory still gets none."""
    return row[_PHASE] == "forward" and not _stats_by_default(row) and "empty" not in row[_FUNC]


def tag_node(rec: RecorderState, node: Any, link: tuple) -> None:
    """Tags autograd ``node`` with ``link`` (this window's token, an op index, ...) and notes its sequence number
    in ``rec.tagged_nodes``: a backward op reads the tag only of a node whose number is there (backward_link),
    and no other node's metadata is made."""
    node.metadata[_KEY] = link
    rec.tagged_nodes.add(node._sequence_nr())


def link_running_node(rec: RecorderState, candidates: list[tuple[int, list[Tensor]]]) -> None:
    """Links the autograd node running now to the forward op among ``candidates`` (op index, its outputs) whose
    output it is the node of, unless it is linked already, and drops that candidate: for ops whose outputs got
    their node only after the op was recorded (a compiled region runs inside its autograd Function's forward)."""
    node = _current_node()
    if node is None or _KEY in node.metadata:
        return
    for k in range(len(candidates) - 1, -1, -1):
        index, outs = candidates[k]
        if any(out.grad_fn is node for out in outs):
            tag_node(rec, node, (rec.token, index))
            del candidates[k]
            return


def backward_link(rec: RecorderState) -> int:
    """Index of the forward op whose autograd node is running now (-1 when unknown); called per backward op.
    A node tagged with this window's token names its op (in-place ops, custom Functions, module outputs, the
    nodes of collectives); any other is looked up by its sequence number among the forward ops' nodes
    (``node_ops``, see ``Recorder.on_op``). The tag is read only where the node's number is a tagged one's
    (``rec.tagged_nodes``; another thread's node may share it): most nodes' metadata is never made."""
    node = _current_node()
    if node is None:
        return -1
    number = node._sequence_nr()
    if number in rec.tagged_nodes:
        link = node.metadata.get(_KEY)
        if link is not None and link[0] is rec.token:
            return link[1]
    return rec.node_ops.get(number, -1)


def tensor_stats(t: Tensor) -> Tensor | list[float] | None:
    """Raw reductions of ``t`` for its statistics: ``[numel, c, sum(x - c), sum((x - c)^2), min, max, zeros,
    NaNs, Infs]`` for a shift ``c``; :func:`finish_stats` turns them into mean, std, L2 norm and zero fraction.

    On a GPU the result is one small device tensor (no host sync; moved to the host once per window). On CPU
    there is no device to sync with, so it is a list of floats, which lets cheap checks pick the passes: the
    counting passes run only when a NaN/Inf is present, the shifted variance only when it is needed. None for
    tensors that are empty, not floating point, on the meta device, sparse or nested. With a NaN or Inf element
    present, the counts and min/max are exact while mean, std and norm come out NaN or Inf.

    Example:
        >>> finish_stats(tensor_stats(torch.tensor([0.0, 2.0])))
        [1.0, 1.0, 0.0, 2.0, 2.0, 0.5, 0, 0]
    """
    t = local_tensor(t)  # a DTensor's statistics are its local shard's: no collective, this rank's values
    if t.dtype not in _FLOATS or t.numel() == 0 or t.is_meta or not is_dense(t):
        return None  # no values (meta), or not one dense block of them (sparse, nested)
    x = t.detach().reshape(-1)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    n = x.numel()
    if x.is_cuda:
        return _device_stats(x, n)
    if _SLEEPING_OMP_THREADS and n < _ONE_THREAD_BELOW and torch.get_num_threads() > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(
            1
        )  # OpenMP keeps the thread count per calling thread: other threads keep theirs
        try:
            return _host_stats(x, n)
        finally:
            torch.set_num_threads(threads)
    return _host_stats(x, n)


# With OMP_WAIT_POLICY=PASSIVE (which tl_dist recommends on shared machines) OpenMP's threads sleep right after
# each parallel region, and waking them costs more than the reduction itself up to about a million elements:
# measured on 2 cores, tensor_stats of 131,072 floats took 508 us on 2 threads and 97 us on one (with the
# default, spinning policy: 65 and 81 us, so threads stay on there).
_SLEEPING_OMP_THREADS = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
_ONE_THREAD_BELOW = 1 << 20


def _host_stats(x: Tensor, n: int) -> list[float]:
    # Passes: sum, dot (BLAS), aminmax, sign + dot (non-zero count). torch.std_mean (Welford) and sums of
    # bool masks are 5-25x slower than these on CPU.
    lo, hi = torch.aminmax(x)
    total = x.sum().item()
    squares = torch.dot(x, x).item()
    if not (math.isfinite(squares) and math.isfinite(total)):
        zeros = int((x == 0).sum())
        return [
            n,
            0.0,
            total,
            squares,
            lo.item(),
            hi.item(),
            zeros,
            int(x.isnan().sum()),
            int(x.isinf().sum()),
        ]
    shift = 0.0
    mean = total / n
    if squares / n - mean * mean <= 1e-3 * (squares / n):
        # |mean| >> std: E[x^2] - E[x]^2 would cancel catastrophically; shift by an element of the tensor.
        shift = x[0].item()
        d = x - shift
        total = d.sum().item()
        squares = torch.dot(d, d).item()
    signs = x.sign()
    # NB: counts as a float32 dot product: exact below 2^24 non-zero elements.
    nonzero = torch.dot(signs, signs).item() if n < 1 << 24 else int(torch.count_nonzero(x))
    return [n, shift, total, squares, lo.item(), hi.item(), n - nonzero, 0, 0]


def _device_stats(x: Tensor, n: int) -> Tensor:
    # Shifting by an element keeps E[d^2] - E[d]^2 from cancelling when |mean| >> std; GPU passes are cheap.
    shift = x[0]
    d = x - shift
    lo, hi = torch.aminmax(x)
    return torch.stack(
        (
            x.new_tensor(n),
            shift,
            d.sum(),
            torch.dot(d, d),
            lo,
            hi,
            (x == 0).sum(),
            torch.isnan(x).sum(),
            torch.isinf(x).sum(),
        )
    )


def finish_stats(raw: list[float]) -> list[float | int]:
    """mean, std, min, max, L2 norm, zero fraction, NaN count, Inf count from :func:`tensor_stats`' values.

    NB: the variance is E[d^2] - E[d]^2 with d = x - x[0]; it loses relative precision only when x[0] is far
    from the mean compared with the std (an outlier first element).
    """
    n, shift, total, squares, lo, hi, zeros, nans, infs = raw
    mean_d = total / n
    var = max(squares / n - mean_d * mean_d, 0.0)
    # ||x||^2 = ||d||^2 + 2 c sum(d) + n c^2
    norm2 = max(squares + 2.0 * shift * total + n * shift * shift, 0.0)
    return [shift + mean_d, math.sqrt(var), lo, hi, math.sqrt(norm2), zeros / n, int(nans), int(infs)]


class TrainingState:
    """Phase hooks, backward links, gradient hooks and statistics of one capture (owned by its Recorder)."""

    def __init__(self, recorder: RecorderState, *, save_grads: Any, stats: Any) -> None:
        self.rec = weakref.proxy(recorder)  # the recorder owns this state: no reference cycle
        self.grads_all = save_grads is True
        self.grads_selector = None if save_grads is True or save_grads is None else save_grads
        self.stats_all = stats is True
        self.stats_selector = None if stats is True or stats is None else stats
        self.hooks_on = save_grads is not None or stats is not None
        self.grads: dict[int, list[Tensor | None]] = {}
        # (op index, "out" | "grad", op count when computed, device tensor of the 8 values)
        self._stat_rows: list[tuple[int, str, int, Tensor | list[float]]] = []
        self._output_stats: set[int] = set()  # ops whose output statistics module_out_stats took
        # Collectives whose output statistics wait for the result: op index -> (outputs, read through c10d).
        self.in_flight: dict[int, tuple[list[Tensor], bool]] = {}
        # Made with the first statistics: a Trace reads None as the empty table.
        self.stats_table: dict[str, list] | None = None
        self.open = True  # gradient hooks act only while a window (or log_backward) is running
        self._node_handles: list[Any] = []
        # Parameter name -> its .grad at the end of the window's last backward pass (save_grads asks for it).
        self.param_grads: dict[str, Tensor] = {}
        self._param_snapshot_queued = False

    # -- window -------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Gradient hooks act from now on (until :meth:`uninstall`)."""
        self.open = True

    def uninstall(self, *, keep_node_hooks: bool = False) -> None:
        """Links the last op; node hooks are removed, or stay (inert) only for log_backward."""
        if self.rec.pending is not None:
            self.link_pending()
        self.open = False
        if not keep_node_hooks:
            for handle in self._node_handles:
                handle.remove()
            self._node_handles = []

    def finish(self) -> dict[str, list] | None:
        """Moves the statistics to the host (one transfer) and returns the stats table's columns (None while
        there are none: a Trace reads that as the empty table)."""
        for index in list(self.in_flight):
            self.arrived(index, reader=False)
        rows = self._stat_rows
        if not rows:
            return self.stats_table
        if self.stats_table is None:
            self.stats_table = empty_columns(STAT_FIELDS)
        table = self.stats_table
        # One stack per device, then one copy to the host: the only sync of the whole window.
        by_device: dict[torch.device, list[int]] = {}
        values: list[list[float] | None] = [None] * len(rows)
        for k, row in enumerate(rows):
            if isinstance(row[3], list):  # computed on CPU, already host values
                values[k] = row[3]
            else:
                by_device.setdefault(row[3].device, []).append(k)
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for ks in by_device.values():
                host = torch.stack([rows[k][3].to(torch.float64) for k in ks]).cpu().tolist()
                for k, v in zip(ks, host):
                    values[k] = v
        for (op, of, at, _), v in zip(rows, values):
            table["op"].append(op)
            table["of"].append(of)
            table["at"].append(at)
            for name, x in zip(_STAT_NAMES, finish_stats(v)):
                table[name].append(x)
        self._stat_rows = []
        self._output_stats = set()
        return table

    # -- per op (called by Recorder.on_op) ------------------------------------------------------------------
    def out_stats(self, index: int, outs: list[Tensor], row: tuple) -> None:
        """Statistics of op ``index``'s first floating-point output, if the op is selected."""
        if not self.stats_all:
            if not self.stats_selector.match(RowView(row)):
                return
        elif not _stats_by_default(row):
            # stats=True means activations and gradients. A view's values are its base's, counted at the op
            # that made them; a backward op's output is a gradient, recorded as the `grad` row of the forward
            # op it differentiates; optimizer ops rewrite parameters and state. A selector can still pick any.
            return
        if row[_KIND] == "collective":
            # Issued, not done: the values arrive later (the op only enqueues the work; gloo and NCCL fill the
            # buffer meanwhile), so the statistics wait until they have: see arrived().
            self.in_flight[index] = (outs, row[_ATEN].startswith("c10d."))
            return
        self._first_float_stats(index, outs, index)

    def _first_float_stats(self, index: int, outs: list[Tensor], at: int) -> None:
        for o in outs:
            if o.dtype in _FLOATS:
                with torch._C._DisableTorchDispatch(), torch.no_grad():
                    values = tensor_stats(o)
                if values is not None:
                    self._stat_rows.append((index, "out", at, values))
                return

    def arrived(self, index: int, *, reader: bool) -> None:
        """Collective ``index``'s outputs hold its result now: the statistics it deferred are taken. Called
        with ``reader=True`` when an op reads one of them (for a c10d collective's buffer only: whoever reads it
        waited for it first; a functional collective's reader waits inside its own dispatch, after the recorder
        saw it), when a functional collective's ``wait_tensor`` returned, and for the rest when the window
        closes."""
        entry = self.in_flight.get(index)
        if entry is None or (reader and not entry[1]):
            return
        del self.in_flight[index]
        outs = [o for o in entry[0] if has_its_bytes(o)]  # FSDP frees gathered buffers
        self._first_float_stats(index, outs, self.rec.n_ops)

    def module_out_stats(self, index: int, leaf: Tensor) -> None:
        """Statistics of a module's output leaf made by op ``index`` when ``stats=True`` skipped that op (see
        :func:`_module_output_stats`), so every module output has its norm."""
        if not self.stats_all or index in self._output_stats or leaf.dtype not in _FLOATS:
            return
        if index in self.in_flight:
            return  # a collective's result, not there yet: arrived() takes it
        row = self.rec.rows[index]
        if not _module_output_stats(row):
            return
        self._output_stats.add(index)
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            values = tensor_stats(leaf)
        if values is not None:
            self._stat_rows.append((index, "out", index, values))

    def forget_out_stats(self, index: int) -> None:
        """Drops op ``index``'s output statistics (an edit replaced the output after they were taken)."""
        self._stat_rows = [r for r in self._stat_rows if r[0] != index or r[1] != "out"]

    def link_unowned(self, tensors: list[Tensor], index: int) -> None:
        """Links to op ``index`` the autograd nodes behind ``tensors`` that no recorded op made, walking back
        through such nodes (a custom autograd Function's: DTensor's redistribution, to_local, from_local)
        until one a recorded op owns. Their backward then belongs where op ``index`` ran."""
        token = self.rec.token
        node_ops = self.rec.node_ops
        link = (token, index)
        todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
        seen = 0
        while todo and seen < 16:  # a redistribution is a few nodes deep; never walk a whole graph
            node = todo.pop()
            seen += 1
            meta = node.metadata
            old = meta.get(_KEY)
            if (
                (old is not None and old[0] is token)
                or type(node).__name__ == "AccumulateGrad"
                or node._sequence_nr() in node_ops
            ):
                continue
            tag_node(self.rec, node, link)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def link_module_output(self, leaf: Tensor, tag: tuple) -> None:
        """Links a module's output leaf made by op ``tag[1]`` whose autograd node appeared after that op ran:
        the op ran without grad inside an autograd Function's forward (reentrant checkpoint's, a custom
        Function's) and the Function's node came with its return. Its gradient is then the module's."""
        node = leaf.grad_fn
        if node is None:
            return
        if not self.hooks_on and self.rec.node_ops.get(node._sequence_nr()) == tag[1]:
            return  # its op made it: backward_link finds it by number, with no metadata made on the node
        meta = node.metadata
        old = meta.get(_KEY)
        if old is not None and old[0] is tag[0]:
            return  # linked when its op ran, or by an earlier module returning the same tensor
        tag_node(self.rec, node, tag)
        if self.hooks_on:
            index, pos = tag[1], tag[2]
            n_out = len(self.rec.rows[index][_OUT_SHAPES])
            self._node_handles.append(
                node.register_prehook(self._grad_hook(index, n_out, [(pos, leaf.output_nr)], pos))
            )

    def link_pending(self) -> None:
        """Tags the autograd nodes of the previous op's outputs with that op; adds gradient hooks if selected."""
        rec = self.rec
        link, outs = rec.pending  # link: (token, op index, ...), the op's tag when it has one output
        rec.pending = None
        token = link[0]
        if not self.hooks_on and len(outs) == 1:  # the common case, kept short: it runs for every op
            node = outs[0].grad_fn
            if node is not None:
                meta = node.metadata
                old = meta.get(_KEY)
                if old is None or old[0] is not token:
                    tag_node(rec, node, link)
            return
        index = link[1]
        nodes: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for pos, o in enumerate(outs):
            node = o.grad_fn
            if node is None:
                continue
            meta = node.metadata
            old = meta.get(_KEY)
            if old is None or old[0] is not token:
                tag_node(rec, node, link)
            elif old[1] != index:
                continue  # the output is an earlier op's tensor passed through; that op owns the node
            if self.hooks_on:
                entry = nodes.get(id(node))
                if entry is None:
                    entry = nodes[id(node)] = (node, [])
                entry[1].append((pos, o.output_nr))
        if nodes:
            # Hooks go on every node; whether to keep the gradient is decided when it arrives, because a
            # selector like tl.module("fc1") can only match once the module has returned, after this link.
            n_out = len(outs)
            first = min(pos for _, positions in nodes.values() for pos, _ in positions)
            for node, positions in nodes.values():
                hook = self._grad_hook(index, n_out, positions, first)
                self._node_handles.append(node.register_prehook(hook))

    def _selected(self, index: int) -> tuple[bool, bool]:
        """(keep the gradient, record its statistics) for forward op ``index``."""
        row = self.rec.rows[index]
        stats = self.stats_all and (
            _stats_by_default(row) or (index in self.rec.output_of and _module_output_stats(row))
        )
        keep = self.grads_all
        if not (keep and stats):
            view = RowView(self.rec.rows[index], tuple(self.rec.output_of.get(index, ())))
            keep = keep or (self.grads_selector is not None and self.grads_selector.match(view))
            stats = stats or (self.stats_selector is not None and self.stats_selector.match(view))
        return keep, stats

    def _grad_hook(self, index: int, n_out: int, positions: list[tuple[int, int]], first: int) -> Any:
        rec = self.rec
        decided: list[tuple[bool, bool]] = []

        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            if not self.open:
                return
            if not decided:
                decided.append(self._selected(index))
            if not self._param_snapshot_queued and (self.grads_all or self.grads_selector is not None):
                self._param_snapshot_queued = True
                _engine.queue_callback(self._after_backward)
            keep, stats = decided[0]
            if not (keep or stats):
                return
            # Our own ops (detach, reductions) must not become rows of the trace.
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                for pos, nr in positions:
                    g = grad_outputs[nr] if nr < len(grad_outputs) else None
                    if g is None:
                        continue
                    if keep:
                        saved = self.grads.get(index)
                        if saved is None:
                            saved = self.grads[index] = [None] * n_out
                        saved[pos] = map_local(g, Tensor.detach) if g.requires_grad else g
                        # An in-place write later in the window (grad accumulation into .grad) must not
                        # change the stored gradient: copy-before-write, as for saved outputs.
                        rec.watch(g, (index, 2, pos))
                    if stats and pos == first:  # statistics of the first output's gradient, as for outputs
                        values = tensor_stats(g)
                        if values is not None:
                            self._stat_rows.append((index, "grad", rec.n_ops, values))

        return hook

    def _after_backward(self) -> None:
        # Queued again, so it runs after the callbacks queued during the pass (DDP's, which write the reduced
        # gradients into .grad): callbacks queued while callbacks run are run too, in order.
        _engine.queue_callback(self._snapshot_param_grads)

    def _snapshot_param_grads(self) -> None:
        """Copies the .grad of the parameters ``save_grads`` asks for (all, or those read by selected ops)."""
        self._param_snapshot_queued = False
        rec = self.rec
        wanted: set[str] | None = None
        if not self.grads_all:
            wanted = set()
            for index, row in enumerate(rec.rows):
                if row[_PHASE] == "forward" and row[_PARAMS]:
                    view = RowView(row, tuple(rec.output_of.get(index, ())))
                    if self.grads_selector.match(view):
                        wanted.update(row[_PARAMS])
        names = rec.modules.params
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for mod in rec.modules.live_modules():
                for p in mod._parameters.values():
                    if p is None or p.grad is None:
                        continue
                    name = names.get(id(p))
                    if name is not None and (wanted is None or name in wanted):
                        self.param_grads[name] = map_local(p.grad, _detached_copy)
