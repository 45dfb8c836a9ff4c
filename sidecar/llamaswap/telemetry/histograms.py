"""Histograms kept as plain numbers, handed to the readers as the SDK's own data points.

Why: an OpenTelemetry SDK `Histogram.record` costs about 5 us (a Measurement, attribute
cleaning, a storage lookup per reader, a lock); a request records four. Here a record is a
bucket index (`bisect`, as the SDK finds it), a few additions under one lock: about 0.5 us.

How the readers get them, through public API only: the SDK's collection gives a `MetricsData`
(public dataclasses); `HistogramView.merge` adds one `Metric` of `Histogram` data per histogram
that has a series, in the meter's scope, with the points the SDK's explicit-bucket aggregation
would have written for the same records:

- cumulative (the admin `GET /metrics`, and OTLP by default): every series' counts, sum, min and
  max since its first record, which is its start time;
- delta (an OTLP exporter asked for it, `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`): each
  view keeps its own window per series, emptied by each collection; a series with no record
  since the last collection has no point; a point starts at the previous collection of its
  histogram (or at its series' first record before any), as the SDK's delta points do.

`HistogramExporter` wraps a push exporter so that its `PeriodicExportingMetricReader` hands it the
merged data; it gives the reader the temporalities it was made with (`environment.otlp_temporality`,
the OTLP exporter's table), so the SDK's own instruments keep the temporality the exporter alone
would have asked for. The admin page's reader merges a cumulative view (`prometheus.py`). A reader
made elsewhere (given to `Telemetry` as it is) sees no histograms.

Exponential buckets (an OTLP exporter asking for them through
`OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION`) only the SDK computes: then, and only
then, each record also goes to an SDK histogram (`Histograms.mirror`) that this exporter reads and
every other reader drops.

Threads: records run on the event loop, collections on the exporter's thread; one lock keeps a
series' buckets, count and sum consistent with each other.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from opentelemetry.metrics import Histogram as ApiHistogram
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import Aggregation, DropAggregation, ExponentialBucketHistogramAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

Temporalities = dict[type, AggregationTemporality]
# A reader of the plain histograms drops the SDK's (there are some only for an exponential exporter).
SDK_HISTOGRAMS_DROPPED: dict[type, Aggregation] = {HistogramInstrument: DropAggregation()}


class _Window:
    """A series' records since a point in time: counts per bucket, count, sum, min, max."""

    __slots__ = ("buckets", "count", "high", "low", "total")

    def __init__(self, size: int) -> None:
        self.reset(size)

    def reset(self, size: int) -> None:
        self.buckets = [0] * size
        self.count = 0
        self.total: float = 0
        self.low = math.inf
        self.high = -math.inf


class _Series:
    """One attribute set of a histogram: its lifetime window and one window per delta view."""

    __slots__ = ("attributes", "created_ns", "windows")

    def __init__(self, attributes: dict[str, str], size: int, windows: int) -> None:
        self.attributes = attributes
        self.created_ns = time.time_ns()
        self.windows = tuple(_Window(size) for _ in range(windows))


class PlainHistogram:
    """A histogram with fixed bucket bounds and fixed label names; `record` takes the label
    values in that order."""

    def __init__(self, owner: Histograms, name: str, *, unit: str, description: str, bounds: Sequence[float],
                 labels: Sequence[str]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)  # as given: an int bound is written `le="1"`, as the SDK wrote it
        # Searched as floats (exact for these bounds): float against float compares faster than against an int.
        self._search = tuple(float(bound) for bound in self.bounds)
        self.labels = tuple(labels)
        self._owner = owner
        self._lock = owner.lock
        self._series: dict[tuple[str, ...], _Series] = {}
        self.sdk: ApiHistogram | None = None  # (only for an exporter that asks for exponential buckets)

    def record(self, value: float, *label_values: str) -> None:
        series = self._series.get(label_values)
        if series is None:
            series = self._add(label_values)
        if self.sdk is not None:
            self.sdk.record(value, series.attributes)
        index = bisect_left(self._search, value)  # (previous bound, bound]: the SDK's buckets
        lock = self._lock
        lock.acquire()  # (not `with`: that costs about 0.1 us more per record)
        try:
            for window in series.windows:
                window.buckets[index] += 1
                window.count += 1
                window.total += value
                if value < window.low:
                    window.low = value
                if value > window.high:
                    window.high = value
        finally:
            lock.release()

    def _add(self, label_values: tuple[str, ...]) -> _Series:
        if len(label_values) != len(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}, got {label_values}")
        owner = self._owner
        with owner.lock:
            series = _Series(dict(zip(self.labels, label_values)), len(self.bounds) + 1, owner.windows)
            self._series[label_values] = series
        return series

    def series(self) -> list[_Series]:
        """Every series (call with the owner's lock held)."""
        return list(self._series.values())


