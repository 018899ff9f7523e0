"""Shared pieces of the OtelSink tests: a hand-built model, a sink on in-memory providers, a world of one rank."""

import collections
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn

import tl_dist as tl
from tl_dist.exporters.otel import OtelSink

# An in-place c10d collective has no autograd formula; torch says so once per backward through it.
C10D_NO_AUTOGRAD = "ignore:c10d..allreduce_. an autograd kernel was not registered"

_OTEL_ENV = [k for k in os.environ if k.startswith("OTEL_")]


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
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

    def __init__(self, sampler=None, **sink_kwargs):
        self.spans_out = InMemorySpanExporter()
        if sampler is None:
            self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        else:
            self.tracer_provider = TracerProvider(sampler=sampler, shutdown_on_exit=False)
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


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class DoubleLog(nn.Module):
    def forward(self, x):
        return torch.log(x) * 2


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


def prometheus_samples(text, name):
    """(labels, value) of every sample ``name`` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]
