"""A real OTLP/gRPC receiver for the tests: the trace and metrics services of opentelemetry-proto
on 127.0.0.1 with a port chosen by the OS.

Everything received is kept (decoded into plain Python values) so a test can poll for the
spans and metric points it expects; nothing is ever dropped or sampled here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def any_value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


@dataclasses.dataclass(frozen=True)
class SpanEvent:
    name: str
    time_unix_nano: int
    attributes: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    scope: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]
    events: tuple[SpanEvent, ...]
    status_code: int  # trace_pb2.Status.STATUS_CODE_*
    status_message: str

    @property
    def is_error(self) -> bool:
        return self.status_code == trace_pb2.Status.STATUS_CODE_ERROR


@dataclasses.dataclass(frozen=True)
class ReceivedPoint:
    service: str
    metric: str
    kind: str  # "gauge", "sum", "histogram", "exponential_histogram", "summary"
    unit: str
    monotonic: bool | None
    attributes: dict[str, Any]
    value: float | None  # gauge and sum points
    count: int | None  # histogram points
    time_unix_nano: int


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        self._receiver._add_spans(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802
        self._receiver._add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _Logs(logs_service_pb2_grpc.LogsServiceServicer):
    def Export(self, request, context):  # noqa: N802 - accepted and ignored
        return logs_service_pb2.ExportLogsServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC server (plaintext) that records spans and metric points."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._points: list[ReceivedPoint] = []
        self.trace_requests = 0
        self.metric_requests = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="otlp-receiver"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_Logs(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        if not self.port:
            raise OSError("the OTLP receiver could not bind 127.0.0.1:0")
        self._server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT and Envoy's tracer are given."""
        return f"http://{self.address}"

    def close(self) -> None:
        self._server.stop(grace=1.0).wait(5)

    # -- what arrived --------------------------------------------------------------------

    def spans(self, *, trace_id: str | None = None, name: str | None = None,
              service: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            spans = list(self._spans)
        return [s for s in spans
                if (trace_id is None or s.trace_id == trace_id) and (name is None or s.name == name)
                and (service is None or s.service == service)]

    def points(self, metric: str | None = None, *, service: str | None = None) -> list[ReceivedPoint]:
        with self._lock:
            points = list(self._points)
        return [p for p in points
                if (metric is None or p.metric == metric) and (service is None or p.service == service)]

    def metric_names(self, *, service: str | None = None) -> set[str]:
        return {p.metric for p in self.points(service=service)}

    def latest(self, metric: str, **labels: str) -> ReceivedPoint | None:
        """The most recent point of `metric` whose attributes include `labels`."""
        matching = [p for p in self.points(metric)
                    if all(p.attributes.get(key) == value for key, value in labels.items())]
        return max(matching, key=lambda p: p.time_unix_nano) if matching else None

    # -- decoding ------------------------------------------------------------------------

    def _add_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        decoded = []
        for resource_spans in request.resource_spans:
            service = str(attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(ReceivedSpan(
                        service=service,
                        scope=scope_spans.scope.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        start_time_unix_nano=span.start_time_unix_nano,
                        end_time_unix_nano=span.end_time_unix_nano,
                        attributes=attributes(span.attributes),
                        events=tuple(SpanEvent(e.name, e.time_unix_nano, attributes(e.attributes))
                                     for e in span.events),
                        status_code=span.status.code,
                        status_message=span.status.message,
                    ))
        with self._lock:
            self.trace_requests += 1
            self._spans.extend(decoded)

    def _add_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        decoded = []
        for resource_metrics in request.resource_metrics:
            service = str(attributes(resource_metrics.resource.attributes).get("service.name", ""))
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    decoded.extend(_points(service, metric))
        with self._lock:
            self.metric_requests += 1
            self._points.extend(decoded)


def _points(service: str, metric: metrics_pb2.Metric) -> Iterator[ReceivedPoint]:
    kind = metric.WhichOneof("data")
    if kind in ("gauge", "sum"):
        data = getattr(metric, kind)
        monotonic = data.is_monotonic if kind == "sum" else None
        for point in data.data_points:
            value = point.as_double if point.WhichOneof("value") == "as_double" else point.as_int
            yield ReceivedPoint(service, metric.name, kind, metric.unit, monotonic, attributes(point.attributes),
                                float(value), None, point.time_unix_nano)
    elif kind in ("histogram", "exponential_histogram", "summary"):
        for point in getattr(metric, kind).data_points:
            yield ReceivedPoint(service, metric.name, kind, metric.unit, None, attributes(point.attributes),
                                None, int(point.count), point.time_unix_nano)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()
