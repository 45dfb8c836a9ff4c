"""A Tally's counts by a series' key resolved once (`add_to`, the hot path's) are those of `add`
with the labels; the keys and label values resolved once per band and outcome are the labels'."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llamaswap.core import Band, Outcome
from llamaswap.telemetry.instruments import BAND_LABELS, BAND_SERIES, OUTCOME_SERIES, Tally, series_key


def counts(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict, int]]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {metric.name: [(dict(point.attributes), point.value) for point in metric.data.data_points]
            for scope in data.resource_metrics[0].scope_metrics for metric in scope.metrics}


def test_add_to_a_key_counts_as_add_with_its_labels() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    declared = [{"band": "interactive"}, {"band": "batch"}]
    by_labels = Tally(meter, "by_labels", unit="", description="", series=declared)
    by_key = Tally(meter, "by_key", unit="", description="", series=declared)
    plain_labels = Tally(meter, "plain_labels", unit="", description="")
    plain_key = Tally(meter, "plain_key", unit="", description="")
    for labels, amount in [({"band": "batch"}, 1), ({"band": "new"}, 2), ({"band": "batch"}, 3),
                           ({"band": "new", "reason": "aging"}, 1)]:
        by_labels.add(amount, labels)
        by_key.add_to(series_key(labels), amount)
    plain_labels.add(1)
    plain_key.add_to(series_key(None))
    plain_key.add_to(series_key({}), 2)
    plain_labels.add(2, {})
    seen = counts(reader)
    assert seen["by_key"] == seen["by_labels"] == [
        ({"band": "interactive"}, 0), ({"band": "batch"}, 4), ({"band": "new"}, 2),
        ({"band": "new", "reason": "aging"}, 1)]
    assert seen["plain_key"] == seen["plain_labels"] == [({}, 3)]


def test_the_keys_resolved_once_are_the_labels() -> None:
    assert BAND_LABELS == {band: band.value for band in Band}
    assert all(type(label) is str for label in BAND_LABELS.values())  # (never the member: it prints otherwise)
    assert BAND_SERIES == {band: series_key({"band": band.value}) for band in Band}
    assert OUTCOME_SERIES == {outcome: series_key({"outcome": outcome.value}) for outcome in Outcome}
    assert all(type(value) is str for key in [*BAND_SERIES.values(), *OUTCOME_SERIES.values()] for _, value in key)
