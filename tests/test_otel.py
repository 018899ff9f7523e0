"""OtelSink through the real OpenTelemetry SDK with in-memory exporters: exact values on a hand-built model
(metrics, spans, nesting, recorded times), trace ids, arguments and environment."""

import collections
import math
import re

import pytest
import torch
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace import StatusCode
from otel_helpers import (  # noqa: F401 - clean_otel_env, world_of_one: fixtures
    C10D_NO_AUTOGRAD,
    AllReduce,
    Block,
    DoubleLog,
    InMemory,
    by_name,
    clean_otel_env,
    make_model,
    train_window,
    world_of_one,
)
from torch import nn

import tl_dist as tl
from tl_dist.exporters import otel
from tl_dist.exporters.otel import OtelSink, rank_resource, step_trace_id
from tl_dist.telemetry import OUTSIDE

pytestmark = pytest.mark.filterwarnings(C10D_NO_AUTOGRAD)


# -- metrics ---------------------------------------------------------------------------------------------------
def test_flops_counter_and_per_func_op_counters():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    trace = train_window(make_model(), torch.randn(3, 4))

    # FLOPs by hand (batch 3): forward addmm 2*3*4*4 = 96 per 4x4 Linear, 2*3*4*2 = 48 for the last: 240.
    # Backward: weight grads 96 + 96 + 48, input grads of '1.lin' (96) and '2' (48) -- the model's input needs
    # no grad, so '0.lin' has none: 384. SGD's add_ has no FLOP formula: 0.
    assert mem.point("tl.step.flops", tl_phase="forward").value == 240
    assert mem.point("tl.step.flops", tl_phase="backward").value == 384
    assert mem.point("tl.step.flops", tl_phase="optimizer").value == 0
    assert sum(trace.columns["flops"]) == 240 + 384

    # Per (func, phase), one add per window: 3 addmm and 2 relu forward, 5 mm and 2 threshold_backward.
    assert mem.point("tl.op.calls", tl_op_func="addmm", tl_phase="forward").value == 3
    assert mem.point("tl.op.calls", tl_op_func="relu", tl_phase="forward").value == 2
    assert mem.point("tl.op.calls", tl_op_func="mm", tl_phase="backward").value == 5
    assert mem.point("tl.op.calls", tl_op_func="threshold_backward", tl_phase="backward").value == 2
    cols = trace.columns
    expected = collections.Counter(zip(cols["func"], cols["phase"]))
    got = {(a["tl.op.func"], a["tl.phase"]): p.value for a, p in mem.metrics()["tl.op.calls"]}
    assert got == dict(expected)
    # Summed seconds per (func, phase): the trace's own durations, summed here.
    seconds = collections.Counter()
    for f, ph, d in zip(cols["func"], cols["phase"], cols["duration_ns"]):
        seconds[f, ph] += d
    got = {(a["tl.op.func"], a["tl.phase"]): p.value for a, p in mem.metrics()["tl.op.time"]}
    assert got.keys() == seconds.keys()
    for key, ns in seconds.items():
        assert got[key] == pytest.approx(ns / 1e9, rel=1e-12), key
    # FLOPs per (func, phase), funcs with FLOPs only: forward addmm 96 + 96 + 48; backward mm 96 + 96 + 48
    # (weight grads) + 96 + 48 (input grads).
    got = {(a["tl.op.func"], a["tl.phase"]): p.value for a, p in mem.metrics()["tl.op.flops"]}
    assert got == {("addmm", "forward"): 240, ("mm", "backward"): 384}
    # A second window adds to the same series.
    train_window(make_model(), torch.randn(3, 4))
    assert mem.point("tl.op.calls", tl_op_func="addmm", tl_phase="forward").value == 6
    assert mem.point("tl.op.flops", tl_op_func="mm", tl_phase="backward").value == 2 * 384
    assert all(a["tl.rank"] == 0 for points in mem.metrics().values() for a, _ in points)


def test_otel_sink_gets_windows_without_tensors():
    # OtelSink reads tables only: a window that saved every output reaches it (and waits in the queue) without
    # them, and its metrics are those of the tables.
    mem = InMemory()
    given = []
    export = mem.sink.on_window
    mem.sink.on_window = lambda trace, telemetry: (given.append(trace), export(trace, telemetry))
    tl.arm(sinks=[mem.sink], options=tl.CaptureOptions(save=True))
    trace = train_window(make_model(), torch.randn(3, 4))
    assert len(trace.saved) > len(trace) // 2  # the user's trace keeps its tensors
    assert [(t.saved, t.output) for t in given] == [({}, None)] and given[0].columns is trace.columns
    assert mem.point("tl.step.flops", tl_phase="forward").value == 240  # as in the test above


