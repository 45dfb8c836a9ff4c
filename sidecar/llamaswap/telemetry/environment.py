"""Exporters and the resource from the standard OTEL_* environment variables.

- Spans are exported over OTLP only when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_ENDPOINT` is set; metrics are pushed only when
  `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set. With none
  set nothing is exported and nothing fails; the admin `GET /metrics` works either way.
- `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER`: `otlp` (default), `console`, or `none`.
- `OTEL_EXPORTER_OTLP_PROTOCOL` (and the per-signal variants): `grpc` (default) or
  `http/protobuf` (needs the optional `opentelemetry-exporter-otlp-proto-http`).
- Everything else — headers, timeouts, TLS, compression, `OTEL_BSP_*`,
  `OTEL_METRIC_EXPORT_INTERVAL`, `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_RESOURCE_ATTRIBUTES` — is
  read by the SDK and the exporters themselves.
- `OTEL_SERVICE_NAME` defaults to `llamaswap`.
- `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE` (`cumulative`, `delta`, `lowmemory`): read
  here by the OpenTelemetry specification's table, as the OTLP exporter reads it, and handed to
  the exporter's reader; the plain histograms (`histograms.py`) follow its histogram entry.
  `OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram`
  gives that exporter the SDK's exponential histograms (recorded besides the plain ones).

A misconfigured exporter is logged and left out: telemetry never stops the sidecar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from llamaswap.telemetry.histograms import HistogramExporter, Histograms, Temporalities

_log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "llamaswap"


def default_resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, with service.name `llamaswap` by default."""
    resource = Resource.create()
    name = resource.attributes.get(SERVICE_NAME)
    if not name or str(name).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _first(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def _protocol(env: Mapping[str, str], signal: str) -> str:
    return _first(env, f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL").lower() or "grpc"


def _exporter_names(env: Mapping[str, str], variable: str) -> list[str]:
    raw = env.get(variable, "").strip().lower()
    return [part.strip() for part in raw.split(",") if part.strip()] or ["otlp"]


def otlp_temporality(env: Mapping[str, str]) -> Temporalities:
    """The temporality per instrument kind an OTLP metric exporter asks for, from
    OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE (the specification's table; an unknown value
    is cumulative, and the exporter itself warns about it)."""
    preference = env.get("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "CUMULATIVE").upper().strip()
    delta, cumulative = AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE
    synchronous = delta if preference in ("DELTA", "LOWMEMORY") else cumulative
    return {Counter: synchronous, UpDownCounter: cumulative, Histogram: synchronous,
            ObservableCounter: delta if preference == "DELTA" else cumulative,
            ObservableUpDownCounter: cumulative, ObservableGauge: cumulative}


def otlp_exponential(env: Mapping[str, str]) -> bool:
    """Whether an OTLP metric exporter asks for exponential histograms
    (OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION, read as the exporter reads it)."""
    return env.get("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION") == "base2_exponential_bucket_histogram"


def exporters_from_environment(env: Mapping[str, str] | None = None, histograms: Histograms | None = None,
                               ) -> tuple[list[SpanProcessor], list[MetricReader]]:
    """Span processors and metric readers; each metric reader's exports carry ``histograms``."""
    env = os.environ if env is None else env
    span_processors: list[SpanProcessor] = []
    metric_readers: list[MetricReader] = []
    traces_endpoint = _first(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    metrics_endpoint = _first(env, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

    for name in _exporter_names(env, "OTEL_TRACES_EXPORTER"):
        try:
            if name == "otlp" and traces_endpoint:
                span_processors.append(BatchSpanProcessor(_otlp_span_exporter(_protocol(env, "TRACES"))))
            elif name == "console":
                span_processors.append(BatchSpanProcessor(ConsoleSpanExporter()))
            elif name not in ("otlp", "none"):
                _log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); ignored", name)
        except Exception as exc:  # noqa: BLE001 - a bad setting must not stop the sidecar
            _log.error("span exporter %s could not be set up, spans are not exported: %s", name, exc)

    for name in _exporter_names(env, "OTEL_METRICS_EXPORTER"):
        try:
            if name == "otlp" and metrics_endpoint:
                # Interval and timeout: OTEL_METRIC_EXPORT_INTERVAL / _TIMEOUT, read by the reader.
                exporter = HistogramExporter(_otlp_metric_exporter(_protocol(env, "METRICS")), otlp_temporality(env),
                                             histograms, exponential=otlp_exponential(env))
                metric_readers.append(PeriodicExportingMetricReader(exporter))
            elif name == "console":  # (cumulative: the console exporter asks for nothing else)
                metric_readers.append(PeriodicExportingMetricReader(HistogramExporter(ConsoleMetricExporter(), {},
                                                                                      histograms)))
            elif name not in ("otlp", "none", "prometheus"):
                # `prometheus` is what the admin GET /metrics always serves.
                _log.warning("OTEL_METRICS_EXPORTER=%s is not supported (otlp, console, none); ignored", name)
        except Exception as exc:  # noqa: BLE001
            _log.error("metric exporter %s could not be set up, metrics are not pushed: %s", name, exc)

    if span_processors or metric_readers:
        _log.info("telemetry: exporting %s%s", "spans " if span_processors else "",
                  "metrics" if metric_readers else "")
    return span_processors, metric_readers


def _otlp_span_exporter(protocol: str):  # noqa: ANN202 - the exporter classes are optional imports
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        return HttpSpanExporter()
    raise ValueError(f"OTLP protocol {protocol!r} is not supported (grpc, http/protobuf)")


def _otlp_metric_exporter(protocol: str):  # noqa: ANN202
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        return HttpMetricExporter()
    raise ValueError(f"OTLP protocol {protocol!r} is not supported (grpc, http/protobuf)")
