"""Per-step telemetry of one capture window: :func:`summarize` turns a trace into a :class:`StepTelemetry`.

Framework-free (no OpenTelemetry, no Lightning): every sink gets the same summary (the sink worker computes it
once per window), and the exporters and the Lightning callback are thin adapters over it.

Example:
    >>> with tl.capture() as cap:
    ...     loss = model(x).sum(); loss.backward(); opt.step()
    >>> t = tl.telemetry.summarize(cap.trace)
    >>> t.op_ns["backward"], t.flops["forward"], t.flops_per_second
    >>> t.frame("modules").query("phase == 'backward'").nlargest(5, "duration_ns")

Definitions (docs/telemetry.md has them all):

- Inclusive per-module numbers count an op for every module on its ``module_stack``; backward ops carry the
  stack of the forward op they differentiate, so a module's backward time is the backward of its forward.
- ``wall_ns``, ``idle_before_ns``, ``idle_after_ns``, ``compute_ns``, ``comm_ns`` are the window's step facts
  (:mod:`tl_dist.step_facts`: the same numbers ``time_breakdown()`` and the report show); ``flops_per_second`` =
  all FLOPs / wall time, as MFU is defined.
- A compiled region (an op of kind ``compiled``) counts for the modules of the ATen ops inside it: its time is
  split over their module stacks in proportion to their FLOPs (``docs/compile.md``).
- Collective bandwidth follows nccl-tests: ``algbw = size / time`` with ``size`` the larger of the input and
  output buffers, and ``busbw = algbw * factor``: ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather,
  reduce_scatter, all_to_all, gather and scatter, ``1`` for broadcast, reduce and point-to-point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .schema import DEVICE_PEAK_FLOPS, OUTSIDE, P2P_ROLES, PHASES, bus_factor, module_name  # noqa: F401 (old paths)
from .step_facts import bus_bandwidth, window_facts
from .trace import first_nonfinite, nonfinite_value

if TYPE_CHECKING:
    import pandas as pd

    from .trace import Trace

_ITEMSIZE: dict[str, int] = {}


class ModuleRow(NamedTuple):
    """Inclusive totals of one module (its submodules included) in one phase."""

    module: str
    type: str
    depth: int
    phase: str
    calls: int  # forward calls of the module in the window
    ops: int
    duration_ns: int
    flops: int
    out_bytes: int


class FuncRow(NamedTuple):
    """Totals of one op func (``convolution``, ``mm``, ...) in one phase."""

    func: str
    phase: str
    count: int
    duration_ns: int
    flops: int
    out_bytes: int


class CollectiveRow(NamedTuple):
    """Totals of one collective kind on one process group; bandwidths in bytes/s (nccl-tests definitions)."""

    kind: str
    group: str
    group_size: int
    count: int
    completed: int
    bytes: int  # sum of the nccl-tests `size` (larger of input and output buffers) of completed ones
    duration_ns: int  # sum of issue -> completion of completed ones
    algbw: float
    busbw: float


class NormRow(NamedTuple):
    """Statistics of a module call's output (``of="out"``) or its gradient (``of="grad"``): the last call's."""

    module: str
    of: str
    norm: float
    mean: float
    std: float
    min: float
    max: float


class NonfiniteRow(NamedTuple):
    """How many recorded values of ops in ``module`` held NaN (or +-Inf in gradients and in the outputs of
    backward and optimizer ops): the values :func:`~tl_dist.training.first_nonfinite` looks at by default."""

    module: str
    of: str
    count: int


@dataclass(frozen=True)
class StepTelemetry:
    """What one window (a training step) did, for dashboards and alerts. Times in ns, FLOPs as counts.

    ``op_ns`` and ``flops`` are per phase (``forward``, ``backward``, ``optimizer``, ``recompute``); the tables
    are tuples of named rows (``frame(name)`` makes a DataFrame of one).
    """

    step: int | None
    rank: int
    world_size: int
    run_id: str | None
    wall_ns: int
    op_ns: dict[str, int]
    flops: dict[str, int]
    total_flops: int
    compute_ns: int  # time in ops that are not collectives (step_facts)
    comm_ns: int  # time covered by at least one collective (step_facts)
    flops_per_second: float
    peak_flops: float | None
    mfu: float | None
    device: str
    modules: tuple[ModuleRow, ...]
    funcs: tuple[FuncRow, ...]
    collectives: tuple[CollectiveRow, ...]
    norms: tuple[NormRow, ...]
    nonfinite: tuple[NonfiniteRow, ...]
    first_nonfinite: dict[str, Any] | None  # label, index, func, kind, module, source, phase (stats only)
    idle_before_ns: int = 0  # window start -> first op (step_facts)
    idle_after_ns: int = 0  # last op end -> window end (step_facts)
    # Per completed collective: (group ranks, seq, issue_ns, complete_ns, role) -- what the straggler is
    # computed from once the ranks' rows are gathered (the Lightning callback: tl/straggler_rank). role is ""
    # for a collective; "send" / "recv" for point-to-point, whose "group" is (src, dst) and seq the pair's
    # n-th transfer in the window (as the merge pairs them).
    arrivals: tuple[tuple[tuple[int, ...], int, int, int, str], ...] = ()

    def frame(self, table: str) -> pd.DataFrame:
        """One of ``modules``, ``funcs``, ``collectives``, ``norms``, ``nonfinite`` as a pandas DataFrame.

        Example:
            >>> t.frame("funcs").sort_values("duration_ns", ascending=False).head()
        """
        import pandas as pd

        row_types = {
            "modules": ModuleRow,
            "funcs": FuncRow,
            "collectives": CollectiveRow,
            "norms": NormRow,
            "nonfinite": NonfiniteRow,
        }
        if table not in row_types:
            raise ValueError(f"table must be one of {sorted(row_types)}, got {table!r}")
        return pd.DataFrame(list(getattr(self, table)), columns=list(row_types[table]._fields))

    def module_time(self, module: str = "", phases: tuple[str, ...] = PHASES) -> int:
        """Inclusive ns of ``module`` summed over ``phases`` (0 if it ran no op)."""
        return sum(r.duration_ns for r in self.modules if r.module == module and r.phase in phases)


def peak_flops_for(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` (as ``torch.cuda.get_device_name`` says it) for ``dtype``
    (``"bfloat16"``, ``"float16"``, ``"float32"``), from :data:`DEVICE_PEAK_FLOPS`; None when unknown.

    Example:
        >>> peak_flops_for("NVIDIA H100 80GB HBM3", "bfloat16")
        989000000000000.0
    """
    for fragment, peaks in DEVICE_PEAK_FLOPS.items():
        if fragment in device_name:
            if dtype == "float32" and torch.backends.cuda.matmul.allow_tf32 and "tf32" in peaks:
                return peaks["tf32"]
            return peaks.get(dtype)
    return None