def test_step_module_and_norm_metrics():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    model, x = make_model(), torch.randn(3, 4)
    with torch.no_grad():  # plain PyTorch reference, before the window's optimizer step changes the weights
        ref_lin = model[0].lin(x).norm().item()
        ref_block1 = model[1](model[0](x)).norm().item()
    trace = train_window(model, x, stats=True)
    meta, cols = trace.metadata, trace.columns

    step = mem.point("tl.step.duration")
    wall_s = (meta["window_end_ns"] - meta["window_start_ns"]) / 1e9
    assert step.count == 1 and step.sum == pytest.approx(wall_s, rel=1e-12)
    assert mem.point("tl.step.flops_per_second").value == pytest.approx(624 / wall_s, rel=1e-12)
    assert "tl.step.mfu" not in mem.metrics()  # CPU: no known peak

    # Inclusive module time: every op with the module on its stack (backward ops carry their forward's stack).
    def inclusive(address, phase):
        return sum(
            d
            for st, p, d in zip(cols["module_stack"], cols["phase"], cols["duration_ns"])
            if address in st and p == phase
        )

    for address, label in (("", "<root>"), ("0", "0"), ("1.lin", "1.lin")):
        for phase in ("forward", "backward"):
            point = mem.point("tl.module.duration", tl_module=label, tl_phase=phase)
            assert point.count == 1 and point.sum == pytest.approx(inclusive(address, phase) / 1e9, rel=1e-12)
    optimizer = mem.point("tl.module.duration", tl_module=OUTSIDE, tl_phase="optimizer")
    assert optimizer.sum == pytest.approx(
        sum(d for p, d in zip(cols["phase"], cols["duration_ns"]) if p == "optimizer") / 1e9
    )

    assert mem.point("tl.tensor.norm", tl_module="0.lin", tl_of="out").value == pytest.approx(
        ref_lin, rel=1e-6
    )
    assert mem.point("tl.tensor.norm", tl_module="1", tl_of="out").value == pytest.approx(
        ref_block1, rel=1e-6
    )
    # d(sum)/d(output of '2') is ones(3, 2): norm sqrt(6).
    assert mem.point("tl.tensor.norm", tl_module="2", tl_of="grad").value == pytest.approx(
        math.sqrt(6), rel=1e-6
    )
    # Each module with statistics has its non-finite series from the first window on, at 0 (so that the first
    # NaN is an increase Prometheus can alert on).
    zeros = {(a["tl.module"], a["tl.of"]): p.value for a, p in mem.metrics()["tl.nonfinite"]}
    assert set(zeros.values()) == {0}
    assert set(zeros) == {(a["tl.module"], a["tl.of"]) for a, _ in mem.metrics()["tl.tensor.norm"]}


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = True

    def forward(self, x):
        y = self.a(x)
        return self.b(y) if self.use_b else y


def test_norms_are_the_last_stats_windows():
    """tl.tensor.norm says what the last window with stats measured: a module it did not call has no point (it
    is not stuck at an old value), and a window without stats leaves the points as they were."""
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    model, x = Branchy(), torch.randn(3, 4)
    train_window(model, x, step=0, stats=True)
    outs = {a["tl.module"] for a, _ in mem.metrics()["tl.tensor.norm"] if a["tl.of"] == "out"}
    assert outs == {"<root>", "a", "b"}

    model.use_b = False
    with torch.no_grad():
        ref_a = model.a(x).norm().item()
    train_window(model, x, step=1, stats=True)
    points = {(a["tl.module"], a["tl.of"]): p.value for a, p in mem.metrics()["tl.tensor.norm"]}
    assert {m for m, of in points if of == "out"} == {"<root>", "a"}
    assert points["a", "out"] == pytest.approx(ref_a, rel=1e-6)

    model.use_b = True
    train_window(model, x, step=2)  # no stats
    for _ in range(2):  # each collection observes the same points again
        again = {(a["tl.module"], a["tl.of"]): p.value for a, p in mem.metrics()["tl.tensor.norm"]}
        assert again == points


