"""How much concurrent generations slow each other down: the table, measured from a log. No I/O.

The model (continuous batching): while n generations of the loaded model run, each progresses
at ``speed(n) / n`` of the rate it has alone, where ``speed(n)`` is the aggregate throughput of
n relative to one (``ConcurrencySpeed``). A generation's *solo time*, the time it would take
alone, is then the sum over the levels n it ran at of (time at n) x speed(n) / n.

Measuring the table from an activity log (``measure``): every dispatched record holds a slot
from its grant (``granted_unix_ms``) for its run plus settle, which gives the number running
at every moment and so, for each generation, the time it spent at each level n. Each
generation's work is its ``max_tokens`` where the log has them for its model (the tokens it
asked for), else one unit per request. With ``rate_m`` the unknown solo seconds per unit of
work of model m and ``r_n = speed(n) / n`` (``r_1 = 1``), every generation gives one equation

    rate_m x work = sum over n of r_n x (time at n)

linear in the unknowns. They are solved by least squares with each generation weighted by
1 / its duration (its error grows with its length): for generations that all ran at one level
this is the time-weighted rate, total work / total time at that level, against the same at
one. Only served generations that loaded no model are equations (a load's time is not
work); every dispatched record counts towards how many ran. Noise-free records give the
table back exactly. Without two generations at once, or without runs that tell concurrency
apart from run length (nothing of a model ever ran alone, say), there is no measurement.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from llamaswap.core import Outcome
from llamaswap.simulate.records import RequestRecord

_US_PER_MS = 1000
_US_PER_S = 1_000_000
_ROUNDING_US = 1  # the log's times have 3 decimals of milliseconds, each rounded on its own


class ConcurrencySpeedError(ValueError):
    """A concurrency speed table that cannot be used."""


@dataclasses.dataclass(frozen=True, slots=True)
class ConcurrencySpeed:
    """Aggregate throughput of n concurrent generations relative to one (``{1: 1, 2: 1.8, 4: 3.1}``):
    linear between the points given, flat after the last (no more throughput than the highest
    level known); speed(1) is 1 by definition."""

    points: Mapping[int, float]

    def __post_init__(self) -> None:
        for count, speed in self.points.items():
            if not isinstance(count, int) or count < 1 or not (isinstance(speed, (int, float)) and speed > 0):
                raise ConcurrencySpeedError(
                    f"each point must be N:SPEED with N >= 1 and SPEED > 0, got {count}:{speed}")
            if count == 1 and speed != 1:
                raise ConcurrencySpeedError(f"the speed of 1 is 1 (throughput relative to one), got 1:{speed:g}")
        object.__setattr__(self, "points", {n: float(s) for n, s in sorted({1: 1.0, **self.points}.items())})

    @classmethod
    def parse(cls, text: str) -> ConcurrencySpeed:
        """``1:1,2:1.8,4:3.1``."""
        points: dict[int, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            count, sep, speed = part.partition(":")
            try:
                if not sep:
                    raise ValueError(part)
                points[int(count)] = float(speed)
            except ValueError:
                raise ConcurrencySpeedError(f"expected N:SPEED,... (e.g. 1:1,2:1.8,4:3.1), got {part!r}") from None
        if not points:
            raise ConcurrencySpeedError("expected N:SPEED,... (e.g. 1:1,2:1.8,4:3.1), got nothing")
        return cls(points)

    def of(self, count: int) -> float:
        below = max(n for n in self.points if n <= count)
        above = [n for n in self.points if n > count]
        if below == count or not above:
            return self.points[below]
        upper = min(above)
        low, high = self.points[below], self.points[upper]
        return low + (high - low) * (count - below) / (upper - below)

    def rate(self, count: int) -> float:
        """Each of ``count`` concurrent generations' progress per second, relative to alone."""
        return self.of(count) / count

    def __str__(self) -> str:
        return ",".join(f"{n}:{s:.3g}" for n, s in self.points.items())


# -- who ran when ----------------------------------------------------------------------------


