"""What the Lightning callback logs for one captured step, from every rank's :class:`StepTelemetry`.

Framework-free: each rank turns its window's telemetry into a flat list of floats (:func:`rank_scalars`,
:func:`rank_module_values`), the callback gathers the lists with the strategy (one row per rank), and
:func:`step_metrics` turns the rows into the logged names. The names and their definitions are listed once, in
``docs/lightning.md``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tl_dist.merge.clocks import estimate_clocks
from tl_dist.merge.match import Entry, Joined
from tl_dist.merge.timing import step_timing, straggler_rows
from tl_dist.step_facts import straggler

if TYPE_CHECKING:
    from tl_dist.telemetry import StepTelemetry

SCALARS = (
    "wall_ns",
    "compute_ns",
    "comm_ns",
    "forward_ns",
    "backward_ns",
    "optimizer_ns",
    "recompute_ns",
    "flops",
    "peak_flops",  # the device's peak FLOP/s; 0 when unknown (CPU)
    # 2 when the window's first non-finite value arose here, 1 when a collective brought it from another rank,
    # 0 when none was recorded (statistics on)
    "nonfinite",
    "modules_key",  # crc32 of the module addresses: the module rows are gathered only when all ranks agree
)
_AT = {name: k for k, name in enumerate(SCALARS)}
TIMED_DEPTH = 2
"""Modules logged with their time: addresses with at most this many segments (``encoder.layers``)."""
TOP_MODULES = 5
"""How many of them are logged per captured step: the slowest."""
_ABSENT = -1.0  # a norm no rank recorded (real norms are >= 0 or NaN)


def module_addresses(named_modules: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(timed, all): the addresses whose time is gathered (depth <= :data:`TIMED_DEPTH`) and every address
    (for norms), in ``named_modules()`` order; the root ``''`` (the whole LightningModule) is left out."""
    every = tuple(a for a in named_modules if a)
    return tuple(a for a in every if a.count(".") < TIMED_DEPTH), every


def modules_key(timed: Sequence[str], every: Sequence[str]) -> float:
    """A number equal on ranks whose module trees are equal (so their module rows line up)."""
    return float(zlib.crc32("\n".join((*timed, "", *every)).encode()))


def rank_scalars(t: StepTelemetry, key: float) -> list[float]:
    """This rank's row of :data:`SCALARS`."""
    values = {
        "wall_ns": t.wall_ns,
        "compute_ns": t.compute_ns,
        "comm_ns": t.comm_ns,
        "forward_ns": t.op_ns.get("forward", 0),
        "backward_ns": t.op_ns.get("backward", 0),
        "optimizer_ns": t.op_ns.get("optimizer", 0),
        "recompute_ns": t.op_ns.get("recompute", 0),
        "flops": t.total_flops,
        "peak_flops": t.peak_flops or 0.0,
        "nonfinite": _nonfinite_origin(t.first_nonfinite),
        "modules_key": key,
    }
    return [float(values[name]) for name in SCALARS]


def _nonfinite_origin(first: dict | None) -> float:
    if first is None:
        return 0.0
    return 1.0 if first.get("kind") == "collective" else 2.0


def failed_scalars() -> list[float]:
    """The row of a rank whose telemetry could not be computed: NaN times, and a key no rank matches."""
    row = [math.nan] * len(SCALARS)
    row[_AT["nonfinite"]] = 0.0
    row[_AT["modules_key"]] = -1.0
    return row


def rank_module_values(t: StepTelemetry, timed: Sequence[str], every: Sequence[str]) -> list[float]:
    """This rank's module row: inclusive ns (all phases) of each ``timed`` module, then the output and the
    gradient L2 norm of each module in ``every`` (-1 where the window recorded none)."""
    ns: dict[str, int] = {}
    for row in t.modules:
        ns[row.module] = ns.get(row.module, 0) + row.duration_ns
    norms = {(row.module, row.of): row.norm for row in t.norms}
    out = [float(ns.get(a, 0)) for a in timed]
    for of in ("out", "grad"):
        out += [float(norms.get((a, of), _ABSENT)) for a in every]
    return out


MAX_ARRIVALS = 1024
"""Collectives per rank and step the straggler is computed from (the first ones; NB: a step with more is
judged on its first MAX_ARRIVALS)."""
_ARRIVAL = 5  # group key, seq, issue_ns, complete_ns, role (0 a collective, 1 a send, 2 a receive)
_ROLE_CODE = {"": 0, "send": 1, "recv": 2}
_ROLE_FUNC = {1: "send", 2: "recv"}


def rank_arrivals(t: StepTelemetry | None, metadata: dict) -> list[int]:
    """This rank's fixed-length int row for the straggler: its clock's key (host and boot, as the merge tells
    clocks apart), how many arrivals follow, then (group key, seq, issue_ns, complete_ns, role) per completed
    collective or point-to-point transfer (``StepTelemetry.arrivals``), zero-padded to :data:`MAX_ARRIVALS`."""
    boot = metadata.get("boot_id") or ""
    clock = zlib.crc32(f"{metadata.get('host') or ''}\n{boot}".encode()) if boot else -1
    arrivals = t.arrivals[:MAX_ARRIVALS] if t is not None else ()
    row = [clock, len(arrivals)]
    for group, seq, issue, complete, role in arrivals:
        key = ("p2p:" if role else "") + ",".join(map(str, group))  # a pair (src, dst) is not a group
        row += [zlib.crc32(key.encode()), seq, issue, complete, _ROLE_CODE[role]]
    return row + [0] * (2 + _ARRIVAL * MAX_ARRIVALS - len(row))


