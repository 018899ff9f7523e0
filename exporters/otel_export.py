"""The export plumbing OtelSink owns: exporters built from the ``OTEL_*`` environment, failures logged once,
shutdown bounded in time.

The SDK's OTLP exporters log every failed batch (and every retry) from their export threads; a collector that
is down for an hour would flood the training job's log. OtelSink's exporters run the SDK's export under a
thread-local "quiet" mark; a filter on the SDK's loggers drops what is logged under it, and the sink logs the
first problem once itself (logger ``tl_dist``) and counts the rest (``OtelSink.stats``). Everything else the
SDK logs -- including other users' pipelines in the same process -- passes untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tl_dist.errors import missing_extra

try:
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
except ImportError as exc:  # the tl_dist[otel] extra is not installed
    raise missing_extra("tl_dist.exporters.otel", "otel", exc) from exc

log = logging.getLogger("tl_dist")

CLOSE_TIMEOUT_S = 5.0
"""How long ``OtelSink.close()`` (``tl.disarm()``, exit) waits for its own providers' last export."""

EXPORTER_NAMES = ("otlp", "console", "none")
"""Values ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` may take (comma-separated) for OtelSink."""

_QUIET_LOGGERS = ("opentelemetry", "urllib3", "requests")
_local = threading.local()


@dataclass
class ExportStats:
    """What went wrong exporting, per OtelSink (``sink.stats``); only the first problem is logged.

    Attributes:
        failed_exports: signal (``spans``, ``metrics``) -> batches the exporter reported failed.
        sdk_warnings: warnings the SDK logged on the sink's behalf (e.g. "Queue full, dropping spans").
        first_problem: the problem that was logged, as text.
    """

    failed_exports: dict[str, int] = field(default_factory=dict)
    sdk_warnings: int = 0
    first_problem: str | None = None


class Trouble:
    """Counts one sink's export problems and logs the first one, once."""

    def __init__(self, sink_name: str) -> None:
        self.sink_name = sink_name
        self.stats = ExportStats()
        self._lock = threading.Lock()

    def report(self, problem: str, *, signal: str | None = None) -> None:
        with self._lock:
            if signal is not None:
                self.stats.failed_exports[signal] = self.stats.failed_exports.get(signal, 0) + 1
            else:
                self.stats.sdk_warnings += 1
            first = self.stats.first_problem is None
            if first:
                self.stats.first_problem = problem
        if first:
            log.warning(
                "tl_dist: %s: OpenTelemetry export problem: %s. Training is not affected; further problems "
                "are counted in the sink's .stats, not logged.",
                self.sink_name,
                problem.rstrip("."),
            )


class _QuietFilter(logging.Filter):
    """Drops records logged on a thread inside :func:`quiet`; reports the warnings to that quiet's Trouble."""

    def filter(self, record: logging.LogRecord) -> bool:
        trouble = getattr(_local, "trouble", None)
        if trouble is None:
            return True
        if record.levelno >= logging.WARNING:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a malformed record must not break the export thread
                message = str(record.msg)
            trouble.report(message)
        return False


_FILTER = _QuietFilter()
_filtered: set[str] = set()
_scanned = [0]  # how many loggers existed at the last scan
_filter_lock = threading.Lock()


def _install_filter() -> None:
    """Put the filter on the SDK's (and its HTTP stack's) loggers; filters act only where a record is made,
    so each logger needs its own. Loggers appear as modules import: this is called again before each export."""
    loggers = logging.root.manager.loggerDict
    if len(loggers) == _scanned[0]:
        return
    with _filter_lock:
        _scanned[0] = len(loggers)
        for name in list(loggers):
            if name not in _filtered and name.startswith(_QUIET_LOGGERS):
                logging.getLogger(name).addFilter(_FILTER)
                _filtered.add(name)


@contextlib.contextmanager
def quiet(trouble: Trouble) -> Iterator[None]:
    """Within: the SDK's log records on this thread are dropped, their warnings reported to ``trouble``."""
    _install_filter()
    previous = getattr(_local, "trouble", None)
    _local.trouble = trouble
    try:
        yield
    finally:
        _local.trouble = previous


