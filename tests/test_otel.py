"""OtelSink through the real OpenTelemetry SDK: in-memory exporters with exact values on a hand-built model, a
real OTLP/HTTP round trip, a Prometheus scrape, and collectors that are down or slow."""

import collections
import gc
import logging
import math
import os
import re
import socket
import statistics
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from otlp_receiver import OtlpReceiver, attributes
from torch import nn

import tl_dist as tl
from tl_dist.exporters import otel
from tl_dist.exporters.otel import OtelSink, rank_resource, start_prometheus, step_trace_id
from tl_dist.telemetry import OUTSIDE

# Every OTEL_* variable a test sets is removed afterwards, and none from the environment leaks in.
_OTEL_ENV = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for key in _OTEL_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    tl.disarm()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x))


def make_model():
    # depth 0: '' (Sequential); 1: '0', '1' (Block), '2' (Linear); 2: '0.lin', '0.act', '1.lin', '1.act'
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


class InMemory:
    """A sink on in-memory providers: spans exported synchronously, metrics read on demand."""

    def __init__(self, **sink_kwargs):
        self.spans_out = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans_out))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.sink = OtelSink(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **sink_kwargs
        )

    def spans(self) -> list[ReadableSpan]:
        return list(self.spans_out.get_finished_spans())

    def metrics(self) -> dict[str, list]:
        """metric name -> [(attributes, point)]."""
        out = collections.defaultdict(list)
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    out[metric.name] += [(dict(p.attributes), p) for p in metric.data.data_points]
        return out

    def point(self, name, **attrs):
        found = [
            p
            for a, p in self.metrics()[name]
            if all(a.get(k.replace("_", ".")) == v for k, v in attrs.items())
        ]
        assert len(found) == 1, (name, attrs, self.metrics()[name])
        return found[0]


def train_window(model, x, step=0, **capture):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.capture(step=step, **capture) as cap:
        model(x).sum().backward()
        opt.step()
    assert tl.flush()
    return cap.trace


def by_name(spans):
    out = {}
    for s in spans:
        assert s.name not in out, f"two spans named {s.name}"
        out[s.name] = s
    return out


# -- metrics ---------------------------------------------------------------------------------------------------
def test_flops_counter_and_op_histogram_counts():
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

    # One histogram point per op, by (func, phase): 3 addmm and 2 relu forward, 5 mm and 2 threshold_backward.
    assert mem.point("tl.op.duration", tl_op_func="addmm", tl_phase="forward").count == 3
    assert mem.point("tl.op.duration", tl_op_func="relu", tl_phase="forward").count == 2
    assert mem.point("tl.op.duration", tl_op_func="mm", tl_phase="backward").count == 5
    assert mem.point("tl.op.duration", tl_op_func="threshold_backward", tl_phase="backward").count == 2
    cols = trace.columns
    expected = collections.Counter(zip(cols["func"], cols["phase"]))
    got = {(a["tl.op.func"], a["tl.phase"]): p.count for a, p in mem.metrics()["tl.op.duration"]}
    assert got == dict(expected)
    addmm = mem.point("tl.op.duration", tl_op_func="addmm", tl_phase="forward")
    addmm_ns = [d for f, d in zip(cols["func"], cols["duration_ns"]) if f == "addmm"]
    assert addmm.sum == pytest.approx(sum(addmm_ns) / 1e9, rel=1e-12)
    assert addmm.explicit_bounds == (
        1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
        0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100,
    )  # fmt: skip
    # Each op in the bucket its duration says (le boundaries, inclusive).
    bounds = addmm.explicit_bounds
    assert list(addmm.bucket_counts) == [
        sum(
            1
            for d in addmm_ns
            if (k == 0 or d / 1e9 > bounds[k - 1]) and (k == len(bounds) or d / 1e9 <= bounds[k])
        )
        for k in range(len(bounds) + 1)
    ]
    assert all(a["tl.rank"] == 0 for points in mem.metrics().values() for a, _ in points)


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
    assert "tl.nonfinite" not in mem.metrics()


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class DoubleLog(nn.Module):
    def forward(self, x):
        return torch.log(x) * 2


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
    assert counts == {("1", "out"): 4, (OUTSIDE, "out"): 2}
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
pytestmark = pytest.mark.filterwarnings("ignore:c10d..allreduce_. an autograd kernel was not registered")