def _interval_us(record: RequestRecord) -> tuple[int, int] | None:
    """The slot a dispatched record held, in microseconds of Unix time; None: not known."""
    if not record.dispatched or record.run_ms is None:
        return None
    granted = record.granted_ms
    if granted is None:
        if record.queue_wait_ms is None:
            return None  # a synthetic record: no grant was ever made
        granted = record.arrival_ms + record.queue_wait_ms
    start = round(granted * _US_PER_MS)
    return start, start + round((record.run_ms + record.settle_ms) * _US_PER_MS)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordedConcurrency:
    """For each dispatched record (by ``order``), the microseconds it ran at each level n."""

    exposure: Mapping[int, Mapping[int, int]]
    peak: int  # the most that ran at once

    @classmethod
    def of(cls, records: Iterable[RequestRecord]) -> RecordedConcurrency:
        """Per GPU (the record's; not recorded: one): generations on different GPUs do
        not share one."""
        by_gpu: dict[str | None, dict[int, tuple[int, int]]] = {}
        for record in records:
            interval = _interval_us(record)
            if interval is not None and interval[1] > interval[0]:
                by_gpu.setdefault(record.gpu, {})[record.order] = interval
        exposure: dict[int, Mapping[int, int]] = {}
        peak = 0
        for intervals in by_gpu.values():
            part = cls._of_one(intervals)
            exposure.update(part.exposure)
            peak = max(peak, part.peak)
        return cls(exposure, peak)

    @classmethod
    def _of_one(cls, intervals: Mapping[int, tuple[int, int]]) -> RecordedConcurrency:
        # The number running between consecutive grant and end times: a step function.
        changes: dict[int, int] = {}
        for start, end in intervals.values():
            changes[start] = changes.get(start, 0) + 1
            changes[end] = changes.get(end, 0) - 1
        times = sorted(changes)
        levels, running = [], 0
        for at in times:
            running += changes[at]
            levels.append(running)  # from times[i] until times[i + 1]
        # A step of a microsecond is the log's rounding (a grant made as another ended), not a
        # level that ran: it counts for nothing.
        peak = max((levels[i] for i in range(len(times) - 1) if times[i + 1] - times[i] > _ROUNDING_US), default=0)
        if peak <= 1:
            return cls({order: {1: end - start} for order, (start, end) in intervals.items()}, peak)
        exposure: dict[int, dict[int, int]] = {}
        for order, (start, end) in intervals.items():
            spent: dict[int, int] = {}
            i = bisect.bisect_right(times, start) - 1
            while times[i] < end:
                if times[i + 1] - times[i] > _ROUNDING_US:
                    level = levels[i]
                    spent[level] = spent.get(level, 0) + min(times[i + 1], end) - max(times[i], start)
                i += 1
            exposure[order] = spent
        return cls(exposure, peak)

    def solo_fraction(self, order: int, speed: ConcurrencySpeed) -> float:
        """The record's solo time over its recorded time (1 for a record not known here)."""
        spent = self.exposure.get(order)
        if not spent:
            return 1.0
        total = sum(spent.values())
        return sum(us * speed.rate(level) for level, us in spent.items()) / total

    def concurrent(self, order: int) -> bool:
        return any(level > 1 for level in self.exposure.get(order, ()))


def as_solo(records: Sequence[RequestRecord], recorded: RecordedConcurrency,
            speed: ConcurrencySpeed) -> list[RequestRecord]:
    """The records with each run and settle turned into solo time (microseconds, as recorded):
    what the replay scales again by the concurrency it simulates."""
    if recorded.peak <= 1:
        return list(records)
    solo = []
    for record in records:
        fraction = recorded.solo_fraction(record.order, speed) if recorded.concurrent(record.order) else 1.0
        if fraction == 1.0 or record.run_ms is None:
            solo.append(record)
        else:
            solo.append(dataclasses.replace(record, run_ms=round(record.run_ms * fraction, 3),
                                            settle_ms=round(record.settle_ms * fraction, 3)))
    return solo


# -- the measurement -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    speed: ConcurrencySpeed | None  # None: the log cannot tell (see why)
    generations: int  # the equations: served generations with a known grant that loaded no model
    concurrent: int  # of them, those that ran beside another for some time
    work: str  # what measured the work: "max_tokens", "requests" or "max_tokens and requests"
    why: str | None = None  # why there is no table
    unmeasured: tuple[int, ...] = ()  # levels seen whose estimate was not positive (left out)


