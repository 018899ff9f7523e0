"""Capture of ``torch.compile``d code as it runs: each Inductor-compiled region becomes one op row.

Two halves, one at compile time and one in the window:

- :func:`watch_compiles` appends a graph pass to Inductor's ``post_grad_custom_post_pass`` list. For every
  graph Inductor compiles after it (forward, backward and inference graphs), the pass reads the ATen graph
  once: each op's name, FLOPs (``torch.utils.flop_counter``'s registry, the formulas eager capture uses, applied
  to the fake values Inductor propagated), output shapes and ``nn_module_stack`` (``fwd_nn_module_stack`` for
  backward nodes), module paths relative to the compiled code's root. The pass changes nothing in the graph.
- In a capture window, :class:`RegionHook` routes each ``CompiledFxGraph`` call (the one entry point of an
  Inductor artifact, forward or backward) through the recorder as one op of kind ``compiled``: the recorder
  times it like any op (host clock; CUDA events on a GPU), links it to the ops whose outputs it reads and to the
  autograd node it runs in backward, and saves its outputs when selected. While the region runs, the capture's
  dispatch mode passes the region's own dispatched ops (Inductor's extern kernels, ``aten.mm.out`` & co)
  through unrecorded: they are the region's, listed in ``trace.compiled_table``. A region whose graph issues no
  collective runs with Python dispatch off (its kernels never reach the mode, as in an uncaptured step).
- Collectives a region issues (functional collectives traced into its graph) reach the mode while it runs:
  :meth:`RegionHook.inside` has the recorder record each as a collective op (numbered before the region, which
  is numbered when it returns) and its ``wait_tensor`` as its completion; the region then reads them.

The capture's dispatch mode declares ``ignore_compile_internals()``: Dynamo then keeps running compiled code
while the mode is on (no fallback to eager, no recompilation), and compilation inside a window is not recorded.
Graphs compiled before :func:`watch_compiles` ran (or never seen by it) still become region rows, with duration,
inputs and outputs but FLOPs 0 and no inner ops (``trace.metadata["compiled_unknown"]`` counts them).

Example:
    >>> tl.watch_compiles()                 # before the first compiled call (tl.arm calls it)
    >>> model = torch.compile(model)
    >>> model(x).sum().backward()           # compiles
    >>> with tl.capture() as cap:
    ...     model(x).sum().backward()
    >>> cap.trace.to_pandas().query("kind == 'compiled'")
"""

from __future__ import annotations

import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ._common import FIELD_INDEX, flat_outputs, storage_key
from ._opinfo import COLLECTIVE_NAMESPACES, OPINFO_CACHE, OpInfo, mutated_tensors, op_info
from .schema import COMPILED_OP_FIELDS, empty_columns
from .training import link_running_node

