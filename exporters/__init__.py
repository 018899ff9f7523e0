"""Telemetry exporters over tl_dist's framework-free core, installed as ``tl_dist.exporters``.

- :mod:`tl_dist.exporters.otel`: OpenTelemetry metrics and spans, OTLP and Prometheus (needs
  ``pip install 'tl_dist[otel]'``); ``grafana/``: the dashboard and its provisioning files.

This folder sits beside ``tl_dist/`` in the repository and is mapped into the package by ``package-dir``
(pyproject.toml); one file must be one module, so importing it under its folder name fails.
"""

if __name__ != "tl_dist.exporters":
    raise ImportError(
        f"{__name__!r} is tl_dist's exporter folder; import it as tl_dist.exporters "
        "(e.g. `from tl_dist.exporters.otel import OtelSink`) after `pip install -e .`"
    )
