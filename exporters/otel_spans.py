"""Spans of one window, with the times the trace recorded: ``tl.step``, module calls, collectives, ops.

All ranks' spans of one step share one trace id derived from (run id, step) (:func:`step_trace_id`), so a trace
viewer shows every rank of step k in one trace; each rank's ``tl.step`` span is a root of that trace.

Tree (``module_depth=2``)::

    tl.step                                 window start -> window end
      <root> forward                        first -> last op of the call
        encoder forward
          encoder.layers.0 forward
            all_reduce                      a collective issued and completed inside that call
      <root> backward                       first -> last backward op of the call's forward ops
        encoder backward ...
      all_reduce                            DDP's bucket all-reduce, or any collective still in flight after
                                            its call's last op (tl.module names its owner module)
      add_                                  an op (only with spans="op"); optimizer ops sit under tl.step
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Any

import torch

from tl_dist.errors import missing_extra

try:
    from opentelemetry import trace as trace_api
    from opentelemetry.sdk.trace import Tracer as SdkTracer
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
except ImportError as exc:  # the tl_dist[otel] extra is not installed
    raise missing_extra("tl_dist.exporters.otel", "otel", exc) from exc

from tl_dist.schema import OUTSIDE, ROOT

if TYPE_CHECKING:
    from tl_dist.telemetry import StepTelemetry
    from tl_dist.trace import Trace

# ROOT (schema.ROOT) names the outermost module (address ``''``) in spans and metrics: Prometheus treats an empty
# label as none.

SPAN_PHASES = ("forward", "backward")
"""Phases that get module spans: ``recompute`` (checkpointing) counts in the module's backward span, where it
runs; ``optimizer`` ops run outside modules."""
_CALL_PHASES = frozenset({"forward", "backward", "recompute"})  # the phases whose ops belong to module calls


def module_label(address: str) -> str:
    """The ``tl.module`` value of a module address: the address, ``<root>`` for the outermost module."""
    return address if address else ROOT


def collective_group(desc: str, name: str, ranks: tuple[int, ...]) -> str:
    """The ``tl.collective.group`` value: the group's description, else its name, else its ranks (as
    ``StepTelemetry.collectives`` names groups)."""
    return desc or name or ",".join(map(str, ranks))


def step_trace_id(run_id: str | None, step: int | None) -> int:
    """The OpenTelemetry trace id (128-bit int) of step ``step`` of run ``run_id``: every rank derives the same.

    Example:
        >>> format(step_trace_id("job42", 100), "032x")  # paste into Jaeger/Tempo to open step 100
    """
    digest = hashlib.sha256(f"tl_dist\0{run_id}\0{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


class _StepTraceIds(IdGenerator):
    """Our tracer's id generator: the next root span (a ``tl.step``) gets the trace id set for it, all else is
    random as before. Per thread: only the sink worker sets one."""

    def __init__(self, base: IdGenerator) -> None:
        self.base = base
        self._next = threading.local()

    def set_next_trace_id(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", None)
        if trace_id is None:
            return self.base.generate_trace_id()
        self._next.trace_id = None
        return trace_id

    def generate_span_id(self) -> int:
        return self.base.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return False


def _derived_ids(tracer: Any) -> _StepTraceIds | None:
    """Install the step-trace-id generator on an SDK tracer (idempotent); None for other tracers."""
    if not isinstance(tracer, SdkTracer):
        return None
    if not isinstance(tracer.id_generator, _StepTraceIds):
        tracer.id_generator = _StepTraceIds(tracer.id_generator)
    return tracer.id_generator


def _children_follow_parent(tracer: Any) -> bool:
    """Whether ``tracer`` samples a step's child spans as it sampled the step: an SDK tracer whose sampler is
    parent-based (the SDK's default), decides by trace id (the children share the step's), or is constant; or
    a tracer that records nothing (the API's no-op tracer)."""
    if not isinstance(tracer, SdkTracer):
        return isinstance(tracer, trace_api.NoOpTracer)
    from opentelemetry.sdk.trace import sampling

    return isinstance(
        tracer.sampler, (sampling.ParentBased, sampling.TraceIdRatioBased, sampling.StaticSampler)
    )


def _itemsize(dtype: str, cache: dict[str, int] = {}) -> int:  # noqa: B006 - a deliberate per-process cache
    size = cache.get(dtype)
    if size is None:
        dt = getattr(torch, dtype, None)
        size = cache[dtype] = dt.itemsize if isinstance(dt, torch.dtype) else 0
    return size


class WindowSpans:
    """Turns windows into spans on ``tracer``: module calls to ``module_depth``, collectives, ops if ``ops``."""

    def __init__(self, tracer: Any, *, module_depth: int, ops: bool) -> None:
        self.tracer = tracer
        self.module_depth = module_depth
        self.ops = ops
        self._ids = _derived_ids(tracer)
        self._children_follow_step = _children_follow_parent(tracer)

    def emit(self, trace: Trace, telemetry: StepTelemetry | None) -> None:
        meta = trace.metadata
        cols = trace.columns
        starts, durations = cols["start_ns"], cols["duration_ns"]
        n = len(starts)
        window_start = meta.get("window_start_ns")
        window_end = meta.get("window_end_ns")
        if window_start is None or window_end is None:  # a trace from before windows recorded their span
            window_start = min(starts) if n else 0
            window_end = max(s + d for s, d in zip(starts, durations)) if n else window_start
        step_span = self._start_step(meta, telemetry, n, window_start)
        if not step_span.is_recording() and self._children_follow_step:
            # The sampler dropped this step: its module, collective and op spans would all be dropped too (they
            # share its trace id and have it as their parent), so none is built.
            step_span.end(end_time=window_end)
            return
        step_ctx = trace_api.set_span_in_context(step_span)

        calls = _CallSpans(trace, self.module_depth)
        contexts = calls.emit(self.tracer, step_ctx)
        self._collectives(trace, calls, contexts, step_ctx, window_end)
        if self.ops:
            self._ops(trace, calls, contexts, step_ctx)
        step_span.end(end_time=window_end)

    def _start_step(self, meta: dict, telemetry: StepTelemetry | None, n: int, start: int) -> Any:
        run_id, step = meta.get("run_id"), meta.get("step")
        trace_id = step_trace_id(run_id, step)
        attributes: dict[str, Any] = {
            "tl.step": int(step) if step is not None else -1,
            "tl.rank": int(meta.get("rank", 0)),
            "tl.world_size": int(meta.get("world_size", 1)),
            "tl.run_id": str(run_id or ""),
            "tl.complete": bool(meta.get("complete", True)),
            "tl.end_reason": str(meta.get("end_reason", "closed")),
            "tl.op.count": n,
        }
        if telemetry is not None:
            attributes["tl.flops"] = telemetry.total_flops
            attributes["tl.flops_per_second"] = telemetry.flops_per_second
            attributes["tl.compute_ns"] = telemetry.compute_ns
            attributes["tl.comm_ns"] = telemetry.comm_ns
            for phase, ns in telemetry.op_ns.items():
                if ns:
                    attributes[f"tl.{phase}_ns"] = ns
            if telemetry.mfu is not None:
                attributes["tl.mfu"] = telemetry.mfu
        if self._ids is not None:
            self._ids.set_next_trace_id(trace_id)
            context = None
        else:  # not the SDK's tracer: a remote parent carries the trace id instead
            parent = SpanContext(
                trace_id, trace_id & 0xFFFFFFFFFFFFFFFF or 1, True, TraceFlags(TraceFlags.SAMPLED)
            )
            context = trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent))
        span = self.tracer.start_span(
            "tl.step", context=context, kind=SpanKind.INTERNAL, attributes=attributes, start_time=start
        )
        if not attributes["tl.complete"]:
            span.set_status(Status(StatusCode.ERROR, str(meta.get("error") or attributes["tl.end_reason"])))
        return span

    def _collectives(
        self, trace: Trace, calls: _CallSpans, contexts: dict, step_ctx: Any, window_end: int
    ) -> None:
        table = trace.collective_table
        phases = trace.columns["phase"]
        labels = trace.columns["label"]
        modules, stacks = trace.columns["module"], trace.columns["module_stack"]
        tracer = self.tracer
        for k, op in enumerate(table["op"]):
            issue, complete = table["issue_ns"][k], table["complete_ns"][k]
            done = complete >= issue >= 0
            desc, name, ranks = table["group_desc"][k], table["group_name"][k], table["group_ranks"][k]
            size = max(table["in_numel"][k], table["out_numel"][k]) * _itemsize(table["dtype"][k])
            attributes: dict[str, Any] = {
                "tl.collective.kind": table["func"][k],
                "tl.collective.group": collective_group(desc, name, ranks),
                "tl.collective.group_ranks": list(ranks),
                "tl.collective.seq": table["seq"][k],
                "tl.collective.bytes": size,
                "tl.collective.in_bytes": table["bytes"][k],
                "tl.collective.state": table["state"][k],
                "tl.collective.async": bool(table["is_async"][k]),
                "tl.collective.backend": table["backend"][k],
                "tl.op.label": labels[op],
                "tl.phase": phases[op],
                # The owner rule of every view (schema.module_name), also where the span sits under tl.step.
                "tl.module": module_label(modules[op]) if stacks[op] else OUTSIDE,
            }
            for field in ("reduce_op",):
                if table[field][k]:
                    attributes[f"tl.collective.{field}"] = table[field][k]
            for field in ("root", "peer", "bucket"):
                if table[field][k] >= 0:
                    attributes[f"tl.collective.{field}"] = table[field][k]
            start = issue if issue >= 0 else trace.columns["start_ns"][op]
            end = complete if done else max(window_end, start)
            span = tracer.start_span(
                table["func"][k],
                context=calls.context_within(op, start, end, contexts, step_ctx),
                attributes=attributes,
                start_time=start,
            )
            if not done:
                span.set_status(Status(StatusCode.ERROR, "issued, never seen complete in the window"))
            span.end(end_time=end)

    def _ops(self, trace: Trace, calls: _CallSpans, contexts: dict, step_ctx: Any) -> None:
        cols = trace.columns
        tracer = self.tracer
        for i, (func, kind, phase, start, dur) in enumerate(
            zip(cols["func"], cols["kind"], cols["phase"], cols["start_ns"], cols["duration_ns"])
        ):
            if kind == "collective":
                continue  # its collective span stands for it
            attributes = {
                "tl.op.label": cols["label"][i],
                "tl.op.aten": cols["aten"][i],
                "tl.op.index": i,
                "tl.phase": phase,
                "tl.module": module_label(cols["module"][i]) if cols["module_stack"][i] else OUTSIDE,
                "tl.flops": cols["flops"][i],
                "tl.op.out_bytes": cols["out_bytes"][i],
            }
            span = tracer.start_span(
                func, context=calls.context_of(i, contexts, step_ctx), attributes=attributes, start_time=start
            )
            span.end(end_time=start + dur)


