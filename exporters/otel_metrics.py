"""Metrics of one window: fixed instrument names (dashboards and alerts rely on them), every point with
``tl.rank``. docs/telemetry.md lists them with their Prometheus names.

Histograms are in seconds with bucket advice from 1 µs to 100 s (1-2-5 per decade): the SDK's default
boundaries (0 .. 10000) would put every op in the first bucket.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation

from tl_dist.telemetry import OUTSIDE

from .otel_spans import collective_group, module_label

if TYPE_CHECKING:
    from tl_dist.telemetry import StepTelemetry
    from tl_dist.trace import Trace

# Written as decimal strings: `5 * 1e-6` would print as `4.9999999999999996e-06` in Prometheus' `le` label.
DURATION_BUCKETS_S: tuple[float, ...] = tuple(float(f"{m}e{e}") for e in range(-6, 2) for m in (1, 2, 5)) + (
    100.0,
)
"""Histogram boundaries of every ``*.duration`` metric: 1 µs, 2 µs, 5 µs, 10 µs, ..., 50 s, 100 s."""

# name -> (kind, unit, description); the one list the instruments and the docs table come from.
INSTRUMENTS: dict[str, tuple[str, str, str]] = {
    "tl.step.duration": ("histogram", "s", "Wall-clock time of a captured window (a training step)."),
    "tl.op.time": (
        "counter",
        "s",
        "Summed duration of the ops of each op func and phase.",
    ),
    "tl.op.calls": ("counter", "{call}", "Number of ops of each op func and phase."),
    "tl.op.flops": (
        "counter",
        "{flop}",
        "FLOPs of the ops of each op func and phase (funcs with FLOPs only).",
    ),
    "tl.module.duration": (
        "histogram",
        "s",
        "Inclusive op time of a module (its submodules included) per window and phase, to module_depth.",
    ),
    "tl.collective.duration": (
        "histogram",
        "s",
        "Issue to completion of each completed collective, by kind and process group.",
    ),
    "tl.step.flops": ("counter", "{flop}", "Floating-point operations of the captured windows, by phase."),
    "tl.collective.bytes": (
        "counter",
        "By",
        "Bytes of completed collectives as nccl-tests counts them (the larger of input and output).",
    ),
    "tl.nonfinite": (
        "counter",
        "{value}",
        "Recorded values holding NaN (or Inf in gradients), by innermost module (windows with stats).",
    ),
    "tl.step.flops_per_second": ("gauge", "{flop}/s", "FLOPs of the last window divided by its wall time."),
    "tl.step.mfu": (
        "gauge",
        "1",
        "Model FLOPs utilisation of the last window (only when the peak is known).",
    ),
    "tl.step.straggler_rank": (
        "gauge",
        "1",
        "The last captured step's straggler (tl_dist.step_facts.straggler: the rank the others waited for "
        "longest); -1 when nobody waited. Set by a caller that sees every rank: the Lightning callback, or "
        "OtelSink(stragglers=True) on the rank that merges each step.",
    ),
    "tl.step.straggler_wait": (
        "gauge",
        "s",
        "How long the others waited for the last captured step's straggler (0 when nobody waited).",
    ),
    "tl.step.straggler_unknown": (
        "counter",
        "{step}",
        "Captured steps whose straggler OtelSink(stragglers=True) could not compute: a rank's shard did not "
        "arrive within merge_wait_s, or the merge failed.",
    ),
    "tl.collective.busbw": (
        "observed_gauge",
        "By/s",
        "Bus bandwidth (nccl-tests) of the last window's collectives, by kind and process group (a kind the "
        "last window did not complete has no point).",
    ),
    "tl.tensor.norm": (
        "observed_gauge",
        "1",
        "L2 norm of a module's output (tl.of=out) or its gradient (tl.of=grad), last call in the last "
        "window with stats, to module_depth (a module that window did not call has no point).",
    ),
}


class WindowMetrics:
    """Records windows on ``meter``'s instruments; modules deeper than ``module_depth`` are left out."""

    def __init__(self, meter: Any, *, module_depth: int) -> None:
        self.module_depth = module_depth
        self.instruments: dict[str, Any] = {}
        # counter -> id(attributes) -> [attributes, running total] (the entry keeps its attributes, and with them
        # the id, alive; the dicts come from _attributes, one per series)
        self._totals: dict[str, dict[tuple, list]] = {
            name: {} for name, (kind, _, _) in INSTRUMENTS.items() if kind == "counter"
        }
        for name, (kind, unit, description) in INSTRUMENTS.items():
            if kind == "histogram":
                inst = meter.create_histogram(
                    name,
                    unit=unit,
                    description=description,
                    explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
                )
            elif kind == "counter":
                # Observed at each collection from totals kept here: a window adds to plain numbers, and the
                # SDK's per-measurement work (~5-10 µs an add) runs once per series and export, not per window.
                inst = meter.create_observable_counter(
                    name, callbacks=[self._cumulative(name)], unit=unit, description=description
                )
            elif kind == "observed_gauge":
                # Read at each collection from the last window's values, so a series the last window does not
                # have goes away (a synchronous gauge would repeat its last value forever).
                inst = meter.create_observable_gauge(
                    name, callbacks=[self._last_window(name)], unit=unit, description=description
                )
            else:
                inst = meter.create_gauge(name, unit=unit, description=description)
            self.instruments[name] = inst
        self._rank: int | None = None
        self._attrs: dict[tuple, dict[str, Any]] = {}
        self._observed: dict[str, list[Observation]] = {}  # observed gauge -> the last window's points

    def _last_window(self, name: str) -> Any:
        def observe(options: CallbackOptions) -> list[Observation]:
            return self._observed.get(name, [])

        return observe

    def _cumulative(self, name: str) -> Any:
        totals = self._totals[name]

        def observe(options: CallbackOptions) -> list[Observation]:
            # list() copies the entries in one step under the GIL: the sink worker may add a series meanwhile.
            return [Observation(total, attrs) for attrs, total in list(totals.values())]

        return observe

    def _add(self, name: str, value: float, attrs: dict[str, Any]) -> None:
        """Add ``value`` to counter ``name``'s series of attributes ``attrs`` (a dict from :meth:`_attributes`)."""
        entry = self._totals[name].get(id(attrs))
        if entry is None:
            self._totals[name][id(attrs)] = [attrs, value]
        else:
            entry[1] += value

    def _attributes(self, key: tuple, **attrs: Any) -> dict[str, Any]:
        """One attribute dict per key, reused across windows."""
        found = self._attrs.get(key)
        if found is None:
            found = self._attrs[key] = {**attrs, "tl.rank": self._rank}
        return found

    @property
    def rank(self) -> int | None:
        """The rank of the windows recorded so far (None before the first)."""
        return self._rank

    def straggler(self, late: tuple[int, int] | None) -> None:
        """Set the straggler gauges: ``late`` is ``(rank, wait_ns)`` (:func:`tl_dist.step_facts.straggler`)."""
        attrs = self._attributes(("rank",))
        self.instruments["tl.step.straggler_rank"].set(late[0] if late is not None else -1, attrs)
        self.instruments["tl.step.straggler_wait"].set(late[1] * 1e-9 if late is not None else 0.0, attrs)

    def straggler_unknown(self) -> None:
        """Count a captured step whose straggler could not be computed (``tl.step.straggler_unknown``)."""
        self._add("tl.step.straggler_unknown", 1, self._attributes(("rank",)))

    def record(self, trace: Trace, telemetry: StepTelemetry | None) -> None:
        rank = int(trace.metadata.get("rank", 0))
        if rank != self._rank:
            self._rank, self._attrs = rank, {}
            for totals in self._totals.values():  # series of another rank's attributes end
                totals.clear()
        inst = self.instruments
        self._record_collectives(trace)
        if telemetry is None:  # summarising failed (logged by the worker): only collective durations go out
            return
        self._record_funcs(telemetry)
        rank_only = self._attributes(("rank",))
        inst["tl.step.duration"].record(telemetry.wall_ns * 1e-9, rank_only)
        inst["tl.step.flops_per_second"].set(telemetry.flops_per_second, rank_only)
        if telemetry.mfu is not None:
            inst["tl.step.mfu"].set(telemetry.mfu, rank_only)
        for phase, flops in telemetry.flops.items():
            if flops or telemetry.op_ns.get(phase):
                self._add("tl.step.flops", flops, self._attributes(("phase", phase), **{"tl.phase": phase}))
        depth_of = self._depths(trace)
        deep = self.module_depth
        module_hist = inst["tl.module.duration"]
        for row in telemetry.modules:
            if row.module != OUTSIDE and row.depth > deep:
                continue
            label = module_label(row.module) if row.module != OUTSIDE else OUTSIDE
            attrs = self._attributes(
                ("module", label, row.phase), **{"tl.module": label, "tl.phase": row.phase}
            )
            module_hist.record(row.duration_ns * 1e-9, attrs)
        busbw = []
        for row in telemetry.collectives:
            attrs = self._collective_attributes(row.kind, row.group)
            self._add("tl.collective.bytes", row.bytes, attrs)
            if row.completed:
                busbw.append(Observation(row.busbw, attrs))
        self._observed["tl.collective.busbw"] = busbw  # one assignment: a collection sees one window's points
        counted = set()
        for row in telemetry.nonfinite:
            label = module_label(row.module) if row.module != OUTSIDE else OUTSIDE
            attrs = self._attributes(("nonfinite", label, row.of), **{"tl.module": label, "tl.of": row.of})
            self._add("tl.nonfinite", row.count, attrs)
            counted.add((label, row.of))
        norms = []
        for row in telemetry.norms:
            if depth_of.get(row.module, 0) > deep:
                continue
            label = module_label(row.module)
            if (label, row.of) not in counted:
                # Every module with statistics has its non-finite series from its first window, at 0: a
                # counter's first sample is no increase to Prometheus, so a first NaN would never alert.
                attrs = self._attributes(
                    ("nonfinite", label, row.of), **{"tl.module": label, "tl.of": row.of}
                )
                self._add("tl.nonfinite", 0, attrs)
            if not math.isfinite(row.norm):
                continue  # a NaN/Inf norm is what tl.nonfinite counts (the SDK refuses non-finite gauges)
            attrs = self._attributes(("norm", label, row.of), **{"tl.module": label, "tl.of": row.of})
            norms.append(Observation(row.norm, attrs))
        if trace.stats_table["op"]:  # a window without stats says nothing of the norms: the last ones stay
            self._observed["tl.tensor.norm"] = norms

    def _record_funcs(self, telemetry: StepTelemetry) -> None:
        """Per (op func, phase), from the window's summary: added to the totals the counters report (see
        :meth:`_cumulative`), never one SDK measurement per op."""
        add = self._add
        for row in telemetry.funcs:
            attrs = self._attributes(
                ("func", row.func, row.phase), **{"tl.op.func": row.func, "tl.phase": row.phase}
            )
            add("tl.op.time", row.duration_ns * 1e-9, attrs)
            add("tl.op.calls", row.count, attrs)
            if row.flops:
                add("tl.op.flops", row.flops, attrs)

    def _record_collectives(self, trace: Trace) -> None:
        table = trace.collective_table
        record = self.instruments["tl.collective.duration"].record
        for func, ranks, name, desc, issue, complete in zip(
            table["func"],
            table["group_ranks"],
            table["group_name"],
            table["group_desc"],
            table["issue_ns"],
            table["complete_ns"],
        ):
            if complete >= issue >= 0:
                group = collective_group(desc, name, ranks)
                record((complete - issue) * 1e-9, self._collective_attributes(func, group))

    def _collective_attributes(self, kind: str, group: str) -> dict[str, Any]:
        return self._attributes(
            ("collective", kind, group), **{"tl.collective.kind": kind, "tl.collective.group": group}
        )

    @staticmethod
    def _depths(trace: Trace) -> dict[str, int]:
        table = trace.module_table
        depths: dict[str, int] = {}
        for address, depth in zip(table["address"], table["depth"]):
            depths.setdefault(address, depth)
        return depths