def test_nonfinite_counter():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
        lin.bias.zero_()
    model = nn.Sequential(lin, DoubleLog())
    # Output of '0' is [[1, -1]]: log gives [0, nan] and the product [0, nan] in '1'; the sum outside modules is
    # nan too. Gradients stay finite (2/x). So two NaN values in '1' and one outside, in two windows.
    for step in range(2):
        train_window(model, torch.tensor([[1.0, 1.0]]), step=step, stats=True)
        with torch.no_grad():
            lin.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
            lin.bias.zero_()
    counts = {(a["tl.module"], a["tl.of"]): p.value for a, p in mem.metrics()["tl.nonfinite"]}
    assert {k: v for k, v in counts.items() if v} == {("1", "out"): 4, (OUTSIDE, "out"): 2}
    assert counts[("0", "out")] == 0  # a module with statistics and no NaN: its series exists, at 0
    # The NaN output has no norm gauge (the SDK refuses non-finite values, and would log it): '0' has one.
    norms = {(a["tl.module"], a["tl.of"]) for a, _ in mem.metrics()["tl.tensor.norm"]}
    assert ("0", "out") in norms and ("1", "out") not in norms
    assert mem.sink.stats.first_problem is None


def test_module_depth_bounds_spans_and_metrics():
    mem = InMemory(module_depth=1)
    tl.arm(sinks=[mem.sink])
    train_window(make_model(), torch.randn(3, 4), stats=True)
    names = {s.name for s in mem.spans()}
    assert names == {"tl.step"} | {
        f"{m} {p}" for m in ("<root>", "0", "1", "2") for p in ("forward", "backward")
    }
    modules = {a["tl.module"] for a, _ in mem.metrics()["tl.module.duration"]}
    assert modules == {"<root>", "0", "1", "2", OUTSIDE}
    assert {a["tl.module"] for a, _ in mem.metrics()["tl.tensor.norm"]} == {"<root>", "0", "1", "2"}

    tl.disarm()
    mem = InMemory(module_depth=0, spans=None)
    tl.arm(sinks=[mem.sink])
    train_window(make_model(), torch.randn(3, 4))
    assert mem.spans() == []
    assert {a["tl.module"] for a, _ in mem.metrics()["tl.module.duration"]} == {"<root>", OUTSIDE}


# -- spans -----------------------------------------------------------------------------------------------------
class CountingSampler(sampling.ParentBased):
    """The SDK's parent-based ratio sampler, counting the spans it is asked about."""

    def __init__(self, rate):
        super().__init__(sampling.TraceIdRatioBased(rate))
        self.asked = 0

    def should_sample(self, *args, **kwargs):
        self.asked += 1
        return super().should_sample(*args, **kwargs)


def test_a_step_the_sampler_drops_builds_no_child_span(monkeypatch):
    # A fixed run id: a step's trace id comes from it, and with the process's own (host-pid) all 8 steps would
    # fall on one side of the ratio in 1 run of 128.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sampler-test-run")
    sampler = CountingSampler(0.5)
    mem = InMemory(sampler=sampler, module_depth=1)
    tl.arm(sinks=[mem.sink])
    model = make_model()
    steps = range(8)
    run_ids = {train_window(model, torch.randn(3, 4), step=step).metadata["run_id"] for step in steps}
    (run_id,) = run_ids
    # TraceIdRatioBased keeps a trace whose low 64 bits of id are below rate * 2**64 (its documented rule).
    kept = {s for s in steps if step_trace_id(run_id, s) & (2**64 - 1) < round(0.5 * 2**64)}
    assert 0 < len(kept) < len(steps)  # both kinds of step occur
    spans = mem.spans()
    assert {s.attributes["tl.step"] for s in spans if s.name == "tl.step"} == kept
    # A kept step has all its module spans (the model's 4 calls to depth 1, forward and backward).
    per_step = collections.Counter(s.context.trace_id for s in spans if s.name != "tl.step")
    assert sorted(per_step.values()) == [8] * len(kept)
    # The sampler was asked once per dropped step (its step span), once per span of a kept step.
    assert sampler.asked == len(spans) + (len(steps) - len(kept))
    # Metrics do not depend on sampling.
    assert mem.point("tl.op.calls", tl_op_func="addmm", tl_phase="forward").value == 3 * len(steps)


