"""Collectives as first-class ops: recognise communication ops at the dispatcher and fill the collective table.

Every collective is a row of the op table like any op (its ``func`` and label use the normalised name:
``all_reduce_1``) and, in addition, a row of the collective table (``schema.COLLECTIVE_FIELDS``): group,
sequence number, sizes, issue/completion times. Merge matches rows across ranks on ``(group_ranks, seq)``.

Example:
    >>> with tl.capture() as cap:
    ...     dist.all_reduce(t)
    ...     y = t * 2
    >>> c = cap.trace.collectives[0]
    >>> c.func, c.group_ranks, c.seq, c.state, cap.trace[c.op].children
    ('all_reduce', (0, 1), 1, 'completed', (1,))
    >>> cap.trace.collectives_frame()

What reaches the dispatcher, verified on torch 2.13 CPU/gloo (2 and 4 ranks):

- ``torch.distributed`` calls dispatch ``c10d.*`` ops: ``allreduce_``, ``allgather_``, ``_allgather_base_``
  (all_gather_into_tensor), ``reduce_scatter_``, ``_reduce_scatter_base_`` (reduce_scatter_tensor),
  ``broadcast_``, ``reduce_``, ``gather_``, ``scatter_``, ``alltoall_``, ``alltoall_base_``
  (all_to_all_single), ``barrier``, ``send``, ``recv_`` (``dist.send`` is ``isend`` + ``wait()``: the same
  op; the Python caller tells them apart). The process group
  and the reduce op arrive as TorchScript objects (``ProcessGroup.unbox``; ``ReduceOp`` exposes ``op()``);
  roots and peers are group ranks. Ops with ``async_op`` get ``False`` from the blocking Python API. Gloo's
  reduce_scatter and p2p Works have no future; reduce_scatter's never reports ``is_completed()`` either.
- Functional collectives dispatch ``_c10d_functional.*`` (group by name) followed by ``_wrap_tensor_autograd``;
  their ``wait_tensor`` reaches the capture mode only when called from user code
  (``AsyncCollectiveTensor.wait()``); when the AsyncCollectiveTensor waits inside another op's dispatch, the
  capture's SubclassMode (``_modes``) sees it, as it sees what DTensor issues inside its own dispatch.
- With ``find_unused_parameters=True`` DDP also all-reduces its used-parameter map (int32, 1-D) in backward.
- DDP's gradient buckets: one ``c10d.allreduce_`` of a flat 1-D bucket per bucket, issued by the C++ reducer
  inside the autograd engine (``torch._C._current_graph_task_id() != -1``, no user Python frame between the
  engine and the dispatcher), in bucket order. NB: DDP's first iteration runs with
  one bucket; buckets are rebuilt (broadcasts inside DDP's forward) on the second.
- FSDP2 (``fully_shard``): ``fsdp.all_gather_copy_in`` then ``c10d._allgather_base_``; in backward
  ``fsdp.chunk_cat`` then ``c10d._reduce_scatter_base_``.
- ``ProcessGroup._get_sequence_number_for_group()`` read right after issue is the collective's number (from 1;
  before issue it still holds the previous one) and equal on every member; on gloo send and recv advance it on both peers. NB: ProcessGroupNCCL counts p2p
  separately (``seqP2P_``) and reports the collective counter, so p2p rows on NCCL get ``seq == -1``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from typing import Any

import torch

from ._common import FIELD_INDEX, device_name, dtype_name
from ._common import TAG as _TAG
from ._common import TORCH_DIR as _TORCH_DIR
from .comm_ops import DISPATCH_PLUMBING, REDUCE_NAMES, CommOp
from .schema import COLLECTIVE_FIELDS, field_names

Tensor = torch.Tensor
_perf_ns = time.perf_counter_ns
_COLUMN = {name: i for i, name in enumerate(field_names(COLLECTIVE_FIELDS))}
P2P = frozenset({"send", "recv"})


def _flat(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[Tensor] = []
        for v in value:
            out.extend(_flat(v))
        return out
    return []


class _Group:
    __slots__ = ("pg", "ranks", "name", "desc", "backend", "_by_device")

    def __init__(self, pg: Any) -> None:
        import torch.distributed as dist

        self.pg = pg  # held so that the cache key (id) cannot be reused by another group
        try:
            self.ranks = tuple(dist.get_process_group_ranks(pg))
        except (ValueError, RuntimeError, KeyError):
            # A group c10d's Python registry does not know (created in C++): its size is all we can tell.
            self.ranks = tuple(range(pg.size())) if pg.size() == dist.get_world_size() else ()
        self.name = str(getattr(pg, "group_name", ""))
        self.desc = str(getattr(pg, "group_desc", ""))
        try:
            self.backend = pg._get_backend_name()
        except RuntimeError:
            self.backend = ""
        self._by_device: dict[str, str] = {}

    def backend_for(self, device_type: str) -> str:
        """The backend serving tensors of ``device_type`` (a group made with "cpu:gloo,cuda:nccl" has two)."""
        name = self._by_device.get(device_type)
        if name is None:
            try:
                name = self.pg._get_backend(torch.device(device_type)).name()
            except (RuntimeError, AttributeError):
                name = self.backend
            self._by_device[device_type] = name
        return name


class CollectiveLog:
    """Collects the collective rows of one capture; owned by the recorder (``recorder.comm``).

    Completion is observed without blocking the user: a done-callback on each c10d Work's future (CPU
    backends complete it when the data is there), polling ``Work.is_completed()`` at later collectives and at
    window end (CUDA, where the future completes on enqueue), and ``wait_tensor`` for functional collectives.
    """

    def __init__(self, recorder: Any) -> None:
        self.recorder = weakref.proxy(recorder)  # the recorder owns this log: no reference cycle
        self.rows: list[list] = []
        self._groups: dict[int, _Group] = {}
        self._by_name: dict[str, _Group] = {}
        self._done: dict[int, int] = {}  # row -> perf ns when seen complete (written from c10d threads)
        self._polled: list[tuple[int, Any, Any]] = []  # (row, Work, its future or None) not seen complete
        self._sync_polled: dict[int, int] = {}  # blocking collective -> perf ns when is_completed() said so
        self._blocking: dict[int, None] = {}  # rows issued through the blocking API (async_op=False)
        self._functional: dict[int, int] = {}  # op index -> row, completed by wait_tensor / first reader
        self.unlinked = (
            -1
        )  # the latest forward functional collective no subclass op has read since (op index)
        self._any_source: dict[int, tuple[Any, tuple[int, ...]]] = {}  # recv_any_source row -> (Work, ranks)
        self._wrapped: dict[int, int] = {}  # _wrap_tensor_autograd op index -> the row of what it wraps
        self._ddp: dict[int, int] = {}  # autograd graph task -> DDP buckets seen in it
        self._failed: set[str] = set()  # funcs already warned about

    def _group(self, value: Any) -> _Group | None:
        if isinstance(value, str):
            group = self._by_name.get(value)
            if group is None:
                pg = torch._C._distributed_c10d._resolve_process_group(value)
                group = self._by_name[value] = self._group(pg)
            return group
        if type(value).__name__ == "ScriptObject":
            value = torch.distributed.ProcessGroup.unbox(value)
        if value is None:
            return None
        group = self._groups.get(id(value))
        if group is None:
            group = self._groups[id(value)] = _Group(value)
        return group

    def record(self, index: int, comm: CommOp, *call: Any) -> list[Tensor]:
        """Add the collective row for op ``index`` (already in the op table); returns the op's data outputs.
        ``call`` is ``(args, kwargs, out, outs, t0, t1)`` of the op, as :meth:`_record` takes them.

        Never raises into the user's step: a collective tl_dist cannot describe (an exotic backend or group)
        keeps its op row, gets no collective row, and is reported once as a warning.
        """
        try:
            return self._record(index, comm, *call)
        except Exception as exc:  # noqa: BLE001 - the training step matters more than the record
            if comm.func not in self._failed:
                self._failed.add(comm.func)
                warnings.warn(
                    f"tl_dist: could not describe collective {comm.func} (op {index}): "
                    f"{type(exc).__name__}: {exc}; it stays an op row without a collective row",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return call[3]  # the op's tensor outputs, unchanged

    def _record(
        self,
        index: int,
        comm: CommOp,
        args: tuple,
        kwargs: dict,
        out: Any,
        outs: list[Tensor],
        t0: int,
        t1: int,
    ) -> list[Tensor]:
        recorder = self.recorder
        if comm.spec is None:
            if comm.is_wait:
                self.waited(args, t1)
            elif comm.func == "_wrap_tensor_autograd" and args and isinstance(args[0], Tensor):
                # It wraps a functional collective's result: a wait on what it returns completes that one.
                tag = getattr(args[0], _TAG, None)
                if tag is not None and tag[0] == recorder.token and tag[1] in self._functional:
                    self._wrapped[index] = self._functional[tag[1]]
            return outs
        spec = comm.spec
        group_arg = comm.arg("process_group", args, kwargs) if "process_group" in comm._pos else None
        if group_arg is None and "group_name" in comm._pos:
            group_arg = comm.arg("group_name", args, kwargs)
        group = self._group(group_arg)
        ranks = group.ranks if group is not None else ()

        inputs = _flat(comm.arg(spec.inputs, args, kwargs))
        if spec.outputs == "return":
            data_outs = _flat(out)
        else:
            data_outs = _flat(comm.arg(spec.outputs, args, kwargs))
        first = inputs[0] if inputs else (data_outs[0] if data_outs else None)
        backend = ""
        if group is not None:
            backend = group.backend_for(first.device.type) if first is not None else group.backend
        seq = -1
        if group is not None and not (spec.func in P2P and backend == "nccl"):
            seq = int(group.pg._get_sequence_number_for_group())
        if spec.func == "barrier":
            inputs, data_outs = [], []  # the barrier's tensor is a placeholder, not data
        if data_outs and data_outs is not outs and [id(t) for t in data_outs] != [id(t) for t in outs]:
            outs = self._retag(recorder, index, data_outs)

        reduce_op = comm.arg(spec.reduce_op, args, kwargs)
        if reduce_op is not None and not isinstance(reduce_op, str):
            reduce_op = REDUCE_NAMES.get(int(reduce_op.op()), str(reduce_op.op()))
        root = _global(ranks, comm.arg(spec.root, args, kwargs, -1))
        peer = _global(ranks, comm.arg(spec.peer, args, kwargs, -1))
        in_numel = sum(t.numel() for t in inputs)
        is_async = comm.is_async(args, kwargs)
        bucket = -1
        if (
            spec.func == "all_reduce"
            and comm.ns == "c10d"
            and len(inputs) == 1
            and inputs[0].dim() == 1
            # NB: with find_unused_parameters DDP also all-reduces its used-parameter map (int32): no bucket.
            and (inputs[0].is_floating_point() or inputs[0].is_complex())
        ):
            task = torch._C._current_graph_task_id()
            if task != -1 and _issued_by_ddp():
                bucket = self._ddp.get(task, 0)
                self._ddp[task] = bucket + 1
        row_i = len(self.rows)
        self.rows.append(
            [
                index,
                spec.func,
                ranks,
                group.name if group is not None else "",
                group.desc if group is not None else "",
                seq,
                (reduce_op or "").lower(),
                root,
                peer,
                in_numel,
                sum(t.numel() for t in data_outs),
                str(first.dtype).replace("torch.", "") if first is not None else "",
                sum(t.numel() * t.element_size() for t in inputs),
                is_async,
                t0,
                -1,
                "issued",
                bucket,
                backend,
            ]
        )
        self._watch(row_i, comm, out, first, t1)
        if spec.func == "recv" and spec.peer is None and (work := _work(out)) is not None:
            self._any_source[row_i] = (work, ranks)  # its peer is known once the recv completed
        if not is_async and comm.ns == "c10d" and not (first is not None and first.is_cuda):
            # NB: on CUDA the blocking API only orders streams; it returns before the collective finished.
            self._blocking[row_i] = None
        if self._polled:
            self.poll()
        return outs

    def _watch(self, row_i: int, comm: CommOp, out: Any, first: Tensor | None, t1: int) -> None:
        if comm.ns != "c10d":
            index = self.rows[row_i][0]
            self._functional[index] = row_i
            if torch._C._current_graph_task_id() == -1:
                self.unlinked = index
            return
        work = _work(out)
        if work is None:
            self._done[row_i] = t1  # returned no Work: complete when the op returned
            return
        # Every Work is also polled: gloo's reduce_scatter and p2p Works have no future, the NCCL future
        # completes on enqueue (only is_completed(), on CUDA events, tells the truth there), and a gloo future
        # wakes its waiters before it runs callbacks or marks the Work complete, so a window closing right
        # after DDP's final wait can see neither: future.done() is already true then.
        if first is not None and first.is_cuda:
            self._polled.append((row_i, work, None))
            return
        try:
            fut = work.get_future()
        except RuntimeError:  # a backend whose Work has no future: polling alone
            self._polled.append((row_i, work, None))
            return
        self._polled.append((row_i, work, fut))
        done = self._done

        def _on_done(fut_: Any, row_i: int = row_i) -> None:
            if not _failed(fut_):
                done.setdefault(row_i, _perf_ns())

        fut.add_done_callback(_on_done)

    def _retag(self, recorder: Any, index: int, data_outs: list[Tensor]) -> list[Tensor]:
        """Tag the tensors the collective wrote (c10d returns some only through its arguments) and fix the
        op row's output columns to describe them."""
        token = recorder.token
        for pos, t in enumerate(data_outs):
            setattr(t, _TAG, (token, index, pos))
        row = list(recorder.rows[index])
        row[FIELD_INDEX["out_shapes"]] = tuple([tuple(t.shape) for t in data_outs])
        row[FIELD_INDEX["dtype"]] = dtype_name(data_outs[0].dtype)
        row[FIELD_INDEX["device"]] = device_name(data_outs[0].device)
        row[FIELD_INDEX["out_bytes"]] = sum(t.numel() * t.element_size() for t in data_outs)
        recorder.rows[index] = tuple(row)
        return data_outs

    def waited(self, args: tuple, t1: int) -> None:
        """A ``wait_tensor(args[0])`` returned at perf-counter ``t1``: the functional collective that made the
        tensor (directly or through ``_wrap_tensor_autograd``) completed by then."""
        tag = getattr(args[0], _TAG, None) if args and isinstance(args[0], Tensor) else None
        if tag is not None and tag[0] == self.recorder.token:
            row_i = self._functional.get(tag[1])
            if row_i is None:
                row_i = self._wrapped.get(tag[1])
            if row_i is not None:
                self._done.setdefault(row_i, t1)
                self.recorder.training.arrived(self.rows[row_i][0], reader=False)

    def poll(self) -> None:
        """Check (without waiting) the works whose completion only ``is_completed()`` reports."""
        still = []
        done, blocking = self._done, self._blocking
        for row_i, work, fut in self._polled:
            if row_i in done:
                continue
            try:
                finished = work.is_completed() or (fut is not None and fut.done())
            except RuntimeError:  # the work failed: it never completed
                continue
            if finished and fut is not None and fut.done() and _failed(fut):
                continue  # finished with an error (a timeout, a dead peer): it never completed
            if not finished:
                still.append((row_i, work, fut))
            elif row_i in blocking:
                self._sync_polled[row_i] = _perf_ns()
            else:
                done[row_i] = _perf_ns()
        self._polled = still

    def columns(self, op_columns: dict[str, list] | None = None) -> dict[str, list]:
        """The collective table as columns (``schema.COLLECTIVE_FIELDS`` order), completion resolved so far.

        Never blocks: a collective not seen complete stays ``issued`` (what a post-mortem wants to see).
        ``op_columns`` (the op table) lets a functional collective whose result another op read count as
        completed by the end of its first reader (NB: an upper bound; the AsyncCollectiveTensor waited inside
        that op's dispatch, where no mode sees it).
        """
        self.poll()
        offset = self.recorder.clock_offset_ns
        done = dict(self._done)
        if op_columns is not None and self._functional:
            done.update(_first_reader_ends(self._functional, done, op_columns, offset))
        n_ops = len(op_columns["start_ns"]) if op_columns is not None else 0
        for row_i in self._blocking:
            if row_i in done:
                continue
            # The blocking API returns only after Work.wait(): once the next op started, the collective had
            # completed. Gloo's reduce_scatter Work has no future and never reports is_completed(), so this is
            # the only sign it finished. NB: an upper bound.
            nxt = self.rows[row_i][0] + 1
            seen = self._sync_polled.get(row_i)
            if nxt < n_ops:
                start = op_columns["start_ns"][nxt] - offset
                done[row_i] = min(seen, start) if seen is not None else start
            elif seen is not None:
                done[row_i] = seen
        names = field_names(COLLECTIVE_FIELDS)
        cols: dict[str, list] = {name: [] for name in names}
        i_issue, i_complete, i_state = _COLUMN["issue_ns"], _COLUMN["complete_ns"], _COLUMN["state"]
        for row_i, (work, ranks) in list(self._any_source.items()):
            if row_i in done:
                try:
                    self.rows[row_i][_COLUMN["peer"]] = _global(ranks, work._source_rank())
                except RuntimeError:
                    continue  # gloo raises until the source is known
                del self._any_source[row_i]
        for row_i, row in enumerate(self.rows):
            row = list(row)
            row[i_issue] += offset  # rows hold perf-counter ns, like the recorder's; the table is epoch ns
            t = done.get(row_i)
            if t is not None:
                row[i_complete] = t + offset
                row[i_state] = "completed"
            for name, value in zip(names, row):
                cols[name].append(value)
        return cols