def summarize(trace: Trace, *, peak_flops: float | None = None) -> StepTelemetry:
    """The :class:`StepTelemetry` of one window.

    Args:
        trace: a trace from ``tl.capture``/``tl.trace`` (or ``tl.load``).
        peak_flops: the hardware's peak FLOP/s, for MFU. None: looked up for the window's GPU and dominant
            dtype in :data:`DEVICE_PEAK_FLOPS` (no MFU on CPU or unknown devices).

    Example:
        >>> t = tl.telemetry.summarize(cap.trace)
        >>> t.module_time("encoder", ("forward", "backward")) / 1e6  # ms
    """
    if peak_flops is not None and (
        isinstance(peak_flops, bool)
        or not isinstance(peak_flops, (int, float))
        or not 0 < peak_flops < math.inf  # NaN fails both
    ):
        raise ValueError(f"peak_flops must be a positive number (FLOP/s) or None, got {peak_flops!r}")
    cols = trace.columns
    meta = trace.metadata
    phases, durations, flops = cols["phase"], cols["duration_ns"], cols["flops"]
    out_bytes, kinds = cols["out_bytes"], cols["kind"]
    n = len(durations)

    op_ns = dict.fromkeys(PHASES, 0)
    phase_flops = dict.fromkeys(PHASES, 0)
    # One pass over the ops, grouped by (module stack, phase) and (func, phase); stacks repeat a lot.
    by_stack: dict[tuple[tuple[str, ...], str], list[int]] = {}
    by_func: dict[tuple[str, str], list[int]] = {}
    dtype_flops: dict[str, int] = {}
    regions = region_shares(trace) if trace.compiled_table["region"] else {}
    for i, (stack, phase, func, dur, fl, nbytes, kind) in enumerate(
        zip(cols["module_stack"], phases, cols["func"], durations, flops, out_bytes, kinds)
    ):
        op_ns[phase] = op_ns.get(phase, 0) + dur
        phase_flops[phase] = phase_flops.get(phase, 0) + fl
        shares = regions.get(i) if kind == "compiled" else None
        for stack_k, ops_k, dur_k, fl_k, bytes_k in (
            split_region(shares, dur, nbytes) if shares else ((stack, 1, dur, fl, nbytes),)
        ):
            _accumulate(by_stack, (stack_k, phase), ops_k, dur_k, fl_k, bytes_k)
        _accumulate(by_func, (func, phase), 1, dur, fl, nbytes)
        if fl:
            dtype = cols["dtype"][i]
            dtype_flops[dtype] = dtype_flops.get(dtype, 0) + fl

    modules = _module_rows(trace, by_stack)
    funcs = tuple(
        FuncRow(func, phase, *acc) for (func, phase), acc in sorted(by_func.items(), key=lambda kv: -kv[1][1])
    )
    facts = window_facts(trace)
    wall_ns = facts["window_ns"]
    total_flops = sum(phase_flops.values())
    fps = total_flops / (wall_ns / 1e9) if wall_ns > 0 else 0.0
    device = meta.get("device_name", "")
    if peak_flops is None and device and dtype_flops:
        peak_flops = peak_flops_for(device, max(dtype_flops, key=dtype_flops.get))
    collectives = collective_rows(trace.collective_table)
    norms, nonfinite = _stat_rows(trace)
    first = None
    if trace.stats_table["op"]:
        index = first_nonfinite(trace)
        if index is not None:
            first = {
                "index": index,
                "label": cols["label"][index],
                "func": cols["func"][index],
                "kind": cols["kind"][index],  # "collective": the value came from another rank
                "module": cols["module"][index] if cols["module_stack"][index] else OUTSIDE,
                "source": cols["source"][index],
                "phase": cols["phase"][index],
            }
    return StepTelemetry(
        step=meta.get("step"),
        rank=int(meta.get("rank", 0)),
        world_size=int(meta.get("world_size", 1)),
        run_id=meta.get("run_id"),
        wall_ns=wall_ns,
        op_ns=op_ns,
        flops=phase_flops,
        total_flops=total_flops,
        compute_ns=facts["compute_ns"],
        comm_ns=facts["comm_ns"],
        flops_per_second=fps,
        peak_flops=float(peak_flops) if peak_flops is not None else None,
        mfu=fps / peak_flops if peak_flops else None,
        device=device or (cols["device"][0] if n else ""),
        modules=modules,
        funcs=funcs,
        collectives=collectives,
        norms=norms,
        nonfinite=nonfinite,
        first_nonfinite=first,
        idle_before_ns=facts["idle_before_ns"],
        idle_after_ns=facts["idle_after_ns"],
        arrivals=_arrivals(trace.collective_table, int(meta.get("rank", 0))),
    )


