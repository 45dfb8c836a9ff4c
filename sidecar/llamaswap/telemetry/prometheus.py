"""The pull side of the one MeterProvider: a MetricReader that renders Prometheus text.

Why not `opentelemetry-exporter-prometheus`: it pulls in `prometheus_client`, renames
metrics by its own rules (unit and `_total` suffixes, `target_info`), and registers
collectors in a process-global registry. The sidecar needs one thing — the same
instruments as the OTLP push, rendered as text format 0.0.4 with names exactly as they
are — which fits in this file and is exact by construction.

The histograms are not SDK instruments (`histograms.py`): `render` adds them, cumulative, to
what the SDK collected.

Naming: the instruments are created with their final Prometheus names (counters already end
in `_total`, seconds in `_seconds`), so the text here shows them verbatim; see
`llamaswap.telemetry.instruments` for why the OTLP names are the same.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    MetricReader,
    MetricsData,
    Sum,
)

from llamaswap.telemetry.histograms import SDK_HISTOGRAMS_DROPPED, HistogramView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_INVALID_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9_]")


class PrometheusTextReader(MetricReader):
    """Collects on demand (GET /metrics) and renders the result; cumulative temporality."""

    def __init__(self, histograms: HistogramView | None = None) -> None:
        # The default temporality: CUMULATIVE for every instrument. SDK histograms exist only for an
        # exponential exporter; this page shows the plain ones.
        super().__init__(preferred_aggregation=SDK_HISTOGRAMS_DROPPED)
        self._lock = threading.Lock()
        self._latest: MetricsData | None = None
        self._histograms = histograms

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._latest = metrics_data

    def render(self) -> bytes:
        """Collect now and return the text exposition."""
        with self._lock:
            self._latest = None
            self.collect()
            data, self._latest = self._latest, None
            if self._histograms is not None:
                data = self._histograms.merge(data)
        return render_text(data).encode("utf-8")

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def render_text(data: MetricsData | None) -> str:
    """Prometheus text format 0.0.4 for a MetricsData (families merged by name)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    if data is None:
        return ""
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                _add_metric(families, metric.name, metric.description or "", metric.data)
    lines: list[str] = []
    for name, (kind, help_text, samples) in families.items():
        lines.append(f"# HELP {name} {_escape_help(help_text)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n" if lines else ""


def _add_metric(families: dict[str, tuple[str, str, list[str]]], raw_name: str, help_text: str, data: Any) -> None:
    name = _metric_name(raw_name)
    if isinstance(data, Sum):
        if data.aggregation_temporality is not AggregationTemporality.CUMULATIVE:
            return  # a delta sum is not a Prometheus counter; this reader never asks for one
        if data.is_monotonic:
            if not name.endswith("_total"):
                name += "_total"
            kind = "counter"
        else:
            kind = "gauge"
        samples = [_sample(name, point.attributes, point.value) for point in data.data_points]
    elif isinstance(data, Gauge):
        kind = "gauge"
        samples = [_sample(name, point.attributes, point.value) for point in data.data_points]
    elif isinstance(data, Histogram):
        kind = "histogram"
        samples = []
        for point in data.data_points:
            cumulative = 0
            for bound, count in zip(point.explicit_bounds, point.bucket_counts):
                cumulative += count
                samples.append(_sample(f"{name}_bucket", point.attributes, cumulative, le=_format_value(bound)))
            samples.append(_sample(f"{name}_bucket", point.attributes, point.count, le="+Inf"))
            samples.append(_sample(f"{name}_sum", point.attributes, point.sum))
            samples.append(_sample(f"{name}_count", point.attributes, point.count))
    else:  # exponential histograms are not configured anywhere in llamaswap
        return
    family = families.setdefault(name, (kind, help_text, []))
    family[2].extend(samples)


def _sample(name: str, attributes: Mapping[str, Any] | None, value: float, **extra: str) -> str:
    labels = [(_label_name(key), _label_value(v)) for key, v in sorted((attributes or {}).items())]
    labels.extend(extra.items())
    if labels:
        body = ",".join(f'{key}="{_escape_label(text)}"' for key, text in labels)
        return f"{name}{{{body}}} {_format_value(value)}"
    return f"{name} {_format_value(value)}"


def _metric_name(name: str) -> str:
    cleaned = _INVALID_NAME.sub("_", name)
    return f"_{cleaned}" if cleaned[:1].isdigit() else cleaned


def _label_name(name: str) -> str:
    cleaned = _INVALID_LABEL.sub("_", name)
    return f"_{cleaned}" if cleaned[:1].isdigit() else cleaned


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_label_value(v) for v in value)
    return str(value)


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def gauge_family(name: str, help_text: str, samples: Iterable[tuple[Mapping[str, Any] | None, float]]) -> str:
    """One gauge family in the text format, as `render_text` writes it (for pages rendered
    without the SDK: the picker's)."""
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} gauge"]
    lines.extend(_sample(name, labels, value) for labels, value in samples)
    return "\n".join(lines) + "\n"


def metric_names(text: str) -> Iterable[str]:
    """The family names declared in a text exposition (for tests and checks)."""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            yield line.split()[2]
