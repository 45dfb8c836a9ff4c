"""Telemetry: spans and metrics from scheduling events (OpenTelemetry SDK).

`Telemetry` is an Observer of the coordinator. One MeterProvider serves both the OTLP push
(when an endpoint is configured through OTEL_* variables) and the admin `GET /metrics`
(Prometheus text format, always). See `observer.py` for the spans, `instruments.py` for the
metric names, `histograms.py` for the histograms (plain counts, merged into what the readers
collect) and `environment.py` for the settings.
"""

from llamaswap.telemetry.environment import default_resource, exporters_from_environment
from llamaswap.telemetry.observer import (
    EVICTED_EVENT,
    OVERTAKEN_BY_EVENT,
    OVERTOOK_EVENT,
    QUEUE_SPAN,
    RUN_SPAN,
    Telemetry,
    parent_of,
)
from llamaswap.telemetry.prometheus import CONTENT_TYPE, PrometheusTextReader, render_text

__all__ = [
    "CONTENT_TYPE",
    "EVICTED_EVENT",
    "OVERTAKEN_BY_EVENT",
    "OVERTOOK_EVENT",
    "PrometheusTextReader",
    "QUEUE_SPAN",
    "RUN_SPAN",
    "Telemetry",
    "default_resource",
    "exporters_from_environment",
    "parent_of",
    "render_text",
]