def _arrivals(table: dict[str, list], rank: int) -> tuple[tuple[tuple[int, ...], int, int, int, str], ...]:
    out = []
    pairs: dict[tuple[int, int, str], int] = {}
    columns = ("group_ranks", "seq", "issue_ns", "complete_ns", "peer", "func")
    for ranks, seq, issue, complete, peer, func in zip(*(table[c] for c in columns)):
        if not complete >= issue >= 0:
            continue
        role = P2P_ROLES.get(func, "") if peer >= 0 else ""
        if not role:
            out.append((tuple(ranks), seq, issue, complete, ""))
            continue
        pair = (rank, peer) if role == "send" else (peer, rank)
        n = pairs[(*pair, role)] = pairs.get((*pair, role), 0) + 1
        out.append((pair, n, issue, complete, role))
    return tuple(out)


def _accumulate(table: dict[Any, list[int]], key: Any, ops: int, dur: int, fl: int, nbytes: int) -> None:
    """Adds (ops, ns, FLOPs, bytes) to ``table[key]``."""
    acc = table.get(key)
    if acc is None:
        acc = table[key] = [0, 0, 0, 0]
    acc[0] += ops
    acc[1] += dur
    acc[2] += fl
    acc[3] += nbytes


def region_shares(trace: Trace) -> dict[int, dict[tuple[str, ...], list[int]]]:
    """Compiled region (op index) -> module stack of its ATen ops -> [ops, FLOPs] (``trace.compiled_table``)."""
    table = trace.compiled_table
    shares: dict[int, dict[tuple[str, ...], list[int]]] = {}
    for region, stack, fl in zip(table["region"], table["module_stack"], table["flops"]):
        acc = shares.setdefault(region, {}).setdefault(stack, [0, 0])
        acc[0] += 1
        acc[1] += fl
    return shares


