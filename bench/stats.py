"""Statistics for the benchmarks' figures: percentiles and a one-line latency summary."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe_ms(values_ns: Sequence[float]) -> str:
    ms = [v / 1e6 for v in values_ns]
    return (f"n={len(ms)} p50 {percentile(ms, 50):.2f} p90 {percentile(ms, 90):.2f} p99 {percentile(ms, 99):.2f} "
            f"max {max(ms):.2f} mean {statistics.fmean(ms):.2f} ms")
