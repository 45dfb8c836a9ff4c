"""The sidecar's activity log as bench/batches.py reads it: a run's records of one side's lines,
the handoff between lines, and the most lines at once by the sidecar's own account."""

from __future__ import annotations

import bisect
import json
import pathlib
import statistics
from typing import Any


def activity(log_path: pathlib.Path, offset: int, prefix: str) -> list[dict[str, Any]]:
    """The sidecar's activity records (its log's `"event":"request"` lines written from `offset`
    on) whose request id starts with `prefix`."""
    with open(log_path, "rb") as log:
        log.seek(offset)
        data = log.read()
    records = []
    for raw in data.splitlines():
        if raw.startswith(b'{"event":"request"'):
            record = json.loads(raw)
            if record["request_id"].startswith(prefix) and record.get("granted_unix_ms") is not None:
                records.append(record)
    return records


def handoffs(records: list[dict[str, Any]]) -> tuple[float | None, float]:
    """From the lines' activity records: the median time from the latest end of a line to the
    next line's arrival at the sidecar (what the sender takes to send the next: with at most
    SLOTS lines at once a slot waits that long), and the sum of the lines' granted times (ms)."""
    ends = sorted(record["granted_unix_ms"] + record["run_ms"] for record in records)
    gaps = []
    for record in records:
        arrival = record["arrival_unix_ms"]
        latest = bisect.bisect_right(ends, arrival)
        if latest:
            gaps.append(arrival - ends[latest - 1])
    return (statistics.median(gaps) if gaps else None), sum(record["run_ms"] for record in records)


def most_at_once(records: list[dict[str, Any]], limit: int) -> tuple[int, float, int]:
    """By the sidecar's own account (each line from its arrival to the end of its exchange, as the
    access log reported it), exactly: the most lines at once, and how long (ms) and how many times
    there were more than `limit`."""
    events = sorted([(record["arrival_unix_ms"], 1) for record in records] +
                    [(record["granted_unix_ms"] + record["run_ms"], -1) for record in records],
                    key=lambda event: (event[0], event[1]))  # an end before an arrival at the same instant
    most = depth = times = 0
    over_ms = 0.0
    since = 0.0
    for at, step in events:
        depth += step
        most = max(most, depth)
        if step > 0 and depth == limit + 1:
            since = at
            times += 1
        elif step < 0 and depth == limit:
            over_ms += at - since
    return most, over_ms, times