def split_region(
    shares: dict[tuple[str, ...], list[int]], dur: int, nbytes: int
) -> list[tuple[tuple[str, ...], int, int, int, int]]:
    """A region's time split over the module stacks of its ATen ops in proportion to their FLOPs (a region
    without FLOPs: to the stack of its first op); its output bytes go with the largest share. Integer ns that
    add up to ``dur`` exactly (the remainder goes to the largest share)."""
    total = sum(fl for _, fl in shares.values())
    largest = max(shares, key=lambda k: shares[k][1]) if total else next(iter(shares))
    parts = []
    given = 0
    for stack, (ops, fl) in shares.items():
        part = dur * fl // total if total else 0
        given += part
        parts.append([stack, ops, part, fl, 0])
    for part in parts:
        if part[0] == largest:
            part[2] += dur - given
            part[4] = nbytes
    return [tuple(p) for p in parts]


def _module_rows(
    trace: Trace, by_stack: dict[tuple[tuple[str, ...], str], list[int]]
) -> tuple[ModuleRow, ...]:
    table = trace.module_table
    info: dict[str, tuple[str, int]] = {}  # address -> (type, depth) of its first call
    calls: dict[str, int] = {}
    for address, mtype, depth in zip(table["address"], table["type"], table["depth"]):
        info.setdefault(address, (mtype, depth))
        calls[address] = calls.get(address, 0) + 1
    totals: dict[tuple[str, str], list[int]] = {}
    for (stack, phase), (ops, dur, fl, nbytes) in by_stack.items():
        # A module calling itself (the same address twice on one stack) counts its ops once.
        for address in dict.fromkeys(stack) if stack else (OUTSIDE,):
            _accumulate(totals, (address, phase), ops, dur, fl, nbytes)
    # Modules in the order of their first call; then those with ops but no call in the window (the backward of
    # a forward that ran before it) in the order of their first op; the ops outside every module last.
    order = {address: k for k, address in enumerate(info)}
    for address, _phase in totals:
        if address != OUTSIDE:
            order.setdefault(address, len(order))
    order[OUTSIDE] = len(order)
    info[OUTSIDE] = ("", 0)
    phase_order = {p: k for k, p in enumerate(PHASES)}
    rows = []
    for (address, phase), (ops, dur, fl, nbytes) in totals.items():
        # Depth of a module without a call here, from its address: "" 0, "enc" 1, "enc.0" 2.
        mtype, depth = info.get(address, ("", address.count(".") + 1 if address else 0))
        rows.append(ModuleRow(address, mtype, depth, phase, calls.get(address, 0), ops, dur, fl, nbytes))
    rows.sort(key=lambda r: (order[r.module], phase_order.get(r.phase, len(PHASES))))
    return tuple(rows)


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        dt = getattr(torch, dtype, None)
        size = _ITEMSIZE[dtype] = dt.itemsize if isinstance(dt, torch.dtype) else 0
    return size