class AllReduce(nn.Module):
    def forward(self, x):
        x = x.clone()
        dist.all_reduce(x)
        return x


@pytest.fixture
def world_of_one():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_span_and_metrics(world_of_one):
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


def test_a_sink_armed_again_exports_again(monkeypatch):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        sink = OtelSink()
        for step in (1, 2):
            tl.arm(sinks=[sink])
            train_window(make_model(), torch.randn(3, 4), step=step)
            assert tl.disarm()
        steps = [attributes(s.attributes)["tl.step"] for _, s in rx.spans() if s.name == "tl.step"]
    assert sorted(steps) == [1, 2]


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


# -- over the wire ---------------------------------------------------------------------------------------------
def test_otlp_http_round_trip(monkeypatch, tmp_path):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        tl.arm(tmp_path / "job9", sinks=[OtelSink(resource={"team": "llm"})])
        train_window(make_model(), torch.randn(3, 4), step=4)
        assert tl.disarm()  # closes the sink: its providers' last export goes out now
        spans = rx.spans()
        metrics = rx.metrics()
    resources = {r["service.instance.id"] for r, _ in spans + metrics}
    assert resources == {"job9/rank0"}
    resource = spans[0][0]
    assert (resource["service.name"], resource["tl.run_id"], resource["team"]) == ("tl_dist", "job9", "llm")
    assert (resource["tl.rank"], resource["tl.world_size"]) == (0, 1)
    step = next(s for _, s in spans if s.name == "tl.step")
    assert step.trace_id == step_trace_id("job9", 4).to_bytes(16, "big")
    assert attributes(step.attributes)["tl.step"] == 4
    assert len(spans) == 1 + 16
    names = {m.name for _, m in metrics}
    assert {"tl.step.duration", "tl.op.duration", "tl.step.flops", "tl.module.duration"} <= names
    flops = {
        attributes(p.attributes)["tl.phase"]: p.as_int
        for _, m in metrics
        if m.name == "tl.step.flops"
        for p in m.sum.data_points
    }
    assert flops == {"forward": 240, "backward": 384, "optimizer": 0}


PROMETHEUS_SAMPLES = {
    "tl_step_duration_seconds_bucket", "tl_step_duration_seconds_count", "tl_step_duration_seconds_sum",
    "tl_op_duration_seconds_bucket", "tl_op_duration_seconds_count", "tl_op_duration_seconds_sum",
    "tl_module_duration_seconds_bucket", "tl_module_duration_seconds_count", "tl_module_duration_seconds_sum",
    "tl_collective_duration_seconds_bucket", "tl_collective_duration_seconds_count",
    "tl_collective_duration_seconds_sum",
    "tl_step_flops_total", "tl_collective_bytes_total", "tl_nonfinite_total",
    "tl_step_flops_per_second", "tl_collective_busbw_bytes_per_second", "tl_tensor_norm",
}  # fmt: skip


