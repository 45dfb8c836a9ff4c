"""The plain histograms (telemetry/histograms.py) export what the SDK's own histogram would.

Oracle: the OpenTelemetry SDK itself. The same records go to an SDK Histogram (its explicit-bucket
aggregation, read by an InMemoryMetricReader of the same temporality) and to a PlainHistogram;
after each collection both are encoded by the OTLP encoder and must be the same protobuf, times
aside; the times must follow the same rule for both. Then the real wiring: `Telemetry.from_environment`
pushing over OTLP/gRPC to a receiver here, in each temporality, against the admin /metrics text.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricsData,
)
from opentelemetry.sdk.resources import Resource

from llamaswap import __version__
from llamaswap.telemetry import Telemetry
from llamaswap.telemetry import instruments as names
from llamaswap.telemetry import environment
from llamaswap.telemetry.environment import otlp_exponential, otlp_temporality
from llamaswap.telemetry.histograms import Histograms
from llamaswap.telemetry.observer import INSTRUMENTATION_NAME, SCOPE
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument

NAME = "h_seconds"
BOUNDS = (0.5, 1, 2.5)
# Per collection: the records before it (value, band). Values on the bounds, below the first and
# above the last; sums of these binary fractions are exact whatever the order of addition.
SCRIPT: list[list[tuple[float, str]]] = [
    [(0.25, "a"), (0.5, "a"), (1, "a"), (3.0, "b"), (2.5, "a")],
    [(0.75, "b"), (10.0, "c"), (0.5, "b")],
    [],  # nothing recorded: a delta collection has no point, a cumulative one the same as before
    [(1.5, "a"), (0.125, "c")],
]
DELTA, CUMULATIVE = AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE
OTLP_TEMPORALITY = {DELTA: metrics_pb2.AGGREGATION_TEMPORALITY_DELTA,
                    CUMULATIVE: metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE}


def histogram_protos(data: MetricsData | None, name: str) -> list[metrics_pb2.Metric]:
    """The named metric, as the OTLP exporter encodes it (points in attribute order)."""
    if data is None:
        return []
    found = []
    for resource_metrics in encode_metrics(data).resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    assert scope_metrics.scope.name == INSTRUMENTATION_NAME
                    assert scope_metrics.scope.version == __version__
                    metric = metrics_pb2.Metric.FromString(metric.SerializeToString())
                    points = sorted(metric.histogram.data_points, key=lambda p: str(p.attributes))
                    del metric.histogram.data_points[:]
                    metric.histogram.data_points.extend(points)
                    found.append(metric)
    return found


def without_times(metric: metrics_pb2.Metric) -> metrics_pb2.Metric:
    copy = metrics_pb2.Metric.FromString(metric.SerializeToString())
    for point in copy.histogram.data_points:
        point.start_time_unix_nano = 0
        point.time_unix_nano = 0
    return copy


def band_of(point: metrics_pb2.HistogramDataPoint) -> str:
    return {kv.key: kv.value.string_value for kv in point.attributes}["band"]


class TimeRule:
    """Checks a histogram's point times against the SDK's rule, from the clock around each step."""

    def __init__(self, temporality: AggregationTemporality) -> None:
        self.temporality = temporality
        self.first_record: dict[str, tuple[int, int]] = {}  # band -> the step it first recorded in
        self.collections: list[tuple[int, int]] = []
        self.recorded = False  # the histogram had a record before the previous collection

    def check(self, metric: metrics_pb2.Metric, records: tuple[int, int], collection: tuple[int, int],
              bands: set[str]) -> None:
        for point in metric.histogram.data_points:
            band = band_of(point)
            assert collection[0] <= point.time_unix_nano <= collection[1]
            if self.temporality is DELTA and self.recorded:  # from the previous collection
                low, high = self.collections[-1]
            else:  # from the series' first record
                low, high = self.first_record[band]
            assert low <= point.start_time_unix_nano <= high, (band, self.temporality)


def test_points_are_the_sdks_in_both_temporalities() -> None:
    for temporality in (CUMULATIVE, DELTA):
        resource = Resource({"service.name": "test"})
        reader = InMemoryMetricReader(preferred_temporality={HistogramInstrument: temporality})
        sdk = MeterProvider(resource=resource, metric_readers=[reader]).get_meter(INSTRUMENTATION_NAME, __version__)
        reference = sdk.create_histogram(NAME, unit="s", description="A test histogram.",
                                         explicit_bucket_boundaries_advisory=BOUNDS)
        histograms = Histograms(resource, SCOPE)
        view = histograms.view(temporality)
        plain = histograms.histogram(NAME, unit="s", description="A test histogram.", bounds=BOUNDS, labels=("band",))
        rules = {"sdk": TimeRule(temporality), "plain": TimeRule(temporality)}
        recorded_bands: set[str] = set()
        for step, records in enumerate(SCRIPT):
            before = time.time_ns()
            for value, band in records:
                reference.record(value, {"band": band})
                plain.record(value, band)
                for rule in rules.values():
                    rule.first_record.setdefault(band, (before, time.time_ns()))
            recorded_bands |= {band for _, band in records}
            collected = time.time_ns()
            expected = histogram_protos(reader.get_metrics_data(), NAME)
            ours = histogram_protos(view.merge(None), NAME)
            done = time.time_ns()
            assert [without_times(m) for m in ours] == [without_times(m) for m in expected], (temporality, step)
            if temporality is DELTA and not records:
                assert ours == []  # no record since the last collection: no point, no metric
            else:
                (metric,) = ours
                assert metric.unit == "s" and metric.description == "A test histogram."
                assert metric.histogram.aggregation_temporality == OTLP_TEMPORALITY[temporality]
                assert list(metric.histogram.data_points[0].explicit_bounds) == list(BOUNDS)
                shown = {band_of(p) for p in metric.histogram.data_points}
                assert shown == (recorded_bands if temporality is CUMULATIVE else {b for _, b in records})
            for name, data in (("sdk", expected), ("plain", ours)):
                for metric in data:
                    rules[name].check(metric, (before, collected), (collected, done), recorded_bands)
            for rule in rules.values():
                rule.collections.append((collected, done))
                rule.recorded = rule.recorded or bool(recorded_bands)


def test_counts_by_hand() -> None:
    """Not only the same as the SDK: right (bucket upper bounds inclusive, as Prometheus reads them)."""
    histograms = Histograms(Resource({}), SCOPE)
    view = histograms.view(CUMULATIVE)
    plain = histograms.histogram(NAME, bounds=BOUNDS, labels=("band",))
    for value in (0.25, 0.5, 1, 2.5, 3.0):
        plain.record(value, "a")
    ((metric,),) = [scope.metrics for scope in view.merge(None).resource_metrics[0].scope_metrics]
    (point,) = metric.data.data_points
    assert point.bucket_counts == (2, 1, 1, 1)
    assert (point.count, point.sum, point.min, point.max) == (5, 7.25, 0.25, 3.0)
    assert point.attributes == {"band": "a"}
    with pytest.raises(ValueError, match="labels"):
        plain.record(1.0, "a", "b")


@pytest.mark.parametrize("bounds", [names.QUEUE_WAIT_BUCKETS, names.RUN_BUCKETS, names.SWAP_BUCKETS,
                                    names.ESTIMATE_RATIO_BUCKETS, BOUNDS])
def test_the_bucket_is_the_one_of_the_bounds_as_given(bounds: tuple[float, ...]) -> None:
    """A record searches the bounds as floats: on a bound (int or float), just below or above it,
    and an int value, it lands where a search of the bounds as given puts it."""
    values = [value for bound in bounds for value in (bound, math.nextafter(bound, -math.inf),
                                                      math.nextafter(bound, math.inf), math.floor(bound))]
    for value in [*values, 0, -1.0, 10**6]:
        histograms = Histograms(Resource({}), SCOPE)
        view = histograms.view(CUMULATIVE)
        histograms.histogram(NAME, bounds=bounds, labels=()).record(value)
        ((metric,),) = [scope.metrics for scope in view.merge(None).resource_metrics[0].scope_metrics]
        (point,) = metric.data.data_points
        expected = [0] * (len(bounds) + 1)
        expected[bisect.bisect_left(bounds, value)] = 1
        assert point.bucket_counts == tuple(expected), value
        assert point.explicit_bounds == bounds  # (written as given: `le="1"` for an int bound)


def test_a_delta_view_is_made_before_the_first_record() -> None:
    histograms = Histograms(Resource({}), SCOPE)
    histograms.histogram(NAME, bounds=BOUNDS, labels=()).record(1.0)
    histograms.view(CUMULATIVE)
    with pytest.raises(RuntimeError, match="before the first record"):
        histograms.view(DELTA)


@contextlib.contextmanager
def _otlp_exporter_with(monkeypatch: pytest.MonkeyPatch, variable: str, value: str | None) -> Iterator[Any]:
    """An OTLP metric exporter made with ``variable`` set to ``value`` (None: unset)."""
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    exporter = OTLPMetricExporter(endpoint="http://127.0.0.1:1")
    try:
        yield exporter
    finally:
        exporter.shutdown(timeout_millis=100)


@pytest.mark.parametrize("preference", [None, "delta", "LowMemory", "cumulative", "sideways"])
def test_temporality_table_is_the_otlp_exporters(monkeypatch: pytest.MonkeyPatch, preference: str | None) -> None:
    """What the exporter alone would ask its reader for (its private table, read here only to pin ours)."""
    with _otlp_exporter_with(monkeypatch, "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference) as exporter:
        assert otlp_temporality(os.environ) == exporter._preferred_temporality


@pytest.mark.parametrize("aggregation", [None, "base2_exponential_bucket_histogram",
                                         "BASE2_EXPONENTIAL_BUCKET_HISTOGRAM", "explicit_bucket_histogram"])
def test_exponential_is_read_as_the_otlp_exporter_reads_it(monkeypatch: pytest.MonkeyPatch,
                                                           aggregation: str | None) -> None:
    with _otlp_exporter_with(monkeypatch, "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
                             aggregation) as exporter:
        asked = type(exporter._preferred_aggregation[HistogramInstrument]).__name__
        assert otlp_exponential(os.environ) == (asked == "ExponentialBucketHistogramAggregation"), asked


# -- the real wiring, over OTLP/gRPC -----------------------------------------------------------


class _Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        with self.lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def metrics(self, name: str) -> list[metrics_pb2.Metric]:
        with self.lock:
            requests = list(self.requests)
        return [metric for request in requests for resource in request.resource_metrics
                for scope in resource.scope_metrics for metric in scope.metrics if metric.name == name]


@contextlib.contextmanager
def receiver() -> Iterator[tuple[_Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Receiver()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)


def text_histogram(text: str, name: str) -> dict[tuple[str, str], float]:
    """(labels, suffix) -> value of a histogram family in the Prometheus text."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_"):
            series, value = line.rsplit(" ", 1)
            samples[(series.split("{")[0].removeprefix(name), series.partition("{")[2])] = float(value)
    return samples