class Histograms:
    """Every plain histogram of one meter (``scope``, on ``resource``), and the views that read them."""

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self.resource = resource
        self.scope = scope
        self.lock = threading.Lock()
        self.windows = 1  # the lifetime window, and one per delta view
        self._histograms: list[PlainHistogram] = []
        self.exponential = False  # an exporter asks for the SDK's exponential histograms

    def histogram(self, name: str, *, unit: str = "", description: str = "", bounds: Sequence[float],
                  labels: Sequence[str]) -> PlainHistogram:
        histogram = PlainHistogram(self, name, unit=unit, description=description, bounds=bounds, labels=labels)
        self._histograms.append(histogram)
        return histogram

    def mirror(self, meter: Meter) -> None:
        """Where an exporter asks for exponential buckets (which only the SDK computes), every
        histogram is also recorded into an SDK histogram: that exporter reads those, every other
        reader drops them (`SDK_HISTOGRAMS_DROPPED`) and reads the plain ones."""
        if not self.exponential:
            return
        for histogram in self._histograms:
            histogram.sdk = meter.create_histogram(histogram.name, unit=histogram.unit,
                                                   description=histogram.description,
                                                   explicit_bucket_boundaries_advisory=histogram.bounds)

    def view(self, temporality: AggregationTemporality) -> HistogramView:
        """A reader's view; a delta view takes a window of its own in every series, so views are
        made before the first record."""
        if temporality is AggregationTemporality.CUMULATIVE:
            return HistogramView(self, 0)
        with self.lock:
            if any(histogram.series() for histogram in self._histograms):
                raise RuntimeError("a delta view must be made before the first record")
            window, self.windows = self.windows, self.windows + 1
        return HistogramView(self, window)

    def histograms(self) -> list[PlainHistogram]:
        return list(self._histograms)


class HistogramView:
    """What one reader sees of the plain histograms: cumulative (window 0) or its own delta
    window."""

    def __init__(self, histograms: Histograms, window: int) -> None:
        self._histograms = histograms
        self._window = window
        self.temporality = AggregationTemporality.DELTA if window else AggregationTemporality.CUMULATIVE
        self._collected_ns: dict[str, int] = {}  # (delta) by histogram: its previous collection

    def metrics(self) -> list[Metric]:
        """The histograms with a point to report now, as the SDK writes them."""
        now_ns = time.time_ns()
        metrics = []
        owner = self._histograms
        for histogram in owner.histograms():
            with owner.lock:
                points = [point for series in histogram.series() if (point := self._point(histogram, series, now_ns))]
            if self._window and histogram.series():
                self._collected_ns[histogram.name] = now_ns
            if points:
                metrics.append(Metric(name=histogram.name, description=histogram.description, unit=histogram.unit,
                                      data=Histogram(data_points=points, aggregation_temporality=self.temporality)))
        return metrics

    def _point(self, histogram: PlainHistogram, series: _Series, now_ns: int) -> HistogramDataPoint | None:
        window = series.windows[self._window]
        if not window.count:
            return None
        if self._window:  # delta: from the previous collection, and the window starts again after it
            start_ns = self._collected_ns.get(histogram.name) or series.created_ns
        else:
            start_ns = series.created_ns
        point = HistogramDataPoint(attributes=dict(series.attributes), start_time_unix_nano=start_ns,
                                   time_unix_nano=now_ns, count=window.count, sum=window.total,
                                   bucket_counts=tuple(window.buckets), explicit_bounds=histogram.bounds,
                                   min=window.low, max=window.high, exemplars=[])
        if self._window:
            window.reset(len(window.buckets))
        return point

    def merge(self, data: MetricsData | None) -> MetricsData | None:
        """``data`` with the histograms added to their scope's metrics (the scope and the resource
        are added where the SDK had nothing to report)."""
        metrics = self.metrics()
        if not metrics:
            return data
        owner = self._histograms
        resource_metrics = list(data.resource_metrics) if data is not None else []
        if not resource_metrics:
            resource_metrics = [ResourceMetrics(resource=owner.resource, scope_metrics=[],
                                                schema_url=owner.resource.schema_url)]
        first = resource_metrics[0]
        scopes = list(first.scope_metrics)
        for index, scope_metrics in enumerate(scopes):
            if scope_metrics.scope == owner.scope:
                scopes[index] = ScopeMetrics(scope=scope_metrics.scope, metrics=[*scope_metrics.metrics, *metrics],
                                             schema_url=scope_metrics.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(scope=owner.scope, metrics=metrics, schema_url=owner.scope.schema_url or ""))
        resource_metrics[0] = ResourceMetrics(resource=first.resource, scope_metrics=scopes,
                                              schema_url=first.schema_url)
        return MetricsData(resource_metrics=resource_metrics)


class HistogramExporter(MetricExporter):
    """A push exporter whose exports carry the plain histograms too. ``temporality`` is what the
    wrapped exporter asks for (its reader reads it from here); the histograms follow its
    `Histogram` entry. With ``exponential`` the exporter gets the SDK's exponential histograms of
    the same records instead (`Histograms.mirror`)."""

    def __init__(self, exporter: MetricExporter, temporality: Temporalities, histograms: Histograms | None, *,
                 exponential: bool = False) -> None:
        super().__init__(preferred_temporality=temporality, preferred_aggregation=(
            {HistogramInstrument: ExponentialBucketHistogramAggregation()} if exponential else SDK_HISTOGRAMS_DROPPED))
        self.exporter = exporter
        self.histogram_temporality = temporality.get(HistogramInstrument, AggregationTemporality.CUMULATIVE)
        self._view = None
        if histograms is not None and exponential:
            histograms.exponential = True
        elif histograms is not None:
            self._view = histograms.view(self.histogram_temporality)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if self._view is not None:
            merged = self._view.merge(metrics_data)
            if merged is not None:
                metrics_data = merged
        return self.exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.exporter.shutdown(timeout_millis=timeout_millis, **kwargs)
