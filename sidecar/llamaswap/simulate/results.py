"""What a simulation produced: each request as replayed and what it did, the metrics of a run,
its worst priority inversion. The engine makes them; the report and the inversion read them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llamaswap.core import Outcome, Policy, Priority
from llamaswap.simulate.records import RequestRecord


@dataclasses.dataclass(slots=True)  # not frozen: 100,000s are made, and a frozen init costs double
class Request:
    """A record made ready to replay (the same for every setting)."""

    index: int  # arrival order
    record: RequestRecord
    arrival_ns: int  # from the first arrival
    priority: Priority
    patience_ns: int | None  # None: waits as long as maxWaitSeconds lets it
    run_ns: int | None  # the recorded run; None: never ran, the expected run applies
    settle_ns: int
    recorded_load: bool
    granted_outcome: Outcome
    model_loaded: bool | None  # what the release tells the scheduler (None: the answer said nothing)


@dataclasses.dataclass(slots=True)
class Result:
    """What one request did in the simulation."""

    request: Request
    outcome: Outcome
    base: int  # the priority the scheduler ordered by (fifo: plus the model's)
    start_ns: int | None = None  # granted
    end_ns: int = 0  # left the queue: granted, gave up, expired or rejected
    release_ns: int | None = None
    model_load: bool = False
    gpu: str | None = None  # the GPU its grant ran on
    grant: int | None = None  # its place in the replay's order of grants (0: the first)
    evicted: tuple[str, ...] = ()  # the resident models its grant unloaded to make room
    # A Batch API line stopped (`--preempt`): how often, the parts it ran before its last, each
    # (grant, stop), and when its last part was granted (None: never stopped).
    stops: int = 0
    parts: list[tuple[int, int]] | None = None
    part_start_ns: int | None = None

    def held(self) -> list[tuple[int, int]]:
        """The times its grants held a GPU, each (grant, release): one, or a stopped line's parts."""
        if self.start_ns is None or self.release_ns is None:
            return []
        if not self.parts:
            return [(self.start_ns, self.release_ns)]
        last = self.part_start_ns if self.part_start_ns is not None else self.release_ns
        return [*self.parts, (last, self.release_ns)]

    @property
    def wait_ns(self) -> int:
        return self.end_ns - self.request.arrival_ns


@dataclasses.dataclass(frozen=True, slots=True)
class BandMetrics:
    served: int  # granted the GPU
    wait_p50_s: float | None  # arrival to grant, of those granted
    wait_p95_s: float | None
    wait_max_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class Inversion:
    request_id: str
    band: str
    priority: int
    seconds: float
    outcome: str


@dataclasses.dataclass(frozen=True, slots=True)
class GpuMetrics:
    """One upstream (GPU) of the node."""

    swaps: int  # grants on it that loaded a model
    busy_fraction: float  # held / (last release - first arrival)


@dataclasses.dataclass(frozen=True, slots=True)
class StopMetrics:
    """Batch API lines stopped for a higher band (`simulate --preempt`)."""

    total: int  # stops
    bands: Mapping[str, int]  # stops by the stopped line's band (every band, 0 where none)
    lines: int  # lines stopped at least once


@dataclasses.dataclass(frozen=True, slots=True)
class IdleGpuMetrics:
    """Idle unloads on one GPU (`idling.py`)."""

    unloads: int  # resident models unloaded for idleness
    reloads: int  # loads of a model there that one of them cost later
    freed_s: float  # model-seconds they kept models out of memory that would have stayed (`idling.py`)


@dataclasses.dataclass(frozen=True, slots=True)
class IdleMetrics:
    """Idle unloads (`simulate --idle-unload S`, `models.<id>.ttl`) and the loads they cost later."""

    unloads: int
    reloads: int
    freed_s: float
    gpus: Mapping[str, IdleGpuMetrics]  # per upstream, by name


@dataclasses.dataclass(frozen=True, slots=True)
class Metrics:
    requests: int
    bands: Mapping[str, BandMetrics]
    swaps: int  # grants that needed a model load (from nothing known, or a swap)
    reorders: Mapping[str, int]  # ReorderCause -> grants it changed
    busy_fraction: float  # GPU held / (last release - first arrival)
    left: int  # gave up waiting (patience)
    expired: int  # maxWaitSeconds
    rejected: int  # maxQueued
    peak_waiting: int
    inversion: Inversion | None
    gpus: Mapping[str, GpuMetrics] = dataclasses.field(default_factory=dict)  # per upstream, by name
    # Resident models its grants unloaded to make room (several resident), by reason (EvictReason).
    evictions: Mapping[str, int] = dataclasses.field(default_factory=dict)
    stops: StopMetrics | None = None  # None: stopping was off
    idle: IdleMetrics | None = None  # idle unloads (zeros where none can happen); None: not replayed


@dataclasses.dataclass(frozen=True, slots=True)
class Simulation:
    policy: Policy
    results: list[Result]  # arrival order
    metrics: Metrics