# One value per process: Inductor's caches key compiled graphs on the passes' uuids, so a graph cached by another
# process is compiled again here once -- and the pass sees it. NB: this costs the cross-process cache hit.
_PROCESS_TOKEN = uuid.uuid4().hex
_LOCK = threading.Lock()
# Graphs the pass saw whose CompiledFxGraph has not run yet: (graph module, its record). Matched on first run.
_PENDING: list[tuple[Any, GraphRecord]] = []
_BY_TEXT: dict[str, GraphRecord] = {}  # CompiledFxGraph.inductor_post_grad_graph_str -> record
_MODULE_STACK = FIELD_INDEX["module_stack"]
_PARENTS = FIELD_INDEX["parents"]
_COMM_PREFIXES = tuple(f"{ns}." for ns in COLLECTIVE_NAMESPACES)
_perf_ns = time.perf_counter_ns
_NO_PYTHON_DISPATCH = torch._C._DisableTorchDispatch
_SUBSCRIPT = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]?([^'\"\]]+)['\"]?\]")


@dataclass(frozen=True)
class GraphRecord:
    """What the pass read from one compiled ATen graph. Module paths are relative to the compiled root."""

    phase: str  # "forward", "backward" or "inference"
    funcs: tuple[str, ...]
    atens: tuple[str, ...]
    modules: tuple[str, ...]
    stacks: tuple[tuple[str, ...], ...]
    flops: tuple[int, ...]
    out_shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def total_flops(self) -> int:
        return sum(self.flops)

    @property
    def communicates(self) -> bool:
        """Whether the graph issues collectives (functional collectives traced into it)."""
        return any(aten.startswith(_COMM_PREFIXES) for aten in self.atens)


def _relative_path(path: str) -> str:
    """``L['self'].layers[0]._modules['fc']`` -> ``layers.0.fc``: the first segment is Dynamo's name for the
    compiled function's argument (the root module), the rest the attribute path below it."""
    head, dot, rest = path.partition(".")
    if "[" in head and not dot and head.startswith(("L[", "G[")):
        return ""
    rest = _SUBSCRIPT.sub(lambda m: "." + (m.group(1) or m.group(2)), rest if dot else "")
    return ".".join(part for part in rest.split(".") if part and part != "_orig_mod")


def _shape(value: Any) -> tuple[tuple[int, ...], ...]:
    values = value if isinstance(value, (list, tuple)) else (value,)
    shapes = []
    for v in values:
        if isinstance(v, torch.Tensor):
            try:
                shapes.append(tuple(int(s) for s in v.shape))
            except Exception:  # an unbacked symbolic size: no concrete shape at compile time
                shapes.append(())
    return tuple(shapes)


def _node_flops(info: OpInfo, node: Any) -> int:
    if info.flop_fn is None:
        return 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    try:
        return int(info.flop_fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # symbolic (dynamic) shapes the formula cannot turn into a number
        return 0


def record_graph(graph: torch.fx.Graph) -> GraphRecord:
    """The :class:`GraphRecord` of an ATen graph (as the pass sees it)."""
    funcs, atens, modules, stacks, flops, shapes = [], [], [], [], [], []
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    backward = any(name.startswith("tangents") for name in placeholders)
    forward_outputs = not backward and any(
        "autograd_backward" in n.meta or n.meta.get("partitioner_tag") == "is_forward" for n in graph.nodes
    )
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        info = op_info(node.target)
        meta = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        stack = tuple(dict.fromkeys(_relative_path(path) for path, _ in meta.values()))
        stack = tuple(s for s in stack if s)
        funcs.append(info.func)
        atens.append(info.aten)
        stacks.append(stack)
        modules.append(stack[-1] if stack else "")
        flops.append(_node_flops(info, node))
        shapes.append(_shape(node.meta.get("val")))
    phase = "backward" if backward else ("forward" if forward_outputs else "inference")
    return GraphRecord(
        phase, tuple(funcs), tuple(atens), tuple(modules), tuple(stacks), tuple(flops), tuple(shapes)
    )


def _record(graph: torch.fx.Graph) -> None:
    """The pass's body: records the graph (until its artifact first runs), changes nothing."""
    gm = graph.owning_module
    if gm is None:
        return
    record = record_graph(graph)
    with _LOCK:
        _PENDING.append((gm, record))


_PASS: Any = None  # the pass object, made on first use: its base class lives in Inductor (seconds to import)


def _recording_pass() -> Any:
    global _PASS
    if _PASS is None:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class RecordingPass(CustomGraphPass):
            """Inductor custom post-grad pass that records the graph. A CustomGraphPass with a uuid keeps
            Inductor's caches on (any other callable makes them bypass): a graph compiled again in this process
            is a cache hit, found by its graph text (record_of) without the pass running."""

            def __call__(self, graph: torch.fx.Graph) -> None:
                _record(graph)

            def uuid(self) -> str:
                return "tl_dist.compiled/" + _PROCESS_TOKEN

        _PASS = RecordingPass()
    return _PASS


def watch_compiles() -> None:
    """Record the ATen graph of every graph Inductor compiles from now on (idempotent; ``tl.arm`` calls it).

    Appends a read-only pass to ``torch._inductor.config.post_grad_custom_post_pass`` (kept beside a pass of
    the user's own). Regions of graphs compiled earlier are still captured, without FLOPs and inner ops.

    Example:
        >>> tl.watch_compiles()
        >>> model = torch.compile(model)
    """
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else ([] if current is None else [current])
    ours = _recording_pass()
    if any(p is ours for p in passes):
        return
    config.post_grad_custom_post_pass = passes + [ours] if passes else ours


def _graph_text(gm: Any) -> str:
    # The same rendering Inductor stores as CompiledFxGraph.inductor_post_grad_graph_str (compile_fx.py).
    return gm.print_readable(
        print_output=False, include_stride=True, include_device=True, fast_sympy_print=True
    )


def record_of(compiled: Any) -> GraphRecord | None:
    """The record of a ``CompiledFxGraph`` (None when the pass never saw its graph)."""
    text = getattr(compiled, "inductor_post_grad_graph_str", None)
    if not text:
        return None
    with _LOCK:
        record = _BY_TEXT.get(text)
        if record is None and _PENDING:
            for gm, rec in _PENDING:
                _BY_TEXT.setdefault(_graph_text(gm), rec)
            _PENDING.clear()  # the graph modules are not kept alive past their first match
            record = _BY_TEXT.get(text)
    return record


def _region_info(record: GraphRecord | None, key: str, backward: bool) -> OpInfo:
    """An OpInfo for a region (what the recorder reads of an op): kind ``compiled``, FLOPs from its record."""
    info = OpInfo.__new__(OpInfo)
    phase = record.phase if record is not None else ("backward" if backward else "forward")
    info.func = f"compiled_{phase}"
    info.aten = f"inductor.{key}"
    info.namespace = "inductor"
    info.kind = "compiled"
    total = record.total_flops if record is not None else 0
    info.flop_fn = (lambda *args, out_val=None, **kwargs: total) if total else None
    info.flops_from_shapes = False
    info.mutated = ()
    info.nondeterministic = False
    info.tensor_lists = True  # a region takes its inputs as one list
    info.counter_key = info.func
    info.comm = None
    return info


class _Region:
    """The callable the recorder runs for one CompiledFxGraph: the artifact itself, its inner ops unrecorded except
    the collectives it issues (see :meth:`inside`)."""

    def __init__(self, hook: RegionHook, compiled: Any, record: GraphRecord | None) -> None:
        self.hook: RegionHook | None = hook  # None after the window (trace.validate() re-runs the artifact)
        self.compiled = compiled
        self.record = record
        # A region that issues collectives cannot be re-run on one rank (validate and replay skip it).
        self.communicates = record is not None and record.communicates
        self.__name__ = "compiled_region"

    def __call__(self, inputs: list) -> Any:
        # A copy: the artifact empties the list it is given (boxed calling convention), and the recorder keeps
        # this one as the op's arguments (replay, validate).
        hook = self.hook
        if hook is None:
            return _ORIGINAL_CALL(self.compiled, list(inputs))
        if self.record is not None and not self.communicates:
            # Nothing inside it is recorded: its extern kernels skip Python dispatch (and the mode) altogether.
            # An Inductor artifact holds plain tensors only (AOTAutograd unwraps subclasses before it).
            with _NO_PYTHON_DISPATCH():
                return _ORIGINAL_CALL(self.compiled, list(inputs))
        # The region's own dispatched ops (extern kernels) are inside it.
        with hook.mode.redirected(hook.inside):
            return _ORIGINAL_CALL(self.compiled, list(inputs))


_ORIGINAL_CALL: Any = None
_HOOKS: list[RegionHook] = []  # the open window's hook (windows do not nest)


def _compiled_call(self: Any, inputs: Any) -> Any:
    hook = _HOOKS[0] if _HOOKS else None
    if hook is None or not any(m is hook.mode for m in _get_current_dispatch_mode_stack()):
        return _ORIGINAL_CALL(self, inputs)  # another thread, or a region nested in one: run it as it is
    return hook.run(self, inputs)


class RegionHook:
    """While a window is open: each Inductor artifact's call becomes one recorder op (see module doc)."""

    def __init__(self, recorder: Any, mode: Any) -> None:
        self.recorder = recorder
        self.mode = mode
        self._regions: dict[int, tuple[Any, _Region, OpInfo]] = {}  # id(CompiledFxGraph) -> its op
        # (op index, the region row's module stack, record): the stack is the compiled root's
        self.rows: list[tuple[int, tuple[str, ...], GraphRecord | None]] = []
        self.unknown = 0
        self._forwards: list[
            tuple[int, list[Any]]
        ] = []  # forward regions not linked yet: (op index, outputs)
        self._issued: list[int] = []  # op indices of the collectives the running region issued
        self._written: set[int | None] = set()  # storages they wrote into

    def install(self) -> None:
        global _ORIGINAL_CALL
        if "torch._dynamo" not in sys.modules:
            return  # nothing was compiled in this process (and importing Inductor costs seconds)
        from torch._inductor.output_code import CompiledFxGraph

        if _ORIGINAL_CALL is None:
            _ORIGINAL_CALL = CompiledFxGraph.__call__
        CompiledFxGraph.__call__ = _compiled_call
        _HOOKS.append(self)

    def uninstall(self) -> None:
        if self in _HOOKS:
            from torch._inductor.output_code import CompiledFxGraph

            _HOOKS.remove(self)
            if not _HOOKS:
                CompiledFxGraph.__call__ = _ORIGINAL_CALL
        self._forwards.clear()
        for _, region, _ in self._regions.values():
            OPINFO_CACHE.pop(id(region), None)
            region.hook = None
        self._regions.clear()

    def run(self, compiled: Any, inputs: Any) -> Any:
        entry = self._regions.get(id(compiled))
        if entry is None or entry[0] is not compiled:
            record = record_of(compiled)
            key = str(getattr(compiled, "cache_key", "") or id(compiled))[:16]
            backward = bool(getattr(compiled, "fx_kwargs", {}).get("is_backward"))
            region = _Region(self, compiled, record)
            info = _region_info(record, key, backward)
            info.call = region  # what the recorder runs for this op
            OPINFO_CACHE[id(region)] = (region, info)
            entry = self._regions[id(compiled)] = (compiled, region, info)
        region = entry[1]
        recorder = self.recorder
        if region.record is None:
            self.unknown += 1
        if self._forwards and torch._C._current_graph_task_id() != -1:
            link_running_node(recorder, self._forwards)  # a backward region: its forward region
        outer, issued = self._issued, []
        self._issued = issued
        unlinked = recorder.comm.unlinked
        try:
            out = recorder.on_op(region, (list(inputs),), {})
        finally:
            self._issued = outer
        index = recorder.n_ops - 1  # numbered after it ran: the collectives it issued come first
        inputs.clear()  # as the artifact would have: the caller hands over its references
        if issued:
            # Its collectives' autograd is the region's (no DTensor redistribution between them and it).
            recorder.comm.unlinked = unlinked
            self._link_collectives(index, issued)
            region.communicates = True
        if region.record is None or region.record.phase == "forward":
            # A forward region runs inside its autograd Function's forward: its outputs get their autograd node
            # only when the Function returns, after the recorder looked. The backward region finds its forward
            # region through them (held until then: autograd keeps most of them alive till backward anyway).
            outs = flat_outputs(out)
            if torch._C._current_graph_task_id() == -1 and outs:
                self._forwards.append((index, outs))
        # The row's module stack is the compiled root's: the module calls open now (forward), or the forward
        # region's (backward, through the autograd link).
        self.rows.append((index, recorder.rows[index][_MODULE_STACK], region.record))
        return out

    def inside(self, func: Any, args: tuple, kwargs: dict, subclass: bool = False) -> Any:
        """``Recorder.on_op``'s stand-in while a region runs (``subclass`` as there): the region's dispatched
        ops run unrecorded (they are the region's), except the collectives it issues, which the recorder
        records as ops of their own (and their collective rows), and ``wait_tensor``, which completes one."""
        cached = OPINFO_CACHE.get(id(func))
        info = cached[1] if cached is not None and cached[0] is func else op_info(func)
        comm = info.comm
        if comm is None or (comm.spec is None and not comm.is_wait):
            return func(*args, **kwargs)
        recorder = self.recorder
        if comm.is_wait:
            out = func(*args, **kwargs)
            recorder.comm.waited(args, _perf_ns())
            return out
        out = recorder.on_op(func, args, kwargs)
        self._issued.append(recorder.n_ops - 1)
        if info.mutated:  # all_reduce_ & co write into a buffer of the region
            self._written.update(storage_key(t) for t in mutated_tensors(info, args, kwargs))
        return out

    def _link_collectives(self, index: int, issued: list[int]) -> None:
        """Edges of the collectives region ``index`` issued: each reads what the region read (its inputs are
        buffers the region made from them), the region reads each (its code after the collective reads the
        result). Their outputs are the region's buffers: saved ones are copied (the region may reuse the memory)
        and their in-place writes forgotten (memory freed with the region)."""
        recorder = self.recorder
        rows = recorder.rows
        region_row = rows[index]
        inputs = tuple(p for p in region_row[_PARENTS] if p not in issued)
        rows[index] = (
            region_row[:_PARENTS]
            + (tuple(dict.fromkeys(inputs + tuple(issued))),)
            + region_row[_PARENTS + 1 :]
        )
        done = set(issued)
        for i in issued:
            row = rows[i]
            rows[i] = row[:_PARENTS] + (inputs,) + row[_PARENTS + 1 :]
            saved = recorder.saved.get(i)
            if saved is not None:
                recorder.saved[i] = [None if t is None else t.clone() for t in saved]
            record = recorder.replay_records.get(i)
            if record is not None:
                record[4][:] = [None if t is None else t.clone() for t in record[4]]
        recorder.forget_writes(self._written, done)
        self._written.clear()

    def table(self) -> dict[str, list]:
        """``trace.compiled_table``: one row per ATen op of each region run in the window."""
        cols = empty_columns(COMPILED_OP_FIELDS)
        for index, root_stack, record in self.rows:
            if record is None:
                continue
            stacks, modules = _placed(record, root_stack)
            n = len(record.funcs)
            cols["region"] += [index] * n
            cols["pos"] += range(n)
            cols["func"] += record.funcs
            cols["aten"] += record.atens
            cols["module"] += modules
            cols["module_stack"] += stacks
            cols["flops"] += record.flops
            cols["out_shapes"] += record.out_shapes
        return cols


# (id(record), the region's module stack) -> (record, its ops' module stacks and modules placed under it): a
# region runs under the same module every step, so a window's table costs list copies, not string joins.
# Records live as long as the process (_BY_TEXT), so their ids are not reused.
_PLACED: dict[tuple[int, tuple[str, ...]], tuple[GraphRecord, tuple, tuple]] = {}


def _placed(record: GraphRecord, root_stack: tuple[str, ...]) -> tuple[tuple, tuple]:
    entry = _PLACED.get((id(record), root_stack))
    if entry is None or entry[0] is not record:
        root = root_stack[-1] if root_stack else ""
        stacks = tuple(root_stack + tuple(_join(root, s) for s in stack) for stack in record.stacks)
        modules = tuple(stack[-1] if stack else "" for stack in stacks)
        entry = _PLACED[(id(record), root_stack)] = (record, stacks, modules)
    return entry[1], entry[2]


def _join(root: str, relative: str) -> str:
    return f"{root}.{relative}" if root and relative else (root or relative)