def _failed(fut: Any) -> bool:
    """Whether a done Work future finished with an error rather than a result (its value() raises)."""
    try:
        fut.value()
    except Exception:  # noqa: BLE001 - any error means the collective did not complete
        return True
    return False


def _first_reader_ends(
    functional: dict[int, int], done: dict[int, int], op_columns: dict[str, list], offset: int
) -> dict[int, int]:
    pending = {op: row for op, row in functional.items() if row not in done}
    if not pending:
        return {}
    # _wrap_tensor_autograd only wraps the result, and a view of an AsyncCollectiveTensor does not wait for it
    # (TP's to_local output reshaped): their readers read the collective.
    wraps: dict[int, int] = {}
    found: dict[int, int] = {}
    viewed: dict[int, int] = {}  # the end of the first view, for a result only views of which were read
    starts, durations = op_columns["start_ns"], op_columns["duration_ns"]
    columns = zip(op_columns["func"], op_columns["kind"], op_columns["parents"])
    for i, (func, kind, parents) in enumerate(columns):
        if (func == "_wrap_tensor_autograd" or kind == "view") and len(parents) == 1:
            src = wraps.get(parents[0], parents[0])
            if src in pending:
                wraps[i] = src
                if kind == "view":
                    viewed.setdefault(pending[src], starts[i] + durations[i] - offset)
                continue
        for p in parents:
            src = wraps.get(p, p)
            row = pending.get(src)
            if row is not None and row not in found:
                # start_ns is already on the epoch clock; _done holds perf-counter ns.
                found[row] = starts[i] + durations[i] - offset
    # NB: a result only views of which were read (their readers ran inside a subclass's dispatch, unrecorded)
    # gets the end of its first view: the only recorded sign of its use, not a proven completion.
    return {**viewed, **found}