def scrape(url):
    """sample name -> [labels] of a Prometheus text exposition, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def test_prometheus_scrape(world_of_one):
    prom = start_prometheus(port=0)
    try:
        tl.arm(sinks=[OtelSink(meter_provider=prom, spans=None)])
        model = nn.Sequential(nn.Linear(2, 2), AllReduce(), Log())  # a NaN: log of a negative
        train_window(model, torch.tensor([[1.0, -3.0]]) * 10, stats=True)
        samples = scrape(prom.url)
    finally:
        tl.disarm()
        prom.shutdown()
    assert PROMETHEUS_SAMPLES <= set(samples), PROMETHEUS_SAMPLES - set(samples)
    for name in PROMETHEUS_SAMPLES:
        assert all(labels["tl_rank"] == "0" for labels, _ in samples[name]), name
    ((labels, value),) = [(lb, v) for lb, v in samples["tl_step_flops_total"] if lb["tl_phase"] == "forward"]
    assert value == 2 * 1 * 2 * 2  # one addmm, batch 1, 2x2
    count = [v for lb, v in samples["tl_op_duration_seconds_count"] if lb["tl_op_func"] == "addmm"]
    assert count == [1.0]
    assert {lb["tl_collective_kind"] for lb, _ in samples["tl_collective_bytes_total"]} == {"all_reduce"}
    assert {(lb["tl_module"], lb["tl_of"]) for lb, _ in samples["tl_tensor_norm"]} >= {
        ("0", "out"),
        ("1", "out"),
    }
    assert {lb["tl_module"] for lb, _ in samples["tl_module_duration_seconds_count"]} >= {
        "<root>",
        "0",
        "1",
        "2",
    }
    assert samples["target_info"][0][0]["service_name"] == "tl_dist"
    with pytest.raises(OSError):  # shut down: nothing listens any more
        urllib.request.urlopen(prom.url, timeout=2)


def test_docs_list_every_metric_and_its_prometheus_names():
    text = (Path(__file__).parents[1] / "docs" / "telemetry.md").read_text()
    for name in otel.INSTRUMENTS:
        assert f"| `{name}` |" in text, name
    for sample in PROMETHEUS_SAMPLES | {"tl_step_mfu"}:
        base = re.sub(r"_(count|sum)$", "_bucket", sample)
        assert f"`{base}`" in text, sample


def test_two_prometheus_endpoints_in_one_process():
    # Each on its own registry: a second endpoint (or the user's own prometheus_client metrics) does not clash.
    first, second = start_prometheus(port=0), start_prometheus(port=0)
    try:
        for prom in (first, second):
            prom.get_meter("mine").create_counter("jobs").add(1)
            assert [v for _, v in scrape(prom.url)["jobs_total"]] == [1.0]
    finally:
        first.shutdown()
        second.shutdown()


def test_prometheus_port_in_use_says_so():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError, match=r"ranks on one host need a port each"):
            start_prometheus(port=busy.getsockname()[1])
    with pytest.raises(ValueError, match="port must be an int"):
        start_prometheus(port=70000)


# -- collectors that are down or slow --------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def _loop_step_times(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(steps):
        x = torch.randn(16, 4)
        t0 = time.perf_counter()
        with tl.capture(step=step):
            model(x).sum().backward()
            opt.step()
        times.append(time.perf_counter() - t0)
        time.sleep(0.03)  # the rest of a real step (data loading, GPU work): the sink worker's turn
    return times


def _live_spans():
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), ReadableSpan))


@pytest.mark.slow
@pytest.mark.parametrize("collector", ["down", "slow"])
def test_collector_down_or_slow_never_reaches_training(monkeypatch, caplog, collector):
    model = make_model()
    # Reference: the same armed loop with a healthy (in-memory) OTel sink.
    mem = InMemory()
    tl.arm(sinks=[mem.sink])
    _loop_step_times(model, 3)  # warm-up
    healthy = _loop_step_times(model, 20)
    tl.disarm()
    del mem  # and the spans it kept

    with OtlpReceiver(delay=5.0) as slow:
        endpoint = slow.endpoint if collector == "slow" else f"http://127.0.0.1:{_free_port()}"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
        monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "16")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
        caplog.set_level(logging.DEBUG)
        sink = OtelSink()
        tl.arm(sinks=[sink])
        times = _loop_step_times(model, 20)
        assert tl.flush(5)
        time.sleep(0.5)  # let the export threads fail (or block) a few times
        # Memory: the spans alive are bounded by the batch processor's queue (64) and one batch in flight
        # (16), not by the 20 windows x 17 spans produced.
        assert _live_spans() <= 64 + 16
        t0 = time.perf_counter()
        tl.disarm()
        close_s = time.perf_counter() - t0

    stats = tl.sink_stats()
    assert (stats.delivered, stats.dropped, stats.errors) == (20, 0, {})
    # Noise on a shared machine is large; what a blocking export would cost is not (1 s timeouts, 5 s answers).
    assert statistics.median(times) < 3 * statistics.median(healthy) + 0.02, (times, healthy)
    assert max(times) < 1.0
    assert close_s < otel.CLOSE_TIMEOUT_S + 2
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1, [(r.name, r.getMessage()) for r in problems]
    assert problems[0].name == "tl_dist" and "OpenTelemetry export problem" in problems[0].getMessage()
    assert sink.stats.first_problem.rstrip(".") in problems[0].getMessage()
    if collector == "down":  # failed batches and retries, "Queue full": more happened than was logged
        assert sum(sink.stats.failed_exports.values()) + sink.stats.sdk_warnings >= 2
