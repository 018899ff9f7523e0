"""OpenTelemetry and Prometheus export of capture windows: :class:`OtelSink` and :func:`start_prometheus`.

Each window becomes spans (``tl.step``, module calls to ``module_depth`` in forward and backward, collectives,
ops with ``spans="op"``) carrying the times the trace recorded, and metrics with fixed names
(``tl.step.duration``, ``tl.op.time``, ``tl.op.calls``, ``tl.op.flops``, ``tl.module.duration``,
``tl.collective.duration``, ``tl.step.flops``, ``tl.collective.bytes``, ``tl.nonfinite``,
``tl.step.flops_per_second``, ``tl.step.mfu``, ``tl.collective.busbw``, ``tl.tensor.norm``), every point with ``tl.rank``. docs/telemetry.md lists them all.

Example:
    >>> from tl_dist.exporters.otel import OtelSink, start_prometheus
    >>> tl.arm("runs/job42", every=50, sinks=[OtelSink()])      # OTLP/HTTP, from the OTEL_* variables
    >>> prom = start_prometheus(port=9464 + local_rank)            # or: scrape each rank
    >>> tl.arm(sinks=[OtelSink(meter_provider=prom, spans=None)])

The sink runs on tl_dist's sink worker thread, never on the training thread; the providers it builds export on
the SDK's batch span processor and periodic metric reader threads, with bounded queues. A collector that is
down or slow costs the training loop nothing: the first failure is logged once (logger ``tl_dist``), later ones
are counted in ``sink.stats``, and ``tl.disarm()`` waits at most ``CLOSE_TIMEOUT_S`` for the last export.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tl_dist.errors import missing_extra

try:
    from opentelemetry.metrics import MeterProvider as ApiMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.trace import TracerProvider as ApiTracerProvider
except ImportError as exc:  # the tl_dist[otel] extra is not installed
    raise missing_extra("tl_dist.exporters.otel", "otel", exc) from exc

from tl_dist import __version__

from .otel_export import (
    CLOSE_TIMEOUT_S,
    ExportStats,
    Trouble,
    build_meter_provider,
    build_tracer_provider,
    env_exporters,
    quiet,
    shutdown_within,
)
from .otel_metrics import DURATION_BUCKETS_S, INSTRUMENTS, WindowMetrics
from .otel_spans import ROOT, WindowSpans, step_trace_id
from .otel_straggler import StepStraggler, StragglerWatch

if TYPE_CHECKING:
    from tl_dist.telemetry import StepTelemetry
    from tl_dist.trace import Trace

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DURATION_BUCKETS_S",
    "INSTRUMENTS",
    "ROOT",
    "ExportStats",
    "OtelSink",
    "PrometheusMeterProvider",
    "StepStraggler",
    "rank_resource",
    "start_prometheus",
    "step_trace_id",
]

log = logging.getLogger("tl_dist")
SPAN_MODES = ("module", "op", None)
SCOPE = "tl_dist"
DEFAULT_SERVICE_NAME = "tl_dist"


def rank_resource(metadata: Mapping[str, Any], extra: Resource | None = None) -> Resource:
    """The resource of one rank's telemetry, from a window's ``trace.metadata``.

    ``service.name`` is ``tl_dist`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` say otherwise;
    ``service.instance.id`` is ``{run_id}/rank{rank}``, set explicitly (the SDK would invent a UUID and make a
    new one after ``fork``); ``host.name``, ``process.pid``, ``tl.rank``, ``tl.local_rank``, ``tl.world_size``,
    ``tl.run_id`` come from the metadata. ``extra`` (OtelSink's ``resource=``) overrides any of them.

    Example:
        >>> rank_resource({"rank": 1, "run_id": "job42", "host": "n1"}).attributes["service.instance.id"]
        'job42/rank1'
    """
    rank = int(metadata.get("rank", 0))
    run_id = str(metadata.get("run_id") or "")
    facts: dict[str, Any] = {
        "service.instance.id": f"{run_id}/rank{rank}",
        "host.name": str(metadata.get("host") or socket.gethostname()),
        "process.pid": int(metadata.get("pid", os.getpid())),
        "tl.rank": rank,
        "tl.local_rank": int(metadata.get("local_rank", rank)),
        "tl.world_size": int(metadata.get("world_size", 1)),
        "tl.run_id": run_id,
    }
    env = OTELResourceDetector().detect().attributes  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    resource = Resource.create({"service.name": DEFAULT_SERVICE_NAME, **env, **facts})
    return resource.merge(extra) if extra is not None else resource


class OtelSink:
    """A sink exporting every window as OpenTelemetry spans and metrics.

    Args:
        tracer_provider: where spans go. None: a TracerProvider built from the ``OTEL_*`` environment
            (``OTEL_TRACES_EXPORTER`` = ``otlp`` (default, OTLP/HTTP), ``console`` or ``none``; endpoint,
            headers and timeout as the SDK reads them; ``OTEL_BSP_*`` for the batch processor).
        meter_provider: where metrics go, e.g. :func:`start_prometheus`'s. None: one built from the environment
            (``OTEL_METRICS_EXPORTER``, ``OTEL_METRIC_EXPORT_INTERVAL``, ...).
        spans: ``"module"`` -- a ``tl.step`` span per window with module-call spans and collective spans;
            ``"op"`` -- those plus a span per op (a big model makes thousands per window: the batch processor's
            queue drops the oldest beyond ``OTEL_BSP_MAX_QUEUE_SIZE``); None -- no spans (no tracer built).
        module_depth: deepest module-call nesting that gets spans and per-module metrics (the outermost
            module is depth 0, its children 1, ...); bounds the metrics' cardinality.
        resource: attributes (a ``Resource`` or a mapping) merged over :func:`rank_resource`'s in the
            providers this sink builds, e.g. ``{"service.name": "pretrain-7b"}``.
        stragglers: fill the ``tl.step.straggler_rank`` / ``tl.step.straggler_wait`` gauges without a caller
            that sees every rank (a plain torchrun job; the Lightning callback sets them itself): rank
            ``merge_rank`` merges each captured step once every rank's shard of it is in the run folder
            (``tl.arm(out_dir)``, a URL too), by the merge's own code (:func:`tl_dist.pipeline.step_straggler`),
            on a thread of its own. Needs ``tl.arm(out_dir)`` on every rank. The results, a step whose shards
            did not all arrive in time included, are in :attr:`step_stragglers`.
        merge_rank: the rank that merges (the others do nothing more).
        merge_wait_s: how long after this rank's window reached the sink the other ranks' shards of that step
            may take to arrive; a step still missing some is counted in ``tl.step.straggler_unknown`` (the
            gauges keep their last value) and logged once.

    Example:
        >>> tl.arm("runs/job42", every=50, sinks=[OtelSink(module_depth=3)])
        >>> tl.arm("runs/job42", every=50, sinks=[OtelSink(stragglers=True)])  # rank 0 sets the gauges

    Caveats: providers passed in are the caller's: the sink never flushes or shuts them down, and their resource
    is theirs (give it ``rank_resource``'s attributes for per-rank identity). Several sinks in one process
    share the metric instruments of a shared meter provider.
    """

    name = "otel"
    needs_tensors = False  # reads the tables and metadata only: windows reach it without saved tensors

    def __init__(
        self,
        *,
        tracer_provider: ApiTracerProvider | None = None,
        meter_provider: ApiMeterProvider | None = None,
        spans: str | None = "module",
        module_depth: int = 2,
        resource: Resource | Mapping[str, Any] | None = None,
        stragglers: bool = False,
        merge_rank: int = 0,
        merge_wait_s: float = 60.0,
    ) -> None:
        if tracer_provider is not None and not isinstance(tracer_provider, ApiTracerProvider):
            raise ValueError(
                "tracer_provider must be an opentelemetry.trace.TracerProvider (e.g. "
                f"opentelemetry.sdk.trace.TracerProvider) or None, got {type(tracer_provider).__name__}"
            )
        if meter_provider is not None and not isinstance(meter_provider, ApiMeterProvider):
            raise ValueError(
                "meter_provider must be an opentelemetry.metrics.MeterProvider (e.g. start_prometheus()) or "
                f"None, got {type(meter_provider).__name__}"
            )
        if spans not in SPAN_MODES:
            raise ValueError(f"spans must be one of 'module', 'op' or None, got {spans!r}")
        if isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < 0:
            raise ValueError(
                f"module_depth must be an int >= 0 (0: only the outermost module), got {module_depth!r}"
            )
        if resource is not None and not isinstance(resource, Resource):
            if not isinstance(resource, Mapping):
                raise ValueError(
                    "resource must be an opentelemetry.sdk.resources.Resource or a mapping of attributes, "
                    f"got {type(resource).__name__}"
                )
            resource = Resource(dict(resource))
        if not isinstance(stragglers, bool):
            raise ValueError(f"stragglers must be a bool, got {stragglers!r}")
        if isinstance(merge_rank, bool) or not isinstance(merge_rank, int) or merge_rank < 0:
            raise ValueError(f"merge_rank must be an int >= 0 (the rank that merges), got {merge_rank!r}")
        if (
            isinstance(merge_wait_s, bool)
            or not isinstance(merge_wait_s, (int, float))
            or not merge_wait_s > 0
        ):
            raise ValueError(f"merge_wait_s must be a number of seconds > 0, got {merge_wait_s!r}")
        builds_tracer = tracer_provider is None and spans is not None
        builds_meter = meter_provider is None
        if resource is not None and not (builds_tracer or builds_meter):
            raise ValueError(
                "resource= applies to the providers OtelSink builds, and it builds none here (both were "
                "passed in, or spans=None with a meter_provider): set the resource on your providers"
            )
        # Read (and check) the environment now, on the caller's thread, so a bad variable fails at once.
        self._trace_exporters = env_exporters("traces") if builds_tracer else ()
        self._metric_exporters = env_exporters("metrics") if builds_meter else ()
        self.spans = spans
        self.module_depth = module_depth
        self.resource = resource
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._owned: list[Any] = []  # providers this sink built (and shuts down)
        self._guarded: list[Any] = []
        self._trouble = Trouble(self.name)
        self._window_spans: WindowSpans | None = None
        self._window_metrics: WindowMetrics | None = None
        self._late: tuple[tuple[int, int] | None] | None = None  # on_straggler's last value, boxed
        self._ready = False
        self.stragglers = stragglers
        self.merge_rank = merge_rank
        self.merge_wait_s = float(merge_wait_s)
        self._watch: StragglerWatch | None = None
        self._watch_results: dict[int, StepStraggler] = {}
        self._unknown_logged = False

    @property
    def stats(self) -> ExportStats:
        """Export problems so far: failed batches per signal, SDK warnings, the first problem (the one logged)."""
        return self._trouble.stats

    def on_window(self, trace: Trace, telemetry: StepTelemetry | None) -> None:
        """Export one window (on tl_dist's sink worker thread)."""
        with quiet(self._trouble):  # e.g. "Queue full, dropping spans": reported once, not logged per span
            if not self._ready:
                self._setup(trace.metadata)
            if self._window_spans is not None:
                self._window_spans.emit(trace, telemetry)
            if self._window_metrics is not None:
                self._window_metrics.record(trace, telemetry)
                if self._late is not None:
                    self._window_metrics.straggler(self._late[0])
        if self.stragglers:
            self._watch_step(trace.metadata)

    @property
    def step_stragglers(self) -> dict[int, StepStraggler]:
        """``stragglers=True`` on ``merge_rank``: step -> :class:`StepStraggler` of the latest captured steps
        merged so far (``late``: ``(rank, wait_ns)`` or None; ``missing``: ranks whose shard did not arrive in
        time). Empty on the other ranks.

        Example:
            >>> sink.step_stragglers[100].late
            (3, 30000000)
        """
        watch = self._watch
        return dict(watch.results) if watch is not None else dict(self._watch_results)

    def wait_stragglers(self, timeout: float | None = None) -> bool:
        """Wait until every captured step handed to the merge has its result (:attr:`step_stragglers`); False
        if ``timeout`` seconds passed first. Never call it on the training thread of a rank whose peers have
        not written their shards yet: it waits for them."""
        watch = self._watch
        return True if watch is None else watch.wait(timeout)

    def _watch_step(self, metadata: Mapping[str, Any]) -> None:
        if int(metadata.get("rank", 0)) != self.merge_rank:
            return
        shard = metadata.get("shard")
        if not shard:
            self._trouble.report(
                "stragglers=True needs the shards: arm with an out_dir (tl.arm('runs/job42', sinks=[...]))"
            )
            return
        if self._watch is None:
            self._watch = StragglerWatch(self._merged, wait_s=self.merge_wait_s)
        self._watch.submit(
            str(shard),
            int(metadata.get("step", 0)),
            int(metadata.get("world_size", 1)),
            str(metadata.get("job_nonce") or ""),
        )

    def _merged(self, result: StepStraggler) -> None:
        """A step's merge (on the watch's thread): the gauges, or the step counted as unknown."""
        if result.known:
            self.on_straggler(result.late)
            return
        why = result.error or f"no shard from rank(s) {list(result.missing)} within {self.merge_wait_s:g} s"
        log.log(
            logging.WARNING if not self._unknown_logged else logging.DEBUG,
            "tl_dist: %s: the straggler of step %d is unknown: %s%s",
            self.name,
            result.step,
            why,
            "" if self._unknown_logged else " (further such steps: tl.step.straggler_unknown, not logged)",
        )
        self._unknown_logged = True
        metrics = self._window_metrics
        if metrics is not None:
            with quiet(self._trouble):
                metrics.straggler_unknown()

    def on_straggler(self, late: tuple[int, int] | None) -> None:
        """The last captured step's straggler, ``(rank, wait_ns)`` or None (:func:`tl_dist.step_facts.straggler`),
        from a caller that sees every rank (the Lightning callback): the ``tl.step.straggler_rank`` and
        ``tl.step.straggler_wait`` gauges. Cheap (no export); kept for the next window when metrics are not
        built yet.

        Example:
            >>> sink.on_straggler((1, 30_000_000))  # rank 1; the others waited 30 ms for it
        """
        self._late = (late,)
        metrics = self._window_metrics
        if metrics is not None and metrics.rank is not None:  # else on_window sets them, with the tl.rank
            with quiet(self._trouble):
                metrics.straggler(late)

    def _setup(self, metadata: Mapping[str, Any]) -> None:
        """Build the providers this sink owns (their resource needs the rank and run id of a window). Tried
        once per arming: a failure is logged by the sink worker, and the sink exports what it could build."""
        self._ready = True
        resource = None
        if self._trace_exporters or self._metric_exporters:
            resource = rank_resource(metadata, self.resource)
        if self._trace_exporters:
            self.tracer_provider, guarded = build_tracer_provider(
                resource, self._trace_exporters, self._trouble
            )
            self._owned.append(self.tracer_provider)
            self._guarded += guarded
        if self._metric_exporters:
            self.meter_provider, guarded = build_meter_provider(
                resource, self._metric_exporters, self._trouble
            )
            self._owned.append(self.meter_provider)
            self._guarded += guarded
        if self.spans is not None and self.tracer_provider is not None:
            tracer = self.tracer_provider.get_tracer(SCOPE, __version__)
            self._window_spans = WindowSpans(tracer, module_depth=self.module_depth, ops=self.spans == "op")
        if self.meter_provider is not None:
            meter = self.meter_provider.get_meter(SCOPE, __version__)
            self._window_metrics = WindowMetrics(meter, module_depth=self.module_depth)

    def close(self) -> None:
        """Shut down the providers this sink built, waiting ``CLOSE_TIMEOUT_S`` at most for their last export.

        A sink armed again afterwards builds new ones at its next window.
        """
        watch, self._watch = self._watch, None
        if watch is not None:  # the steps still merging set their gauges before the providers go
            watch.close(CLOSE_TIMEOUT_S)
            self._watch_results = dict(watch.results)
        owned, guarded = self._owned, self._guarded
        if self._trace_exporters and self.tracer_provider in owned:
            self.tracer_provider = None
        if self._metric_exporters and self.meter_provider in owned:
            self.meter_provider = None
        self._owned, self._guarded = [], []
        self._window_spans = self._window_metrics = None
        self._ready = False
        if owned and not shutdown_within(owned, CLOSE_TIMEOUT_S, self._trouble):
            for exporter in guarded:
                exporter.abort()
            self._trouble.report(
                f"the last export did not finish within {CLOSE_TIMEOUT_S:g} s at close; dropped"
            )

    def __repr__(self) -> str:
        more = f", stragglers=True, merge_rank={self.merge_rank}" if self.stragglers else ""
        return f"OtelSink(spans={self.spans!r}, module_depth={self.module_depth}{more})"


class PrometheusMeterProvider(MeterProvider):
    """The meter provider :func:`start_prometheus` returns: ``.port``, ``.url``; ``shutdown()`` also stops the
    HTTP server."""

    def __init__(self, *, reader: Any, server: Any, resource: Resource) -> None:
        super().__init__(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
        self._server = server
        self.port: int = server.server_port
        host = server.server_address[0]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        try:
            super().shutdown(timeout_millis=timeout_millis)
        finally:
            self._server.shutdown()
            self._server.server_close()


def start_prometheus(port: int = 9464, addr: str = "127.0.0.1") -> PrometheusMeterProvider:
    """Serve a Prometheus scrape endpoint at ``http://addr:port/metrics``; returns its meter provider.

    The SDK's Prometheus reader sits on its own registry (not prometheus_client's global one), so several
    endpoints (or your own) can live in one process. Pass the provider to :class:`OtelSink`. Metric names get
    the SDK's Prometheus suffixes (``tl_step_duration_seconds_bucket``, ``tl_step_flops_total``, ...; the list
    is in docs/telemetry.md) and every series a ``tl_rank`` label.

    Args:
        port: TCP port; 0 lets the OS choose (read ``.port``). Ranks sharing a host need one each, e.g.
            ``9464 + local_rank``.
        addr: address to listen on; ``"0.0.0.0"`` for a Prometheus server on another machine.

    Example:
        >>> prom = start_prometheus(port=9464 + int(os.environ.get("LOCAL_RANK", 0)), addr="0.0.0.0")
        >>> tl.arm("runs/job42", every=50, sinks=[OtelSink(meter_provider=prom, spans=None)])
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise ValueError(f"addr must be a host address string such as '127.0.0.1', got {addr!r}")
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise OSError(
            f"start_prometheus: cannot listen on {addr}:{port} ({exc.strerror or exc}); ranks on one host need "
            "a port each, e.g. port=9464 + local_rank"
        ) from exc
    return PrometheusMeterProvider(reader=reader, server=server, resource=_process_resource())


def _process_resource() -> Resource:
    """The Prometheus endpoint's ``target_info``: service and host, and the rank as far as it is known now
    (the process group, else torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    env = OTELResourceDetector().detect().attributes
    attributes = {
        "service.name": DEFAULT_SERVICE_NAME,
        **env,
        "host.name": socket.gethostname(),
        "tl.rank": rank,
        "tl.local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "tl.world_size": world,
    }
    return Resource(attributes)