def test_module_spans_nest_and_carry_recorded_times():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    trace = train_window(make_model(), torch.randn(3, 4), step=7)
    spans = by_name(mem.spans())
    meta, cols = trace.metadata, trace.columns

    assert set(spans) == {"tl.step"} | {
        f"{m} {p}"
        for m in ("<root>", "0", "0.lin", "0.act", "1", "1.lin", "1.act", "2")
        for p in ("forward", "backward")
    }
    step = spans["tl.step"]
    assert step.parent is None
    assert (step.start_time, step.end_time) == (meta["window_start_ns"], meta["window_end_ns"])
    assert step.attributes["tl.step"] == 7 and step.attributes["tl.rank"] == 0
    assert step.attributes["tl.op.count"] == len(trace)
    assert step.context.trace_id == step_trace_id(meta["run_id"], 7)
    assert {s.context.trace_id for s in spans.values()} == {step.context.trace_id}

    parent_of = {
        "<root>": "tl.step", "0": "<root>", "1": "<root>", "2": "<root>",
        "0.lin": "0", "0.act": "0", "1.lin": "1", "1.act": "1",
    }  # fmt: skip
    for phase in ("forward", "backward"):
        for module, parent in parent_of.items():
            want = spans["tl.step"] if parent == "tl.step" else spans[f"{parent} {phase}"]
            assert spans[f"{module} {phase}"].parent.span_id == want.context.span_id, (module, phase)

    # Times: first to last op of the call; backward: of the module's backward ops (its `module` column).
    for module in ("0.lin", "1", "2", "<root>"):
        address = "" if module == "<root>" else module
        for phase in ("forward", "backward"):
            ops = [
                i for i in range(len(trace))
                if cols["phase"][i] == phase and cols["module_stack"][i] and (address in cols["module_stack"][i])
            ]  # fmt: skip
            span = spans[f"{module} {phase}"]
            assert span.start_time == min(cols["start_ns"][i] for i in ops), (module, phase)
            assert span.end_time == max(cols["start_ns"][i] + cols["duration_ns"][i] for i in ops), (
                module,
                phase,
            )
            assert span.attributes["tl.op.count"] == len(ops)
            assert span.attributes["tl.flops"] == sum(cols["flops"][i] for i in ops)
    assert spans["0.lin forward"].attributes["tl.module.type"] == "Linear"
    assert spans["0.lin forward"].attributes["tl.flops"] == 96


def test_a_module_called_twice_has_a_span_per_call_and_phase():
    block = Block()
    model = nn.Sequential(block, block)  # one module, two calls: '0' (call 0) and '0' again (call 1)
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    trace = train_window(model, torch.randn(3, 4))
    cols = trace.columns
    spans = {}
    for s in mem.spans():
        if s.name.startswith("0 "):
            spans[(s.attributes["tl.phase"], s.attributes["tl.module.call"])] = s
    assert sorted(spans) == [("backward", 0), ("backward", 1), ("forward", 0), ("forward", 1)]
    calls = trace.module_table
    for call in (0, 1):
        row = next(
            r for r, (a, c) in enumerate(zip(calls["address"], calls["call"])) if a == "0" and c == call
        )
        first, end = calls["first_op"][row], calls["end_op"][row]
        assert spans[("forward", call)].start_time == cols["start_ns"][first]
        # The call's backward: the backward ops differentiating its forward ops.
        bwd = [
            i
            for i in range(len(trace))
            if cols["phase"][i] == "backward" and first <= cols["fwd_op"][i] < end
        ]
        assert spans[("backward", call)].start_time == min(cols["start_ns"][i] for i in bwd)
    # Backward runs in reverse: the second call's gradient comes first.
    assert spans[("backward", 1)].start_time < spans[("backward", 0)].start_time


def test_checkpoint_recomputation_counts_in_the_modules_backward_span():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x):
            return checkpoint(self.a, x, use_reentrant=False) + self.b(x)

    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    trace = train_window(Checkpointed(), torch.randn(3, 4))
    cols = trace.columns
    spans = by_name(mem.spans())
    recomputed = [i for i in range(len(trace)) if cols["phase"][i] == "recompute"]
    assert recomputed and all(cols["module_stack"][i][1] == "a" for i in recomputed)
    a_backward = spans["a backward"]
    # a's backward begins by recomputing its forward, inside the engine, after b's backward began.
    assert a_backward.start_time == cols["start_ns"][recomputed[0]]
    assert spans["b backward"].start_time < a_backward.start_time
    assert spans["a.lin backward"].parent.span_id == a_backward.context.span_id