class _CallSpans:
    """Which module call (at most ``module_depth`` deep) each op belongs to, and the calls' time bounds.

    A forward op belongs to its call; a backward op to the call of the forward op it differentiates (an
    ``AccumulateGrad`` op, which has none, to the first call of its parameter's module); a recomputed op
    (checkpointing) to the backward of the first call of its module. An op deeper than
    ``module_depth`` counts for its ancestor at that depth; bounds then propagate to the enclosing calls, so a
    parent's span always contains its children's.
    """

    def __init__(self, trace: Trace, module_depth: int) -> None:
        table = trace.module_table
        cols = trace.columns
        depth, parent = table["depth"], table["parent"]
        self.table = table
        self.cols = cols
        n_calls = len(depth)
        # Rows are in call order, a parent before its children: one forward pass fills `clip`.
        clip = [-1] * n_calls
        for r in range(n_calls):
            if depth[r] <= module_depth:
                clip[r] = r
            elif parent[r] >= 0:
                clip[r] = clip[parent[r]]
        self.clip = clip
        self.first_call: dict[str, int] = {}
        for r, address in enumerate(table["address"]):
            self.first_call.setdefault(address, r)
        # phase -> call row -> [start, end, ops, flops]
        self.bounds: dict[str, dict[int, list[int]]] = {p: {} for p in SPAN_PHASES}
        call_of = self.call_of
        for i, (phase, start, dur, fl) in enumerate(
            zip(cols["phase"], cols["start_ns"], cols["duration_ns"], cols["flops"])
        ):
            if phase not in _CALL_PHASES:  # optimizer and other ops: under the step's span
                continue
            phase, row = call_of(i)
            if row < 0:
                continue
            per_call = self.bounds[phase]
            acc = per_call.get(row)
            end = start + dur
            if acc is None:
                per_call[row] = [start, end, 1, fl]
            else:
                if start < acc[0]:
                    acc[0] = start
                if end > acc[1]:
                    acc[1] = end
                acc[2] += 1
                acc[3] += fl
        ct = trace.collective_table
        for op, issue, complete, is_async in zip(ct["op"], ct["issue_ns"], ct["complete_ns"], ct["is_async"]):
            # A blocking collective's span (issue -> observed completion) may start or end a little outside
            # its op: its call's span covers it. An async one still in flight after its call's last op hangs
            # under tl.step instead (context_within), not stretching the module's time.
            phase, row = self.call_of(op) if 0 <= op < len(cols["phase"]) else ("", -1)
            acc = self.bounds.get(phase, {}).get(row) if row >= 0 else None
            if acc is not None and not is_async and complete >= issue >= 0:
                acc[0] = min(acc[0], issue)
                acc[1] = max(acc[1], complete)
        for per_call in self.bounds.values():
            for r in range(n_calls - 1, -1, -1):  # children (higher rows) before their parents
                acc, p = per_call.get(r), parent[r]
                if acc is None or p < 0:
                    continue
                up = per_call.get(p)
                if up is None:
                    per_call[p] = list(acc)
                else:
                    up[0] = min(up[0], acc[0])
                    up[1] = max(up[1], acc[1])
                    up[2] += acc[2]
                    up[3] += acc[3]

    def call_of(self, i: int) -> tuple[str, int]:
        """The span phase and clipped module-call row op ``i`` belongs to; row -1 for none."""
        cols = self.cols
        phase = cols["phase"][i]
        row = -1
        if phase == "forward":
            row = cols["module_call"][i]
        elif phase in _CALL_PHASES:  # backward, recompute
            fwd = cols["fwd_op"][i]
            if fwd >= 0 and cols["phase"][fwd] == "forward" and cols["module_call"][fwd] >= 0:
                row = cols["module_call"][fwd]
            elif cols["module_stack"][i]:
                row = self.first_call.get(cols["module_stack"][i][-1], -1)
            phase = "backward"
        return phase, self.clip[row] if row >= 0 else -1

    def emit(self, tracer: Any, step_ctx: Any) -> dict[tuple[str, int], Any]:
        """Start and end one span per (phase, call) with bounds; their contexts by (phase, row)."""
        table = self.table
        contexts: dict[tuple[str, int], Any] = {}
        for phase in SPAN_PHASES:
            per_call = self.bounds[phase]
            for r in sorted(per_call):  # parents first: a child needs its parent's context
                start, end, ops, flops = per_call[r]
                p = table["parent"][r]
                label = module_label(table["address"][r])
                span = tracer.start_span(
                    f"{label} {phase}",
                    context=contexts.get((phase, p), step_ctx) if p >= 0 else step_ctx,
                    attributes={
                        "tl.module": label,
                        "tl.module.type": table["type"][r],
                        "tl.module.call": table["call"][r],
                        "tl.module.depth": table["depth"][r],
                        "tl.phase": phase,
                        "tl.op.count": ops,
                        "tl.flops": flops,
                    },
                    start_time=start,
                )
                span.end(end_time=end)
                contexts[(phase, r)] = trace_api.set_span_in_context(span)
        return contexts

    def context_within(self, i: int, start: int, end: int, contexts: dict, step_ctx: Any) -> Any:
        """:meth:`context_of`, unless [start, end] is not inside that module span (an async collective still in
        flight after its call's last op: DDP's buckets): then the step's, so no span ends after its parent."""
        phase, row = self.call_of(i)
        bounds = self.bounds.get(phase, {}).get(row) if row >= 0 else None
        if bounds is None or start < bounds[0] or end > bounds[1]:
            return step_ctx
        return contexts.get((phase, row), step_ctx)

    def context_of(self, i: int, contexts: dict, step_ctx: Any) -> Any:
        """The context of the module span op ``i`` ran under (the step's outside module spans)."""
        phase, row = self.call_of(i)
        return contexts.get((phase, row), step_ctx) if row >= 0 else step_ctx
