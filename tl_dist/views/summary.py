"""A readable text summary of a trace: totals, time and FLOPs per module, and the most expensive ops.

Example:
    >>> print(tl.trace(model, x).summary(top=5))
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from ..schema import OUTSIDE
from ..step_facts import window_facts
from ..telemetry import summarize

if TYPE_CHECKING:
    from ..trace import Trace


def format_ns(ns: float) -> str:
    """A duration in the largest unit that keeps it >= 1: ``1.50 ms``, ``820.0 us``, ``95 ns``."""
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{int(ns)} ns"


def format_count(n: float, unit: str = "") -> str:
    """A count with an SI prefix: ``1.82 G``, ``3.0 k``; ``0`` stays ``0``."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{int(n)} {unit}".rstrip()


def format_bytes(n: int) -> str:
    """Bytes in binary units: ``1.50 MiB``."""
    for scale, prefix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n} B"


def format_shape(shape: Any) -> str:
    """``(2, 64, 56, 56)`` -> ``2x64x56x56``; a 0-d tensor is ``scalar``; no tensor is ``-``."""
    if shape is None:
        return "-"
    return "x".join(map(str, shape)) if len(shape) else "scalar"


def render_table(header: tuple[str, ...], rows: list[tuple[str, ...]], *, right: frozenset[int]) -> str:
    """Columns padded to their widest cell; columns whose position is in ``right`` are right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], len(cell))

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def saved_bytes(trace: Trace) -> int:
    """Bytes of the saved op outputs.

    In memory each saved tensor counts with its own size. A trace loaded from a shard reads its tensors
    lazily; reading them all to count bytes would cost a full pass over the file, so its saved ops count
    with their ``out_bytes`` from the op table instead.

    NB: saved views of one tensor are counted once each, so this can exceed the memory actually held.
    """
    saved = trace.saved
    if not isinstance(saved, dict):
        out_bytes = trace.columns["out_bytes"]
        return sum(out_bytes[i] for i in saved)
    total = 0
    for outs in saved.values():
        for t in outs:
            if t is not None:
                total += t.nelement() * t.element_size()
    return total


def module_rows(trace: Trace) -> list[dict[str, Any]]:
    """One dict per module address, in order of first call: type, calls, depth and inclusive ops/time/FLOPs
    over every phase (a module's backward ops are those of its forward ops, see ``tl_dist.telemetry``). A
    trailing row collects the ops run outside every module (a top-level loss, the optimizer, the loss seed)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in summarize(trace).modules:
        row = rows.get(r.module)
        if row is None:
            row = rows[r.module] = {
                "address": r.module,
                "type": r.type,
                "depth": r.depth if r.module != OUTSIDE else 0,
                "calls": r.calls,
                "ops": 0,
                "duration_ns": 0,
                "flops": 0,
            }
        row["ops"] += r.ops
        row["duration_ns"] += r.duration_ns
        row["flops"] += r.flops
    outside = rows.pop(OUTSIDE, None)
    return [*rows.values(), *([outside] if outside else [])]


def _short_source(source: str) -> str:
    # file:line with the directory dropped: the full path rarely fits a terminal line.
    if not source:
        return ""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def timing_caveat(metadata: dict[str, Any]) -> str:
    """Why a trace's CPU timings may be inflated, from what its capture recorded ('' when nothing says so):
    ``OMP_WAIT_POLICY`` other than ``PASSIVE`` with more torch threads than cores. OpenMP threads then spin
    while they wait, and on a busy machine an op waits for cores its own threads keep busy.

    Example:
        >>> timing_caveat({"torch_threads": 4, "cpu_cores": 2, "omp_wait_policy": ""})
        'NB: timings may be inflated: OMP_WAIT_POLICY is unset (not PASSIVE) with 4 torch threads on 2 cores; ...'
    """
    threads, cores = metadata.get("torch_threads"), metadata.get("cpu_cores")
    policy = metadata.get("omp_wait_policy")
    if threads is None or cores is None or policy is None or policy.upper() == "PASSIVE" or threads <= cores:
        return ""
    setting = f"is {policy}" if policy else "is unset"
    return (
        f"NB: timings may be inflated: OMP_WAIT_POLICY {setting} (not PASSIVE) with {threads} torch threads on "
        f"{cores} cores; OpenMP threads spin while waiting and slow ops down on a busy machine: set "
        "OMP_WAIT_POLICY=PASSIVE before starting Python (make does), or fewer threads (torch.set_num_threads)"
    )


def summary(trace: Trace, *, top: int = 10) -> str:
    """A readable table of ``trace``: totals, each module's inclusive time and FLOPs, the ``top`` slowest ops.

    Args:
        trace: the trace to summarise.
        top: how many of the most expensive ops (by duration) to list; 0 leaves the list out.

    Returns:
        The summary as one multi-line string.

    Example:
        >>> trace = tl.trace(model, x)  # the small CNN of examples/demo.py
        >>> print(trace.summary(top=5))
        tl_dist trace: 17 ops, 15 module calls, 5.55 ms in ops, 41.29 MFLOP, 17 saved ops (2.50 MiB)
        ...
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be a non-negative int (how many ops to list), got {top!r}")
    cols = trace.columns
    n_ops = len(trace)
    total_ns = sum(cols["duration_ns"])
    total_flops = sum(cols["flops"])
    n_calls = len(trace.module_table["address"])
    where = ""
    if trace.rank is not None:
        where = f" of rank {trace.rank}" + (f"/{trace.world_size}" if trace.world_size is not None else "")
    if trace.step is not None:
        where += f" step {trace.step}"
    lines = [
        f"tl_dist trace{where}: {n_ops} ops, {n_calls} module calls, {format_ns(total_ns)} in ops, "
        f"{format_count(total_flops, 'FLOP')}, {len(trace.saved)} saved ops ({format_bytes(saved_bytes(trace))})"
    ]
    caveat = timing_caveat(trace.metadata)
    if caveat:
        lines.append(caveat)
    if trace.failed_op:
        failed = trace.failed_op
        lines.append(
            f"failed at op {failed['index']} ({failed['func']} in {failed['module'] or OUTSIDE}): "
            f"{failed['error']}"
        )
    if trace.metadata.get("window_start_ns") is not None:
        f = window_facts(trace)  # the step facts every view shows (docs/telemetry.md, "Step facts")
        lines.append(
            f"window {format_ns(f['window_ns'])} (enter -> leave): idle {format_ns(f['idle_before_ns'])} before "
            f"the first op, {format_ns(f['idle_after_ns'])} after the last; compute {format_ns(f['compute_ns'])}, "
            f"communication {format_ns(f['comm_ns'])}"
        )

    mod_rows = module_rows(trace)
    if mod_rows:
        body = []
        for row in mod_rows:
            share = 100.0 * row["duration_ns"] / total_ns if total_ns else 0.0
            name = row["address"] or "<root>"
            body.append(
                (
                    "  " * row["depth"] + name,
                    row["type"],
                    str(row["calls"]) if row["calls"] else "",
                    str(row["ops"]),
                    format_ns(row["duration_ns"]),
                    f"{share:.1f}%",
                    format_count(row["flops"]),
                )
            )
        header = ("module", "type", "calls", "ops", "time", "time %", "FLOPs")
        lines += [
            "",
            "Per module (inclusive of submodules):",
            render_table(header, body, right=frozenset({2, 3, 4, 5, 6})),
        ]

    if top and n_ops:
        durations = cols["duration_ns"]
        order = sorted(range(n_ops), key=durations.__getitem__, reverse=True)[:top]
        body = []
        for i in order:
            shapes = cols["out_shapes"][i]
            share = 100.0 * durations[i] / total_ns if total_ns else 0.0
            body.append(
                (
                    str(i),
                    cols["label"][i],
                    (cols["module"][i] or "<root>") if cols["module_stack"][i] else OUTSIDE,
                    format_shape(tuple(shapes[0]) if shapes else None),
                    format_ns(durations[i]),
                    f"{share:.1f}%",
                    format_count(cols["flops"][i]),
                    _short_source(cols["source"][i]),
                )
            )
        header = ("#", "op", "module", "shape", "time", "time %", "FLOPs", "source")
        lines += [
            "",
            f"Top {len(order)} ops by time:",
            render_table(header, body, right=frozenset({0, 4, 5, 6})),
        ]
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    # NO_MODULE was this module's alias of the outside-every-module name; kept for one release.
    if name == "NO_MODULE":
        warnings.warn(
            "tl_dist.views.summary.NO_MODULE is deprecated; use tl_dist.schema.OUTSIDE",
            DeprecationWarning,
            stacklevel=2,
        )
        return OUTSIDE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