def collective_bytes(in_numel: int, out_numel: int, dtype: str) -> int:
    """The size nccl-tests divides by the time for a collective's bandwidth: the larger of its input and output
    buffers on this rank, in bytes (an all_gather's output, a reduce_scatter's input).

    Example:
        >>> collective_bytes(256, 1024, "float32")  # all_gather of 256 floats on 4 ranks
        4096
    """
    return max(in_numel, out_numel) * _itemsize(dtype)


def collective_rows(table: dict[str, list]) -> tuple[CollectiveRow, ...]:
    """Per (kind, group) of one window's collective table: counts, bytes, time and bandwidth. busbw is
    :func:`tl_dist.step_facts.bus_bandwidth` of the summed size and the summed issue -> completion time of the
    completed ones on this rank (nccl-tests' definition); every view reports this one.

    Example:
        >>> [(r.kind, r.busbw) for r in collective_rows(trace.collective_table)]
    """
    groups: dict[tuple[str, str], list] = {}
    for func, ranks, name, desc, in_numel, out_numel, dtype, issue, complete in zip(
        table["func"],
        table["group_ranks"],
        table["group_name"],
        table["group_desc"],
        table["in_numel"],
        table["out_numel"],
        table["dtype"],
        table["issue_ns"],
        table["complete_ns"],
    ):
        group = desc or name or ",".join(map(str, ranks))
        acc = groups.get((func, group))
        if acc is None:
            acc = groups[(func, group)] = [len(ranks), 0, 0, 0, 0]
        acc[1] += 1
        if complete >= issue >= 0:
            acc[2] += 1
            acc[3] += collective_bytes(in_numel, out_numel, dtype)
            acc[4] += complete - issue
    rows = []
    for (func, group), (size, count, completed, nbytes, dur) in groups.items():
        algbw = nbytes / (dur / 1e9) if dur > 0 else 0.0
        busbw = bus_bandwidth(func, size, nbytes, dur)
        rows.append(CollectiveRow(func, group, size, count, completed, nbytes, dur, algbw, busbw))
    return tuple(rows)


def module_norms(trace: Trace) -> tuple[NormRow, ...]:
    """The norms fact (docs/telemetry.md "Step facts"): per module, the statistics of the tensor its last call
    returned and of the gradient w.r.t. that same tensor. A call that returned several (a dict of logits and
    loss) is represented by its first output leaf that has output statistics. Every view reads these rows.

    Example:
        >>> {(r.module, r.of): r.norm for r in module_norms(cap.trace)}[("encoder", "out")]
    """
    table = trace.stats_table
    if not table["op"]:
        return ()
    stats = {(op, of): k for k, (op, of) in enumerate(zip(table["op"], table["of"]))}
    calls = trace.module_table
    last: dict[str, int] = {}  # address -> its last call's row
    for row, address in enumerate(calls["address"]):
        last[address] = row
    rows = []
    for address, row in last.items():
        outs = [op for op in calls["out_ops"][row] if op >= 0]
        chosen = next((op for op in outs if (op, "out") in stats), None)
        if chosen is None:
            chosen = next((op for op in outs if (op, "grad") in stats), None)
        for of in ("out", "grad"):
            k = stats.get((chosen, of))
            if k is not None:
                values = (table[name][k] for name in ("norm", "mean", "std", "min", "max"))
                rows.append(NormRow(address, of, *values))
    return tuple(rows)


def _stat_rows(trace: Trace) -> tuple[tuple[NormRow, ...], tuple[NonfiniteRow, ...]]:
    table = trace.stats_table
    if not table["op"]:
        return (), ()
    cols = trace.columns
    bad: dict[tuple[str, str], int] = {}
    for k, (op, of) in enumerate(zip(table["op"], table["of"])):
        if nonfinite_value(of, cols["phase"][op], table["nan"][k], table["inf"][k]):
            module = cols["module"][op] if cols["module_stack"][op] else OUTSIDE
            bad[(module, of)] = bad.get((module, of), 0) + 1
    return module_norms(trace), tuple(NonfiniteRow(m, of, c) for (m, of), c in bad.items())