def measure(records: Sequence[RequestRecord], recorded: RecordedConcurrency | None = None) -> Measurement:
    """The table that explains the recorded run times best (see the module's docstring)."""
    recorded = recorded if recorded is not None else RecordedConcurrency.of(records)
    usable = [r for r in records
              if r.outcome is Outcome.SERVED and r.generation and not r.model_load and any(
                  recorded.exposure.get(r.order, {}).values())]
    by_tokens = {r.model for r in usable if r.max_tokens}
    # A model whose requests say their size is measured in tokens, from those that say it.
    equations = [r for r in usable if r.model not in by_tokens or r.max_tokens]
    kinds = {"max_tokens" if r.model in by_tokens else "requests" for r in equations}
    work = " and ".join(sorted(kinds)) or "requests"
    concurrent = sum(1 for r in equations if recorded.concurrent(r.order))
    if not concurrent:
        return Measurement(None, len(equations), 0, work, "no two generations ran at once")
    models = sorted({r.model or "" for r in equations})
    levels = sorted({n for r in equations for n in recorded.exposure[r.order] if n > 1})
    column = {("model", m): i for i, m in enumerate(models)} | {
        ("level", n): len(models) + i for i, n in enumerate(levels)}
    size = len(column)
    normal = [[0.0] * size for _ in range(size)]
    right = [0.0] * size
    for record in equations:
        spent = recorded.exposure[record.order]
        weight = _US_PER_S / sum(spent.values())
        row = {column["model", record.model or ""]: float(record.max_tokens or 1)}
        for level, us in spent.items():
            if level > 1:
                row[column["level", level]] = -us / _US_PER_S
        alone = spent.get(1, 0) / _US_PER_S
        for i, x in row.items():
            right[i] += weight * x * alone
            for j, y in row.items():
                normal[i][j] += weight * x * y
    solution = _solve(normal, right)
    if solution is None:
        return Measurement(None, len(equations), concurrent, work,
                           "the concurrent runs cannot tell concurrency from run length (e.g. nothing ran alone)")
    points = {}
    unmeasured = []
    for n in levels:
        rate = solution[column["level", n]]
        if rate > 0:
            points[n] = rate * n
        else:
            unmeasured.append(n)
    if not points:
        return Measurement(None, len(equations), concurrent, work, "no level had a positive estimate",
                           tuple(unmeasured))
    return Measurement(ConcurrencySpeed(points), len(equations), concurrent, work, None, tuple(unmeasured))


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is singular."""
    size = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    scale = max((abs(a[i][i]) for i in range(size)), default=0.0)
    if scale == 0:
        return None
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / a[col][col]
            if factor:
                for c in range(col, size + 1):
                    a[r][c] -= factor * a[col][c]
    x = [0.0] * size
    for r in reversed(range(size)):
        x[r] = (a[r][size] - sum(a[r][c] * x[c] for c in range(r + 1, size))) / a[r][r]
    return x


# -- which table a simulation uses -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SpeedChoice:
    """The table in use and where it came from, for the report."""

    speed: ConcurrencySpeed | None  # None: linear, n at once run as fast as one each
    source: str  # "given", "measured" or "linear"
    detail: str

    @classmethod
    def choose(cls, given: ConcurrencySpeed | None, measurement: Measurement | None) -> SpeedChoice:
        """--concurrency-speed over the log's measurement over linear."""
        if given is not None:
            detail = "--concurrency-speed"
            if measurement is not None:
                detail += (f"; the log measured {measurement.speed} {_measured_detail(measurement)}"
                           if measurement.speed is not None else f"; the log measured nothing: {measurement.why}")
            return cls(given, "given", detail)
        if measurement is not None and measurement.speed is not None:
            return cls(measurement.speed, "measured", _measured_detail(measurement))
        why = measurement.why if measurement is not None else "synthetic runs take their drawn times"
        return cls(None, "linear", f"n at once run as fast as one each; {why}")

    def describe(self) -> str:
        if self.speed is None:
            return f"concurrency speed: linear ({self.detail})"
        return f"concurrency speed {self.speed} ({self.source} {self.detail})"

    def document(self) -> dict[str, object]:
        points = self.speed.points if self.speed is not None else {}
        return {"points": {str(n): round(s, 6) for n, s in points.items()}, "source": self.source,
                "detail": self.detail}


def _measured_detail(measurement: Measurement) -> str:
    text = (f"from {measurement.concurrent} concurrent of {measurement.generations} generations, "
            f"work in {measurement.work}")
    if measurement.unmeasured:
        text += f"; level(s) {', '.join(map(str, measurement.unmeasured))} not measurable"
    return text