def test_op_spans():
    mem = InMemory(spans="op", module_depth=1)
    tl.arm(sinks=[mem.sink])
    trace = train_window(make_model(), torch.randn(3, 4))
    cols = trace.columns
    ops = {s.attributes["tl.op.index"]: s for s in mem.spans() if "tl.op.index" in s.attributes}
    assert sorted(ops) == list(range(len(trace)))
    modules = {s.name: s for s in mem.spans() if "tl.module.type" in s.attributes}
    step = next(s for s in mem.spans() if s.name == "tl.step")
    for i, span in ops.items():
        assert span.name == cols["func"][i]
        assert (span.start_time, span.end_time) == (
            cols["start_ns"][i],
            cols["start_ns"][i] + cols["duration_ns"][i],
        )
        stack, phase = cols["module_stack"][i], cols["phase"][i]
        if phase in ("forward", "backward") and stack:
            # depth 1: an op of '0.lin' sits under '0'
            top = stack[1] if len(stack) > 1 else "<root>"
            assert span.parent.span_id == modules[f"{top} {phase}"].context.span_id, cols["label"][i]
        elif not stack:
            assert span.parent.span_id == step.context.span_id, cols["label"][i]


# An in-place c10d collective has no autograd formula; torch says so once per backward through it.
@pytest.mark.usefixtures("world_of_one")
def test_collective_span_and_metrics():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    model = nn.Sequential(nn.Linear(4, 256), AllReduce())
    trace = train_window(model, torch.randn(8, 4))
    spans = by_name(mem.spans())
    (c,) = trace.collectives
    span = spans["all_reduce"]
    assert span.parent.span_id == spans["1 forward"].context.span_id
    assert (span.start_time, span.end_time) == (c.issue_ns, c.complete_ns)
    assert span.attributes["tl.collective.seq"] == c.seq
    assert span.attributes["tl.collective.bytes"] == 8 * 256 * 4  # float32
    assert span.attributes["tl.collective.state"] == "completed"
    assert span.attributes["tl.collective.group_ranks"] == (0,)
    group = span.attributes["tl.collective.group"]
    assert group == (c.group_desc or c.group_name)
    assert mem.point("tl.collective.bytes", tl_collective_kind="all_reduce").value == 8 * 256 * 4
    duration = mem.point("tl.collective.duration", tl_collective_kind="all_reduce", tl_collective_group=group)
    assert duration.count == 1 and duration.sum == pytest.approx(
        (c.complete_ns - c.issue_ns) / 1e9, rel=1e-12
    )
    # busbw of an all_reduce on one rank: factor 2(n-1)/n = 0.
    assert mem.point("tl.collective.busbw", tl_collective_kind="all_reduce").value == 0


@pytest.mark.usefixtures("world_of_one")
def test_busbw_is_the_last_windows_only():
    """A collective kind the last window did not complete has no busbw point: the gauge says what the last
    window measured, not what some earlier one did (the bytes counter keeps counting)."""
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    train_window(nn.Sequential(nn.Linear(4, 256), AllReduce()), torch.randn(8, 4), step=0)
    assert tl.flush()
    assert mem.point("tl.collective.busbw", tl_collective_kind="all_reduce").value == 0
    assert [a["tl.collective.kind"] for a, _ in mem.metrics()["tl.collective.busbw"]] == ["all_reduce"]
    train_window(nn.Sequential(nn.Linear(4, 256)), torch.randn(8, 4), step=1)
    assert tl.flush()
    assert mem.metrics().get("tl.collective.busbw", []) == []
    assert mem.point("tl.collective.bytes", tl_collective_kind="all_reduce").value == 8 * 256 * 4
    # Read twice, the same points: the gauge re-observes the last window at each collection.
    train_window(nn.Sequential(nn.Linear(4, 256), AllReduce()), torch.randn(8, 4), step=2)
    assert tl.flush()
    for _ in range(2):
        assert [a["tl.collective.kind"] for a, _ in mem.metrics()["tl.collective.busbw"]] == ["all_reduce"]