class GuardedSpanExporter(SpanExporter):
    """``inner`` exporting quietly: a failed batch is reported to ``trouble`` instead of logged by the SDK."""

    def __init__(self, inner: SpanExporter, trouble: Trouble) -> None:
        self.inner = inner
        self.trouble = trouble

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        with quiet(self.trouble):
            try:
                result = self.inner.export(spans)
                problem = "the spans exporter reported a failed batch"
            except Exception as exc:  # noqa: BLE001 - on the SDK's export thread: report, never raise
                result, problem = (
                    SpanExportResult.FAILURE,
                    f"exporting spans raised {type(exc).__name__}: {exc}",
                )
        if result is not SpanExportResult.SUCCESS:
            self.trouble.report(problem, signal="spans")
        return result

    def shutdown(self) -> None:
        with quiet(self.trouble):
            self.inner.shutdown()

    def abort(self) -> None:
        """Stop the exporter's retries now (its request in flight runs to its timeout)."""
        self.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class GuardedMetricExporter(MetricExporter):
    """``inner`` (a metric exporter) exporting quietly, like :class:`GuardedSpanExporter`."""

    def __init__(self, inner: MetricExporter, trouble: Trouble) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self.inner = inner
        self.trouble = trouble

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        with quiet(self.trouble):
            try:
                result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
                problem = "the metrics exporter reported a failed batch"
            except Exception as exc:  # noqa: BLE001
                result = MetricExportResult.FAILURE
                problem = f"exporting metrics raised {type(exc).__name__}: {exc}"
        if result is not MetricExportResult.SUCCESS:
            self.trouble.report(problem, signal="metrics")
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        with quiet(self.trouble):
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    def abort(self) -> None:
        """Stop the exporter's retries now (its request in flight runs to its timeout)."""
        self.shutdown(timeout_millis=0)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)


# -- configuration from the environment ---------------------------------------------------------------------
def env_exporters(signal: str) -> tuple[str, ...]:
    """The exporters ``OTEL_{TRACES,METRICS}_EXPORTER`` asks for (default ``otlp``), checked; () when none.

    Raises:
        ValueError: an exporter or an OTLP protocol tl_dist does not build, naming the variable.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    names = tuple(n.strip().lower() for n in os.environ.get(variable, "otlp").split(",") if n.strip())
    unknown = [n for n in names if n not in EXPORTER_NAMES]
    if unknown:
        raise ValueError(
            f"{variable}={os.environ[variable]!r}: OtelSink builds exporters {', '.join(EXPORTER_NAMES)}; "
            f"for {unknown[0]!r} build the provider yourself and pass it (tracer_provider=/meter_provider=)"
        )
    if "otlp" in names:
        for var in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = os.environ.get(var, "").strip()
            if protocol:
                if protocol != "http/protobuf":
                    raise ValueError(
                        f"{var}={protocol!r}: OtelSink builds OTLP/HTTP exporters ('http/protobuf'); for "
                        f"{protocol!r} build the provider with that exporter and pass it"
                    )
                break
    return tuple(n for n in names if n != "none")


def build_tracer_provider(
    resource: Any, exporters: tuple[str, ...], trouble: Trouble
) -> tuple[Any, list[GuardedSpanExporter]]:
    """A TracerProvider exporting through batch processors (queue, delay, batch size from ``OTEL_BSP_*``),
    and its exporters."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # tl_dist closes it, bounded
    guarded = []
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            inner: SpanExporter = OTLPSpanExporter()
        else:
            inner = ConsoleSpanExporter()
        guarded.append(GuardedSpanExporter(inner, trouble))
        provider.add_span_processor(BatchSpanProcessor(guarded[-1]))
    return provider, guarded


def build_meter_provider(
    resource: Any, exporters: tuple[str, ...], trouble: Trouble
) -> tuple[Any, list[GuardedMetricExporter]]:
    """A MeterProvider with a periodic reader per exporter (interval from ``OTEL_METRIC_EXPORT_INTERVAL``),
    and its exporters."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers, guarded = [], []
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            inner: MetricExporter = OTLPMetricExporter()
        else:
            inner = ConsoleMetricExporter()
        guarded.append(GuardedMetricExporter(inner, trouble))
        readers.append(PeriodicExportingMetricReader(guarded[-1]))
    return MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False), guarded


def shutdown_within(providers: list[Any], timeout: float, trouble: Trouble) -> bool:
    """Shut ``providers`` down in parallel on helper threads, waiting ``timeout`` seconds at most in all; True
    when all finished. What is left (an export to a slow collector) is abandoned on a daemon thread."""

    def run(provider: Any) -> None:
        with quiet(trouble):
            try:
                provider.shutdown()
            except Exception as exc:  # noqa: BLE001 - closing must not raise into disarm
                log.debug("tl_dist: OpenTelemetry provider shutdown failed: %s", exc)

    threads = [
        threading.Thread(target=run, args=(p,), name="tl_dist-otel-close", daemon=True) for p in providers
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
