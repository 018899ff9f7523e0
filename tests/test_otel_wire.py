"""OtelSink over the wire: a real OTLP/HTTP receiver on 127.0.0.1, Prometheus scraped over HTTP, and
collectors that are down or slow."""

import collections
import gc
import logging
import re
import socket
import statistics
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from otel_helpers import (  # noqa: F401 - clean_otel_env, world_of_one: fixtures
    C10D_NO_AUTOGRAD,
    AllReduce,
    InMemory,
    Log,
    clean_otel_env,
    make_model,
    train_window,
    world_of_one,
)
from otlp_receiver import OtlpReceiver, attributes
from torch import nn

import tl_dist as tl
from tl_dist.exporters import otel
from tl_dist.exporters.otel import OtelSink, start_prometheus, step_trace_id

pytestmark = pytest.mark.filterwarnings(C10D_NO_AUTOGRAD)


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
    assert {"tl.step.duration", "tl.op.time", "tl.op.calls", "tl.step.flops", "tl.module.duration"} <= names
    flops = {
        attributes(p.attributes)["tl.phase"]: p.as_int
        for _, m in metrics
        if m.name == "tl.step.flops"
        for p in m.sum.data_points
    }
    assert flops == {"forward": 240, "backward": 384, "optimizer": 0}


PROMETHEUS_SAMPLES = {
    "tl_step_duration_seconds_bucket", "tl_step_duration_seconds_count", "tl_step_duration_seconds_sum",
    "tl_op_time_seconds_total", "tl_op_calls_total", "tl_op_flops_total",
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


@pytest.mark.usefixtures("world_of_one")
def test_prometheus_scrape():
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
    count = [v for lb, v in samples["tl_op_calls_total"] if lb["tl_op_func"] == "addmm"]
    assert count == [1.0]
    flops = [v for lb, v in samples["tl_op_flops_total"] if lb["tl_op_func"] == "addmm"]
    assert flops == [2 * 1 * 2 * 2]
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