def as_text(points: list[metrics_pb2.HistogramDataPoint], name: str) -> dict[tuple[str, str], float]:
    """The text the admin page writes for these (cumulative) points."""
    samples = {}
    for point in points:
        labels = ",".join(f'{kv.key}="{kv.value.string_value}"' for kv in sorted(point.attributes, key=lambda a: a.key))
        cumulative = 0
        for bound, count in zip([*point.explicit_bounds, "+Inf"], point.bucket_counts):
            cumulative += count
            le = bound if isinstance(bound, str) else repr(bound) if bound != int(bound) else str(int(bound))
            samples[("_bucket", f'{labels},le="{le}"}}')] = cumulative
        samples[("_sum", f"{labels}}}")] = point.sum
        samples[("_count", f"{labels}}}")] = point.count
    return samples


@pytest.mark.parametrize("preference", ["cumulative", "delta"])
def test_otlp_push_carries_the_pages_histograms(monkeypatch: pytest.MonkeyPatch, preference: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with receiver() as (servicer, endpoint):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")  # exports on force_flush only
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
        telemetry = Telemetry.from_environment()
        temporality = DELTA if preference == "delta" else CUMULATIVE
        wait = telemetry.instruments.queue_wait
        try:
            totals: dict[str, list[float]] = {}  # band -> summed bucket counts over the exports
            for step, records in enumerate(SCRIPT):
                for value, band in records:
                    wait.record(value, band)
                assert telemetry.meter_provider.force_flush(timeout_millis=5000)
                pushed = servicer.metrics(names.QUEUE_WAIT)
                if temporality is DELTA and not records:
                    assert len(pushed) == step  # nothing recorded: not in this export
                    continue
                latest = pushed[-1]
                assert latest.WhichOneof("data") == "histogram"
                assert latest.unit == "s"
                assert latest.histogram.aggregation_temporality == OTLP_TEMPORALITY[temporality]
                assert list(latest.histogram.data_points[0].explicit_bounds) == list(names.QUEUE_WAIT_BUCKETS)
                if temporality is DELTA:
                    for point in latest.histogram.data_points:
                        total = totals.setdefault(band_of(point), [0] * (len(point.bucket_counts) + 2))
                        for index, count in enumerate([*point.bucket_counts, point.count, point.sum]):
                            total[index] += count
                    assert sum(p.count for p in latest.histogram.data_points) == len(records)
                else:
                    page = text_histogram(telemetry.prometheus_text()[0].decode(), names.QUEUE_WAIT)
                    assert as_text(list(latest.histogram.data_points), names.QUEUE_WAIT) == page
            if temporality is DELTA:  # the deltas add up to the page's cumulative counts
                page = text_histogram(telemetry.prometheus_text()[0].decode(), names.QUEUE_WAIT)
                summed = []
                for band, total in totals.items():
                    point = metrics_pb2.HistogramDataPoint(bucket_counts=total[:-2], count=int(total[-2]),
                                                           sum=total[-1], explicit_bounds=names.QUEUE_WAIT_BUCKETS)
                    point.attributes.add(key="band").value.string_value = band
                    summed.append(point)
                assert as_text(summed, names.QUEUE_WAIT) == page
            # The SDK's own instruments keep the temporality the exporter asks for (a Tally is an
            # ObservableCounter: delta under `delta`).
            (dispatched, *_) = servicer.metrics(names.DISPATCHED)
            assert dispatched.sum.aggregation_temporality == OTLP_TEMPORALITY[temporality]
        finally:
            telemetry.shutdown(timeout_s=5)


@pytest.mark.parametrize("preference", ["cumulative", "delta"])
def test_an_exporter_that_asks_for_exponential_histograms_gets_them(monkeypatch: pytest.MonkeyPatch,
                                                                   preference: str) -> None:
    """The SDK's exponential histograms of the same records, to that exporter alone: the admin page
    and a console exporter beside it keep the explicit buckets, once."""
    with receiver() as (servicer, endpoint):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
                           "base2_exponential_bucket_histogram")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp,console")
        console = io.StringIO()
        monkeypatch.setattr(environment, "ConsoleMetricExporter", lambda: ConsoleMetricExporter(out=console))
        telemetry = Telemetry.from_environment()
        try:
            records = [value for step in SCRIPT for value, _ in step]
            for value in records:
                telemetry.instruments.run.record(value, "batch")
            assert telemetry.meter_provider.force_flush(timeout_millis=5000)
            (pushed,) = servicer.metrics(names.RUN)
            assert pushed.WhichOneof("data") == "exponential_histogram"
            assert pushed.unit == "s" and pushed.description == telemetry.instruments.run.description
            assert pushed.exponential_histogram.aggregation_temporality == OTLP_TEMPORALITY[
                DELTA if preference == "delta" else CUMULATIVE]
            (point,) = pushed.exponential_histogram.data_points
            assert (point.count, point.sum, point.min, point.max) == (len(records), sum(records), min(records),
                                                                      max(records))
            page = telemetry.prometheus_text()[0].decode()
            assert page.count(f"# TYPE {names.RUN} histogram") == 1
            assert page.count(f'{names.RUN}_count{{band="batch"}}') == 1
            printed = console.getvalue()
            assert printed.count(f'"name": "{names.RUN}"') == 1 and '"explicit_bounds"' in printed
            assert text_histogram(page, names.RUN)[("_count", 'band="batch"}')] == len(records)
            assert text_histogram(page, names.RUN)[("_bucket", 'band="batch",le="1"}')] == sum(v <= 1 for v in records)
        finally:
            telemetry.shutdown(timeout_s=5)