def step_straggler(step: int, rows: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """The straggler of a step from the gathered :func:`rank_arrivals` rows (``rows[r]`` of rank ``r``):
    ``tl_dist.step_facts.straggler`` of the rows the merge's ``stragglers()`` computes, by the same code (the
    collectives joined by (group, seq), clocks estimated as the merge estimates them)."""
    by_key: dict[tuple[int, int, bool], dict[int, Entry]] = {}
    clock_of: dict[int, tuple] = {}
    for rank, row in enumerate(rows):
        clock_of[rank] = ("host", row[0]) if row[0] != -1 else ("rank", rank)
        for k in range(int(row[1])):
            key, seq, issue, complete, role = (int(v) for v in row[2 + _ARRIVAL * k : 2 + _ARRIVAL * (k + 1)])
            func = _ROLE_FUNC.get(role, "")
            by_key.setdefault((key, seq, bool(role)), {})[rank] = Entry(
                rank, k, -1, func, (), "", seq, -1, -1, 0, 0, "", 0, False, issue, complete, "completed",
                "", "", "", False, (0, 0, 0),
            )  # fmt: skip
    joined = [
        Joined(step, tuple(sorted(entries)), str(key), entries, tuple(sorted(entries)), (), p2p=p2p)
        for (key, _seq, p2p), entries in by_key.items()
        if len(entries) >= 2
    ]
    if not joined:
        return None
    clocks = estimate_clocks(joined, clock_of)
    return straggler(straggler_rows(step, joined, step_timing(joined, clocks)))


def step_metrics(
    scalars: Sequence[Sequence[float]],
    modules: Sequence[Sequence[float]] | None,
    timed: Sequence[str],
    every: Sequence[str],
    *,
    statistics: bool,
    late: tuple[int, int] | None = None,
) -> dict[str, float]:
    """The logged metrics of one captured step from the gathered rows (``scalars[r]``, ``modules[r]`` of rank
    ``r``; ``modules`` None when the ranks' module trees differ; ``late``: the step's straggler,
    :func:`step_straggler`). Definitions: ``docs/lightning.md``."""

    def column(name: str) -> list[float]:
        return [row[_AT[name]] for row in scalars]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    wall, comm, flops = column("wall_ns"), column("comm_ns"), column("flops")
    total_flops = sum(flops)
    slowest_wall = max(wall)
    metrics: dict[str, float] = {"tl/step_flops": total_flops}
    metrics["tl/flops_per_sec"] = total_flops / (slowest_wall / 1e9) if slowest_wall > 0 else 0.0
    peaks = column("peak_flops")
    if all(p > 0 for p in peaks):
        metrics["tl/mfu"] = metrics["tl/flops_per_sec"] / sum(peaks)
    for phase in ("forward", "backward", "optimizer"):
        metrics[f"tl/{phase}_ms"] = mean(column(f"{phase}_ns")) / 1e6
    recompute = column("recompute_ns")
    if any(v > 0 for v in recompute):
        metrics["tl/recompute_ms"] = mean(recompute) / 1e6
    metrics["tl/comm_ms"] = mean(comm) / 1e6
    for r, row in enumerate(scalars):
        metrics[f"tl/rank{r}/step_ms"] = row[_AT["wall_ns"]] / 1e6  # the window, enter -> leave
        metrics[f"tl/rank{r}/compute_ms"] = row[_AT["compute_ns"]] / 1e6
        metrics[f"tl/rank{r}/comm_ms"] = row[_AT["comm_ns"]] / 1e6
    # The straggler (tl_dist.step_facts.straggler): the rank the others waited for longest, and that wait;
    # -1 and 0 when nobody waited beyond the clock uncertainty.
    metrics["tl/straggler_rank"] = float(late[0]) if late is not None else -1.0
    metrics["tl/straggler_wait_ms"] = late[1] / 1e6 if late is not None else 0.0
    if statistics:
        metrics["tl/nonfinite_ranks"] = sum(v > 0 for v in column("nonfinite"))
    if modules is None:
        return metrics
    n = len(timed)
    times = [(mean([row[k] for row in modules]), a) for k, a in enumerate(timed)]
    for ns, address in sorted((t for t in times if t[0] > 0), key=lambda t: (-t[0], t[1]))[:TOP_MODULES]:
        metrics[f"tl/module/{address}/ms"] = ns / 1e6
    for part, of in enumerate(("out", "grad")):
        base = n + part * len(every)
        for k, address in enumerate(every):
            values = [row[base + k] for row in modules]
            if any(math.isnan(v) for v in values):
                metrics[f"tl/norm/{address}/{of}"] = math.nan
            elif max(values) != _ABSENT:
                metrics[f"tl/norm/{address}/{of}"] = max(values)
    return metrics


def nonfinite_message(step: int, bad_ranks: Sequence[int], first: dict) -> str:
    """One sentence naming the step, the ranks, and the first rank's op, module, source and phase."""
    where = f" at {first['source']}" if first.get("source") else ""
    return (
        f"tl_dist: non-finite value at step {step} on rank(s) {list(bad_ranks)}; first on rank "
        f"{first['rank']}: op {first['label']} ({first['func']}) in module {first['module']!r}{where}, "
        f"{first['phase']} phase"
    )
