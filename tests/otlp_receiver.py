"""A real OTLP/HTTP receiver for tests: a ThreadingHTTPServer on 127.0.0.1 decoding the protobuf requests.

Example:
    with OtlpReceiver() as rx:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.endpoint
        ...  # export
        rx.spans()   # [(resource attributes, span)] as decoded opentelemetry.proto messages

``delay`` makes every answer wait that many seconds first (a slow collector).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_KINDS = {
    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
}


def attributes(key_values: Any) -> dict[str, Any]:
    """A protobuf KeyValue list as a dict of plain values."""
    out = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind) if kind else None
    return out


class OtlpReceiver:
    """Collects decoded ``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest`` messages."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests: dict[str, list] = {path: [] for path in _KINDS}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                kinds = _KINDS.get(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if kinds is None:
                    self.send_error(404)
                    return
                request_type, response_type = kinds
                message = request_type()
                message.ParseFromString(body)
                with receiver._lock:
                    receiver.requests[self.path].append(message)
                if receiver.delay:
                    time.sleep(receiver.delay)
                payload = response_type().SerializeToString()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the exporter gave up waiting (a slow-collector test)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """Every span received, with its resource's attributes."""
        with self._lock:
            requests = list(self.requests["/v1/traces"])
        return [
            (attributes(rs.resource.attributes), span)
            for req in requests
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def metrics(self) -> list[tuple[dict[str, Any], Any]]:
        """Every metric received, with its resource's attributes."""
        with self._lock:
            requests = list(self.requests["/v1/metrics"])
        return [
            (attributes(rm.resource.attributes), metric)
            for req in requests
            for rm in req.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        ]