def test_trace_id_is_shared_by_ranks_of_a_step():
    # Two sinks on their own providers stand for two ranks' processes: only (run id, step) decides the trace id.
    ranks = [InMemory(), InMemory()]
    for rank, mem in enumerate(ranks):
        for step in (5, 6):
            with tl.capture() as cap:
                make_model()(torch.randn(2, 4)).sum().backward()
            cap.trace.metadata.update(rank=rank, run_id="job42", step=step)
            mem.sink.on_window(cap.trace, tl.telemetry.summarize(cap.trace))
    ids = [
        {s.attributes["tl.step"]: s.context.trace_id for s in m.spans() if s.name == "tl.step"} for m in ranks
    ]
    assert ids[0] == ids[1]
    assert ids[0][5] != ids[0][6]
    assert [s.attributes["tl.rank"] for m in ranks for s in m.spans() if s.name == "tl.step"] == [0, 0, 1, 1]


def test_failed_window_step_span_is_an_error():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"):
        with tl.capture(step=1):
            model(torch.randn(3, 4)).sum().backward()
            raise RuntimeError("boom")
    assert tl.flush()
    step = by_name(mem.spans())["tl.step"]
    assert step.status.status_code is StatusCode.ERROR
    assert "boom" in step.status.description
    assert step.attributes["tl.complete"] is False and step.attributes["tl.end_reason"] == "exception"


def test_close_leaves_callers_providers_alone():
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    train_window(make_model(), torch.randn(3, 4))
    tl.disarm()
    tracer = mem.tracer_provider.get_tracer("mine")
    tracer.start_span("after").end()
    assert [s.name for s in mem.spans()][-1] == "after"
    assert mem.metrics()["tl.step.duration"]  # the reader still reads


# -- arguments and environment ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spans": "modules"}, "spans must be one of"),
        ({"module_depth": -1}, "module_depth must be an int >= 0"),
        ({"module_depth": True}, "module_depth must be an int >= 0"),
        (
            {"tracer_provider": "localhost:4318"},
            "tracer_provider must be an opentelemetry.trace.TracerProvider",
        ),
        ({"meter_provider": object()}, "meter_provider must be an opentelemetry.metrics.MeterProvider"),
        (
            {"resource": ["service.name"]},
            "resource must be an opentelemetry.sdk.resources.Resource or a mapping",
        ),
        ({"stragglers": 1}, "stragglers must be a bool"),
        ({"merge_rank": -1}, "merge_rank must be an int >= 0"),
        ({"merge_wait_s": 0}, "merge_wait_s must be a number of seconds > 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OtelSink(**kwargs)


def test_resource_without_a_provider_to_build_is_an_error():
    mem = InMemory()
    with pytest.raises(ValueError, match="resource= applies to the providers OtelSink builds"):
        OtelSink(tracer_provider=mem.tracer_provider, meter_provider=mem.meter_provider, resource={"a": 1})


@pytest.mark.parametrize(
    ("variable", "value", "match"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin", "OTEL_TRACES_EXPORTER='zipkin'"),
        ("OTEL_METRICS_EXPORTER", "otlp,prometheus", "OTEL_METRICS_EXPORTER='otlp,prometheus'"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ],
)
def test_environment_the_sink_cannot_honour_fails_at_construction(monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=re.escape(match)):
        OtelSink()


def test_rank_resource(monkeypatch):
    meta = {"rank": 3, "local_rank": 1, "world_size": 8, "run_id": "job42", "host": "node7", "pid": 1234}
    attrs = rank_resource(meta).attributes
    assert attrs["service.name"] == "tl_dist"
    assert attrs["service.instance.id"] == "job42/rank3"
    assert (attrs["tl.rank"], attrs["tl.local_rank"], attrs["tl.world_size"]) == (3, 1, 8)
    assert (attrs["tl.run_id"], attrs["host.name"], attrs["process.pid"]) == ("job42", "node7", 1234)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pretrain")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=llm,service.instance.id=same-everywhere")
    attrs = rank_resource(meta).attributes
    assert (attrs["service.name"], attrs["team"], attrs["service.instance.id"]) == (
        "pretrain",
        "llm",
        "job42/rank3",
    )
    attrs = rank_resource(meta, otel.Resource({"service.name": "mine"})).attributes
    assert attrs["service.name"] == "mine"
