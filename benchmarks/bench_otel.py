"""OpenTelemetry export cost: an armed training loop with OtelSink (spans at module depth 2 + metrics, exported
over OTLP/HTTP to a collector process on 127.0.0.1) and the shard writer, against what it is compared with.

Measured in this process, loops alternated within each round, printed as ratios (medians over rounds, and the
min):

1. ``every=50``: the loop armed with the shard writer and OtelSink against the same loop unarmed.
   Target <= 1.01x.
2. ``every=1``: the loop armed with OtelSink against the loop armed with a sink that does nothing -- what the
   export adds beyond the window itself (it runs on the sink worker thread). Target <= 1.05x (issue 23). (The shard
   writer is left out of both: at every=1 it keeps the worker busy all the time on its own.)
3. ``OtelSink.on_window`` of one window of that model on its own (worker-thread time per window), split
   into spans and metrics; and what the SDK's exporter threads then do: OTLP-encode the window's spans, and
   collect + encode every metric point (once per export interval, not per window).

The collector is a separate process answering every POST with 200 (as a real one would, off this process's
GIL); the metric reader exports every 5 s (the SDK's default is 60 s), so the loops include exports.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_otel.py [--rounds 7] [--part 1 2 3] [--spans none]``
(prefix ``OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.1`` for spans on one step in ten)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import tl_dist as tl  # noqa: E402
from tl_dist.exporters.otel import OtelSink  # noqa: E402

COLLECTOR = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Ok(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
print(server.server_port, flush=True)
server.serve_forever()
"""


def start_collector() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "5000")
    return proc


SPANS: str | None = "module"  # OtelSink's spans= in parts 1 and 2 (--spans)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


class NullSink:
    """Takes windows and does nothing: the arming, the window and its hand-off, without an export."""

    def on_window(self, trace: object, telemetry: object) -> None:
        pass

    def close(self) -> None:
        pass


def loop(
    model: torch.nn.Module, x: torch.Tensor, steps: int, *, every: int | None, otel: bool, shards: bool
) -> float:
    """Wall and CPU seconds (all threads of this process: training, sink worker, SDK exporters) for ``steps``
    training steps; unarmed when ``every`` is None. Flushing comes after the clock."""
    mod = copy.deepcopy(model)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    if every is not None:
        out = tempfile.mkdtemp(prefix="tl_bench_") if shards else None
        tl.arm(out, every=every, sinks=[OtelSink(spans=SPANS) if otel else NullSink()])
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(steps):
        if every is not None and tl.should_capture(s):
            with tl.capture(step=s):
                _step(mod, opt, x)
        else:
            _step(mod, opt, x)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if every is not None:
        tl.disarm()
    return elapsed, cpu


def compare(name: str, a: dict, b: dict, rounds: int, steps: int, target: float, model, x) -> None:
    """Loops ``a`` and ``b`` (keyword sets of :func:`loop`) alternated; prints median of a/b per round."""
    loop(model, x, steps, **a)  # warm-up both
    loop(model, x, steps, **b)
    times: dict[str, list[float]] = {"a": [], "b": []}
    cpus: dict[str, list[float]] = {"a": [], "b": []}
    dropped = {"a": 0, "b": 0}
    for r in range(rounds):
        for key in ("a", "b") if r % 2 else ("b", "a"):
            wall, cpu = loop(model, x, steps, **(a if key == "a" else b))
            times[key].append(wall)
            cpus[key].append(cpu)
            dropped[key] += tl.sink_stats().dropped if (a if key == "a" else b)["every"] else 0
    ratios = [ta / tb for ta, tb in zip(times["a"], times["b"])]
    cpu_ratios = [ca / cb for ca, cb in zip(cpus["a"], cpus["b"])]
    med = statistics.median(ratios)
    verdict = "ok" if med <= target else "MISSED"
    step_ms = {k: statistics.median(v) / steps * 1e3 for k, v in times.items()}
    print(
        f"{name}: wall median {med:.3f}x (min {min(ratios):.3f}, max {max(ratios):.3f}; {rounds} rounds of "
        f"{steps} steps); target <= {target}x: {verdict}\n   CPU time of the process (all threads) median "
        f"{statistics.median(cpu_ratios):.3f}x (min {min(cpu_ratios):.3f}); per step {step_ms['a']:.1f} vs "
        f"{step_ms['b']:.1f} ms; windows dropped (queue full) {dropped['a']} vs {dropped['b']}"
    )


def part_on_window(model: torch.nn.Module, x: torch.Tensor, rounds: int) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mod = copy.deepcopy(model)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    with tl.capture() as cap:
        _step(mod, opt, x)
    trace, telemetry = cap.trace, tl.telemetry.summarize(cap.trace)
    exported, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exported))
    sink = OtelSink(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader], shutdown_on_exit=False),
    )
    sink.on_window(trace, telemetry)  # builds the instruments
    totals, spans, metrics = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sink.on_window(trace, telemetry)
        t1 = time.perf_counter()
        sink._window_spans.emit(trace, telemetry)
        t2 = time.perf_counter()
        sink._window_metrics.record(trace, telemetry)
        t3 = time.perf_counter()
        totals.append((t1 - t0) * 1e3)
        spans.append((t2 - t1) * 1e3)
        metrics.append((t3 - t2) * 1e3)
    n_spans = len(exported.get_finished_spans()) // (2 * rounds + 1)
    print(
        f"3. OtelSink.on_window, {len(trace)}-op window ({n_spans} spans): median "
        f"{statistics.median(totals):.2f} ms (spans {statistics.median(spans):.2f}, metrics "
        f"{statistics.median(metrics):.2f}); summarize alone is computed once per window for all sinks"
    )
    # What the SDK's exporter threads do with it: OTLP-encode one window's spans (the batch span processor does
    # it per batch: the same work per span), and collect + encode all metric points (per export interval).
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    window = exported.get_finished_spans()[-n_spans:]
    encode, collect = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        encode_spans(window).SerializeToString()
        t1 = time.perf_counter()
        data = reader.get_metrics_data()
        encode_metrics(data).SerializeToString()
        t2 = time.perf_counter()
        encode.append((t1 - t0) * 1e3)
        collect.append((t2 - t1) * 1e3)
    points = sum(
        len(m.data.data_points) for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
    )
    print(
        f"   exporter threads: OTLP encoding of one window's spans median {statistics.median(encode):.2f} ms; "
        f"collecting + encoding the metrics ({points} points, once per export interval) "
        f"{statistics.median(collect):.2f} ms"
    )
    tracer_provider.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--part", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument(
        "--spans", choices=["module", "none"], default="module", help="OtelSink's spans= in parts 1-2"
    )
    args = parser.parse_args()
    global SPANS
    SPANS = None if args.spans == "none" else args.spans
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, x = make_model(), torch.randn(4, 64, 128)
    collector = start_collector()
    try:
        if 1 in args.part:
            compare(
                "1. every=50 loop, shard writer + OtelSink vs unarmed",
                {"every": 50, "otel": True, "shards": True},
                {"every": None, "otel": False, "shards": False},
                args.rounds,
                150,
                1.01,
                model,
                x,
            )
        if 2 in args.part:
            compare(
                "2. every=1 loop, OtelSink vs a sink doing nothing",
                {"every": 1, "otel": True, "shards": False},
                {"every": 1, "otel": False, "shards": False},
                args.rounds,
                30,
                1.05,
                model,
                x,
            )
        if 3 in args.part:
            part_on_window(model, x, args.rounds * 3)
    finally:
        collector.kill()


if __name__ == "__main__":
    main()