# Who calls into the dispatcher when DDP all-reduces a bucket: its C++ reducer, inside the autograd engine
# (no Python frame, or the engine's Python entry point), a comm hook, or DDP's Python reducer.
_DDP_CALLERS = tuple(
    _TORCH_DIR + d
    for d in (
        "autograd" + os.sep,
        f"distributed{os.sep}algorithms{os.sep}ddp_comm_hooks{os.sep}",
        f"nn{os.sep}parallel{os.sep}",
    )
)


def _issued_by_ddp() -> bool:
    """Was the all-reduce being recorded issued by DDP, not by user code running in backward (a tensor hook
    calling ``dist.all_reduce``)? Decided by the first Python frame outside the dispatch plumbing."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(DISPATCH_PLUMBING):
        frame = frame.f_back
    return frame is None or frame.f_code.co_filename.startswith(_DDP_CALLERS)


def _work(out: Any) -> Any:
    items = out if isinstance(out, (tuple, list)) else (out,)
    for item in items:
        if type(item).__name__ == "ScriptObject":
            try:
                return torch._C._distributed_c10d.Work.unbox(item)
            except RuntimeError:
                return None
    return None


def _global(ranks: tuple[int, ...], group_rank: Any) -> int:
    if group_rank is None or group_rank < 0:
        return -1
    return ranks[group_rank] if group_rank < len(ranks) else -1
