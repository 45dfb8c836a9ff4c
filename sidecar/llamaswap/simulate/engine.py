"""Replay requests through the real scheduler in virtual time. No I/O.

Records and a Policy in; what happened to each request and the metrics out. The loop is
event-driven over a :class:`ManualClock`: it jumps to the next arrival, GPU release, patience
deadline or ``maxWaitSeconds`` expiry (``next_deadline_ns``), whichever comes first. Events at
the same instant go: the GPU's release, expiries, clients leaving, arrivals (then clients with
no patience at all), and last the grant, so a request arriving as the GPU frees up competes
for it, and a client whose patience ends at that instant is gone.

How each request behaves:

- it arrives at its recorded time (relative to the first arrival; microsecond resolution, as
  recorded) with its recorded priority and model; a ``QueueFull`` is a rejection;
- granted, it holds the GPU for its recorded run time plus its settle time. When the simulated
  order changes whether its grant needs a model load (recorded ``swap or load`` against the
  simulated decision's), its model's measured swap cost is added or taken away;
- a request that never ran (a client that left, an expiry, a rejection) runs, if granted, until
  the runtime expects its grant to end (`estimate.grant_end_s`: its model's expected run, sized by
  its ``max_tokens`` where given, after its own load or the load it was granted beside);
- ``cancelled_waiting`` clients leave after their recorded wait unless granted by then; every
  other client waits as long as the simulated ``maxWaitSeconds`` lets it;
- a granted request ends as it did in reality if it ran then (served, upstream_error, ...), else
  it is served; its release tells the scheduler whether the model stays loaded by the
  runtime's own rule, ``core.model_stays_loaded`` (not after an upstream error; unchanged by a
  4xx, except that a load no grant confirmed is then not known to have happened; still loaded
  after a client left mid-run, the watchdog or a lapsed lease);
- ``rejected_unknown_model``, ``internal_error`` and ``shutdown`` records are not replayed;
- the replay starts with the model loaded that the recording's first grant found loaded (when
  the log records grant times and that grant was no load: a single-model upstream's model is
  loaded from the start); otherwise with nothing loaded.

Slots (the policy's `Slots`): up to that many grants run at once, as the scheduler grants them.
A grant's time is its solo time (the records given are solo: ``concurrency.as_solo``); while n
grants run, each progresses at speed(n) / n of that rate, where speed(n) is the aggregate
throughput of n concurrent generations relative to one (`ConcurrencySpeed`), so each running
grant's release moves whenever one starts or ends. Without a table, n generations run as fast
as one each. With one slot nothing changes.

GPUs (the policy's: `simulate --gpus N`, or those the log recorded grants on): one queue
over several GPUs, as the scheduler's node rule grants (`Scheduler.next` with the times the
runtime reads, `NodeTimes.of_grants` of the running grants: each one's `grant_end_s`, built as in
the runtime only when the rule asks). With one GPU the rule does not read them; one GPU is a
node of one. Each GPU has its own slots, loaded model, swaps and concurrency; the replay starts
each with the model its first recorded grant found loaded. The metrics give each GPU's swaps
and busy fraction. Costs are each GPU's own (`estimate.Figures` per (GPU, model), the
node's where it has none): a request that never ran takes its GPU's expected end, and a recorded
run replayed on another GPU than the one it ran on is scaled by the two GPUs' expected runs of its
model (its load swapped for this GPU's).

Stopping (``preempt``, issue 46): the records' Batch API lines (``batch_line``) are enqueued
stoppable. After each round of grants the replay takes the stops the scheduler ordered
(`Scheduler.stops`), ends each stopped line's hold there, keeps the work it did, releases it
keeping its place and sends it again at once, as the feeder does: granted again, it runs what it
had left (`stopping.py`). While requests wait, a line that has not yet run ``stop_min_run_s`` is
an event too: the instant it has (`Lines.ripe_at`).

Idle unloads (a GPU's `Residency.idle`: ``--idle-unload S``, ``models.<id>.ttl``): the next due
time is an event too; at it the due models are unloaded, after that instant's arrivals (a request
arriving then keeps its model) and before its grants (`idling.py`: every GPU taken as a router,
the unload instant, and the loads they cost later). Each is an eviction with the reason ``idle``.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set

from llamaswap.core import (
    NO_MODEL,
    Band,
    Estimator,
    EvictReason,
    ManualClock,
    Outcome,
    Policy,
    Priority,
    PrioritySource,
    QueueFull,
    ReorderCause,
    Scheduler,
    model_stays_loaded,
)
from llamaswap.core.estimate import Figures, grant_end_s
from llamaswap.core.estimate_node import NodeTimes, ends_of_grants
from llamaswap.simulate.concurrency import ConcurrencySpeed
from llamaswap.simulate.idling import IdleReplay
from llamaswap.simulate.inversion import worst_inversion
from llamaswap.simulate.records import RequestRecord
from llamaswap.simulate.running import NEVER, Apart, Gpu, Shared
from llamaswap.simulate.results import (
    BandMetrics,
    GpuMetrics,
    IdleMetrics,
    Metrics,
    Request,
    Result,
    Simulation,
    StopMetrics,
)
from llamaswap.simulate.stopping import GRACE_NS, Lines, index_of, one_per_line, part_id, retry_key

_log = logging.getLogger(__name__)

NOT_REPLAYED = frozenset({Outcome.REJECTED_UNKNOWN_MODEL, Outcome.INTERNAL_ERROR, Outcome.SHUTDOWN})
# Outcomes of a grant whose run the log measured: a granted replay ends the same way.
_RAN = frozenset({Outcome.SERVED, Outcome.CANCELLED_RUNNING, Outcome.UPSTREAM_ERROR, Outcome.WATCHDOG,
                  Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE, Outcome.STOPPED})

_NS_PER_US = 1_000
_NS_PER_MS = 1_000_000


def running_times(scheduler: Scheduler, now_ns: int, figures: Figures) -> NodeTimes:
    """What the runtime knows of each GPU's time at ``now_ns``: `NodeTimes.of_grants` of the
    scheduler's running grants, read only if the rule asks (this module's `NodeTimes`, looked up
    when called)."""
    return NodeTimes.of_grants(lambda: scheduler.running_grants, now_ns, figures)


@dataclasses.dataclass(frozen=True, slots=True)
class FixedCosts:
    """Stated costs (synthetic workloads), the same on every GPU, with defaults for models not
    listed: `estimate.Figures`, as a learnt `Estimator` is."""

    run_s: Mapping[str, float]
    swap_s: Mapping[str, float]
    default_run_s: float = 10.0
    default_swap_s: float = 0.0

    def expected_run_s(self, model: str | None, gpu: str | None = None) -> float:
        return self.run_s.get(model or NO_MODEL, self.default_run_s)

    def expected_request_run_s(self, model: str | None, max_tokens: int | None,
                               gpu: str | None = None) -> float:
        """A stated run is a request's whatever its size."""
        return self.expected_run_s(model, gpu)

    def expected_swap_s(self, model: str | None, gpu: str | None = None) -> float:
        return self.swap_s.get(model or NO_MODEL, self.default_swap_s)


def measure_costs(records: Iterable[RequestRecord], *, default_run_s: float, default_swap_s: float,
                  samples: int) -> Estimator:
    """The live estimator, taught every served grant in file order (the order they finished):
    it then holds the estimates the sidecar would have had at the end of the log: the node's, and
    each recorded GPU's own (run and swap per (GPU, model), as the sidecar keeps them).

    Only the records that can still show in its rolling windows are fed (per model, a suffix of
    its grants), which leaves the estimator in exactly the state that feeding all would.
    """
    estimator = Estimator(default_run_s=default_run_s, default_swap_s=default_swap_s, samples=samples)
    per_model: dict[str | None, list[RequestRecord]] = {}
    for record in records:
        # As the runtime learns: only generations; streamed first bytes time a load, else an
        # unstreamed load's run beyond its max_tokens does.
        if (record.outcome is Outcome.SERVED and record.dispatched and record.run_ms is not None
                and record.generation):
            per_model.setdefault(record.model or None, []).append(record)
    for grants in per_model.values():
        for record in grants[_first_needed(grants, samples):]:
            first_byte = record.first_byte_ms / 1000 if record.first_byte_ms is not None and record.streamed else None
            estimator.record(record.model, run_s=record.run_ms / 1000,  # type: ignore[operator]
                             first_byte_s=first_byte, model_load=record.model_load, max_tokens=record.max_tokens,
                             gpu=record.gpu)
    return estimator


def _first_needed(grants: Sequence[RequestRecord], samples: int) -> int:
    """The earliest of one model's grants that still matters to the estimator after all of them.

    The node's windows hold every grant, each GPU's its own. Every grant adds a run, so the
    last ``samples`` of each make its run window. A run learnt from a load subtracts the swap
    estimate of that moment (a GPU without its own: the node's), which comes from the last
    ``samples`` times to first byte of each kind (load, warm) before it; those before the earliest
    such load in any window, and the last ``samples`` of each kind overall (which come later), are
    all that can matter. Runs per token, and the swaps that unstreamed loads measure by them,
    chain through every earlier grant that said its `max_tokens`: a model with any is fed whole.
    """
    if any(grant.max_tokens for grant in grants):
        return 0
    keys: dict[str | None, list[int]] = {None: list(range(len(grants)))}
    for i, grant in enumerate(grants):
        if grant.gpu is not None:
            keys.setdefault(grant.gpu, []).append(i)
    start = until = len(grants)
    for indices in keys.values():
        window = indices[max(0, len(indices) - samples):]
        start = min([start, *window[:1]])
        until = min([until, *(i for i in window if grants[i].model_load)])
    for indices in keys.values():
        for kind in (True, False):
            timed = [i for i in indices
                     if i < until and grants[i].first_byte_ms is not None and grants[i].model_load is kind]
            if timed:
                start = min(start, timed[max(0, len(timed) - samples)])
    return start


def _ms_to_ns(ms: float) -> int:
    # Recorded times have 3 decimals (microseconds): rounding to them keeps sums exact.
    return round(ms * 1000) * _NS_PER_US


@dataclasses.dataclass(frozen=True, slots=True)
class Replay:
    requests: tuple[Request, ...]
    not_replayed: Mapping[str, int]  # outcome -> count
    origin_ms: float  # arrival_unix_ms of the first arrival


def prepare(records: Sequence[RequestRecord]) -> Replay:
    """Order by arrival (ties by file order) and drop what is not replayed; a line the runtime
    stopped is one request (`stopping.one_per_line`)."""
    records = one_per_line(records)
    skipped = Counter(r.outcome.value for r in records if r.outcome in NOT_REPLAYED)
    kept = sorted((r for r in records if r.outcome not in NOT_REPLAYED), key=operator.attrgetter("arrival_ms", "order"))
    origin = kept[0].arrival_ms if kept else 0.0
    priorities: dict[int, Priority] = {}
    requests = []
    for index, record in enumerate(kept):
        priority = priorities.get(record.priority)
        if priority is None:
            priority = priorities[record.priority] = Priority(record.priority, PrioritySource.NUMBER)
        # A dispatched cancelled_waiting was granted as its client left: nothing ran.
        ran = record.run_ms is not None and (record.outcome in _RAN or not record.dispatched)
        patience = None
        if record.outcome is Outcome.CANCELLED_WAITING and record.queue_wait_ms is not None:
            patience = _ms_to_ns(record.queue_wait_ms)
        # The runtime's rule for what its release tells the scheduler; a request that did not run
        # then is served in the replay, leaving its model loaded.
        model_loaded = model_stays_loaded(record.outcome, record.status) if record.outcome in _RAN else True
        requests.append(Request(
            index=index,
            record=record,
            arrival_ns=_ms_to_ns(record.arrival_ms - origin),
            priority=priority,
            patience_ns=patience,
            run_ns=_ms_to_ns(record.run_ms) if ran and record.run_ms is not None else None,
            settle_ns=_ms_to_ns(record.settle_ms) if ran else 0,
            recorded_load=record.model_load if record.dispatched else False,
            granted_outcome=record.outcome if ran and record.outcome in _RAN else Outcome.SERVED,
            model_loaded=model_loaded,
        ))
    return Replay(tuple(requests), dict(skipped), origin)


def simulate(replay: Replay, policy: Policy, costs: Figures, *,
             concurrency_speed: ConcurrencySpeed | None = None, preempt: bool = False,
             idle_gpus: Set[str] | None = None) -> Simulation:
    """``preempt``: the records' Batch API lines (``batch_line``) are enqueued stoppable, and the
    replay stops and resends those the scheduler orders stopped (`stopping.py`). ``idle_gpus``:
    the GPUs whose upstream can unload an idle model (None: every one, `idling.py`)."""
    requests = replay.requests
    clock = ManualClock(0)
    scheduler = Scheduler(policy, clock)
    names = scheduler.gpus
    # The replay starts with what the recording started with: a first recorded grant that did
    # not load its model found it loaded (a single-model upstream's one model always is), per
    # GPU where the log names them (replayed on one GPU, every recorded grant ran on it).
    # Records without a grant time (older logs, synthetic workloads) start from nothing loaded.
    for name in names:
        first = min((r for r in requests if r.record.dispatched and r.record.granted_ms is not None
                     and (len(names) == 1 or r.record.gpu == name)),
                    key=lambda r: (r.record.granted_ms, r.index), default=None)
        if first is not None and not first.recorded_load and first.record.model is not None:
            scheduler.set_residents(frozenset((first.record.model,)), as_of=scheduler.dispatches_on(name),
                                    gpu=name)
    ids = [str(r.index) for r in requests]
    entries = [r.record.settings_of(policy.model_priorities) for r in requests]  # their models.<id>
    results = [Result(r, Outcome.SERVED, policy.base_priority(r.priority.value, entry))
               for r, entry in zip(requests, entries, strict=True)]
    # The loop runs once per event: everything it reads per request or per model is looked up
    # here once (a handful of models, so the costs are asked once each).
    arrivals = [r.arrival_ns for r in requests] + [NEVER]
    # Each GPU's own figures where the log has them (else the node's), keyed (GPU, model);
    # also those of the GPUs the log recorded, which a recorded run is converted from.
    models = {r.record.model for r in requests}
    replayed_gpus = {*names, *(r.record.gpu for r in requests if r.run_ns is not None)}
    run_ns = {(u, m): round(costs.expected_run_s(m, u) * 1e9) for u in replayed_gpus for m in models}
    swap_ns = {(u, m): round(costs.expected_swap_s(m, u) * 1e9) for u in replayed_gpus for m in models}
    patience: list[tuple[int, int]] = []  # (deadline, index); entries of the granted are skipped
    reorders = Counter[ReorderCause]()
    evictions = Counter[EvictReason]()
    swaps = peak = waiting = granted = 0
    last_release = 0
    # Per GPU, the running grants (one per busy slot, sharing that GPU by the concurrency
    # speed), its swaps and how long it was held.
    shared = concurrency_speed is not None and not all(gpu.slots.single for gpu in policy.gpus)
    gpus = [Gpu(name, Shared(concurrency_speed) if shared and concurrency_speed is not None else Apart())
            for name in names]
    gpu_of = {gpu.name: gpu for gpu in gpus}
    release_at = NEVER
    lines = Lines() if preempt else None  # the Batch API lines stopped and resumed
    min_run = policy.stop_min_run_ns
    ripe_at = NEVER  # when a running line first reaches its minimum run while others wait
    arrival = 0
    enqueue, cancel, grant = scheduler.enqueue, scheduler.cancel, scheduler.next
    # What the runtime knows of each GPU's time (`running_times`): one, told before each next that
    # what it read may be stale, rather than one built per next (most find every slot busy).
    times = NodeTimes(lambda: ends_of_grants(scheduler.running_grants, clock.now_ns(), costs), costs)
    next_deadline = scheduler.next_deadline_ns
    expiring = policy.max_wait_ns > 0  # without maxWaitSeconds nothing expires: no need to ask
    idle = IdleReplay(scheduler, policy, names, idle_gpus)
    idle_at = NEVER  # the next idle unload (`idle.on`: some model may have one)
    heappush, heappop = heapq.heappush, heapq.heappop
    expiry: int | None = None

    while True:
        now = arrivals[arrival]
        if release_at < now:
            now = release_at
        if ripe_at < now:
            now = ripe_at
        if idle_at < now:
            now = idle_at
        if patience and patience[0][0] < now:
            now = patience[0][0]
        if expiring:
            expiry = next_deadline()
            if expiry is not None and expiry < now:
                now = expiry
        if now == NEVER:
            break
        clock.set_ns(now)

        if release_at == now:
            for gpu in gpus:
                running = gpu.running
                if running.release_at != now:
                    continue
                for index in running.finish(now):
                    released = results[index]
                    # (A resumed line's running part has its own id.)
                    scheduler.release(part_id(index, released.stops) if released.stops else ids[index],
                                      model_loaded=released.request.model_loaded)
                    released.release_ns = last_release = now
                    if lines is not None:
                        lines.ended(index)
                if running.release_at == NEVER:  # (nothing runs there now)
                    gpu.busy_ns += now - gpu.busy_since
            release_at = min(gpu.running.release_at for gpu in gpus)
        if expiry is not None and expiry <= now:
            for expired in scheduler.expire_overdue():
                result = results[index_of(expired.request_id)]
                result.outcome = Outcome.EXPIRED
                if result.start_ns is None:
                    result.end_ns = expired.removed_ns
                else:  # a stopped line, waiting to resume: it ends there
                    result.release_ns = expired.removed_ns
                    lines.ended(result.request.index)  # type: ignore[union-attr]
                waiting -= 1
        for round_ in (0, 1):  # clients leaving, arrivals, then clients that had no patience at all
            while patience and patience[0][0] <= now:
                index = heappop(patience)[1]
                # (A stopped line waits again under its part's id: a patience ending then leaves it be.)
                removed = cancel(ids[index])
                if removed is not None:
                    result = results[index]
                    result.outcome = Outcome.CANCELLED_WAITING
                    result.end_ns = removed.removed_ns
                    waiting -= 1
            if round_:
                break
            while arrivals[arrival] == now:
                request = requests[arrival]
                try:
                    enqueue(ids[arrival], request.priority, request.record.model,
                            priority_model=entries[arrival], max_tokens=request.record.max_tokens,
                            stoppable=preempt and request.record.batch_line)
                except QueueFull:
                    result = results[arrival]
                    result.outcome = Outcome.REJECTED_FULL
                    result.end_ns = now
                else:
                    waiting += 1
                    if waiting > peak:
                        peak = waiting
                    if request.patience_ns is not None:
                        heappush(patience, (now + request.patience_ns, arrival))
                arrival += 1
        if idle_at <= now:
            evictions[EvictReason.IDLE] += idle.unload_due(now)

        while True:
            while waiting:
                # (Built only if the rule asks: it reads time only to choose among GPUs.)
                times.forget()  # (the instant or the running grants may have changed)
                decision = grant(times=times)
                if decision is None:
                    break  # every slot it may use is busy (with one slot: a grant runs)
                waiting -= 1
                index = int(decision.request_id) if lines is None else index_of(decision.request_id)
                result = results[index]
                request = result.request
                model = request.record.model
                load = decision.model_load
                on = decision.gpu
                swap = swap_ns[on, model]
                if lines is not None and lines.resumes(index):  # a stopped line's next part
                    hold = lines.resumed(index, now, _work_ns(request, on, run_ns, swap_ns, costs), swap if load else 0,
                                         request.settle_ns if request.run_ns is not None else 0)
                    result.part_start_ns = now
                else:
                    if request.run_ns is not None:
                        hold = request.run_ns
                        was = request.record.gpu
                        if run_ns[was, model] != run_ns[on, model] or swap_ns[was, model] != swap:
                            # Recorded on another GPU: its run at this GPU's pace, with this GPU's load.
                            work = max(0, hold - swap_ns[was, model]) if request.recorded_load else hold
                            if run_ns[was, model] > 0:
                                work = round(work * run_ns[on, model] / run_ns[was, model])
                            hold = work + swap if load else work
                        elif load is not request.recorded_load:
                            hold = hold + swap if load else max(0, hold - swap)
                        hold += request.settle_ns
                    else:  # never recorded: as long as the runtime expects the grant to take
                        hold = round(grant_end_s(costs, decision) * 1e9)
                    if lines is not None and request.record.batch_line:
                        lines.started(index, now, hold, request.settle_ns if request.run_ns is not None else 0,
                                      _work_ns(request, on, run_ns, swap_ns, costs))
                    result.outcome = request.granted_outcome
                    result.start_ns = result.end_ns = now
                    result.model_load = load
                    result.gpu = decision.gpu
                    result.grant = granted
                    result.evicted = tuple(eviction.model for eviction in decision.evicts)
                granted += 1
                swaps += load
                if idle.on:
                    idle.granted(decision)
                if decision.reordered_by:
                    for cause in decision.reordered_by:
                        reorders[cause] += 1
                for eviction in decision.evicts:  # several resident: the models its grant unloaded
                    evictions[eviction.reason] += 1
                gpu = gpu_of[decision.gpu]
                gpu.swaps += load
                if not gpu.running:
                    gpu.busy_since = now
                gpu.running.start(now, request.index, hold)
                if gpu.running.release_at < release_at:
                    release_at = gpu.running.release_at
            if lines is None:
                break
            stops = scheduler.stops()  # ordered by the `next` that found nothing to start
            if not stops:
                break
            for stop in stops:  # the feeder stops each line and sends it again at once
                index = index_of(stop.request_id)
                result = results[index]
                gpu = gpu_of[stop.gpu]
                lines.stopped(stop, result, now, gpu.running.stop(now, index))
                if not gpu.running:
                    gpu.busy_ns += now - gpu.busy_since
                scheduler.release(stop.request_id, keep_as=retry_key(index), grace_ns=GRACE_NS)
                if _resend(scheduler, result, part_id(index, result.stops), entries[index], now):
                    waiting += 1
                else:
                    lines.ended(index)
            release_at = min(gpu.running.release_at for gpu in gpus)
        if lines is not None and min_run:
            # A line not yet stoppable may be stopped once it has run its minimum: ask again then.
            ripe_at = lines.ripe_at(now, min_run) if waiting else NEVER
        if idle.on:
            idle_at = idle.next_at(now)

    metrics = _metrics(results, swaps, reorders, gpus, last_release, peak, evictions,
                       lines.metrics() if lines is not None else None, idle.metrics(last_release))
    _log.debug("simulated %d requests with %s: %d swaps", len(requests), policy.name, swaps)
    return Simulation(policy, results, metrics)


def quantile(ordered: Sequence[int], fraction: float) -> int:
    """Nearest rank: the smallest value with at least ``fraction`` of the values at or below it."""
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def _work_ns(request: Request, on: str, run_ns: Mapping[tuple[str | None, str | None], int],
             swap_ns: Mapping[tuple[str | None, str | None], int], costs: Figures) -> int:
    """A request's work on GPU ``on``: its run without its load or settle (a recorded run at this
    GPU's pace, as a grant's hold takes it; else the run the runtime expects)."""
    model = request.record.model
    if request.run_ns is None:
        return round(costs.expected_request_run_s(model, request.record.max_tokens, on) * 1e9)
    was = request.record.gpu
    work = max(0, request.run_ns - swap_ns[was, model]) if request.recorded_load else request.run_ns
    if run_ns[was, model] != run_ns[on, model] and run_ns[was, model] > 0:
        work = round(work * run_ns[on, model] / run_ns[was, model])
    return work


def _resend(scheduler: Scheduler, result: Result, request_id: str, entry: str | None, now: int) -> bool:
    """Send a stopped line again under ``request_id``, to take its kept place back (its first
    arrival and order). False where the queue refuses it (its place was not kept: it waited
    maxWaitSeconds, and the queue is full): the line ends there, rejected."""
    request = result.request
    try:
        queued = scheduler.enqueue(request_id, request.priority, request.record.model, priority_model=entry,
                                   max_tokens=request.record.max_tokens, retry_key=retry_key(request.index),
                                   stoppable=True)
    except QueueFull:
        scheduler.expire_kept()
        result.outcome = Outcome.REJECTED_FULL
        result.release_ns = now
        return False
    if queued.taken is None:
        scheduler.expire_kept()  # its place, kept past maxWaitSeconds, is not taken: drop it
    return True


def _metrics(results: list[Result], swaps: int, reorders: Counter[ReorderCause], gpus: Sequence[Gpu],
             last_release: int, peak: int, evictions: Counter[EvictReason], stops: StopMetrics | None,
             idle: IdleMetrics) -> Metrics:
    waits: dict[Band, list[int]] = {band: [] for band in Band}
    outcomes = Counter[Outcome]()
    for result in results:
        if result.start_ns is not None:
            waits[result.request.priority.band].append(result.start_ns - result.request.arrival_ns)
        else:
            outcomes[result.outcome] += 1
    bands = {}
    for band, values in waits.items():
        values.sort()
        if values:
            bands[band.value] = BandMetrics(len(values), quantile(values, 0.5) / 1e9, quantile(values, 0.95) / 1e9,
                                            values[-1] / 1e9)
        else:
            bands[band.value] = BandMetrics(0, None, None, None)
    per_gpu = {gpu.name: GpuMetrics(gpu.swaps, gpu.busy_ns / last_release if last_release > 0 else 0.0)
               for gpu in gpus}
    return Metrics(
        requests=len(results),
        bands=bands,
        swaps=swaps,
        reorders={cause.value: reorders[cause] for cause in ReorderCause},
        # Of the node: the mean of its GPUs'.
        busy_fraction=sum(gpu.busy_fraction for gpu in per_gpu.values()) / len(per_gpu),
        left=outcomes[Outcome.CANCELLED_WAITING],
        expired=outcomes[Outcome.EXPIRED],
        rejected=outcomes[Outcome.REJECTED_FULL],
        peak_waiting=peak,
        inversion=worst_inversion(results),
        gpus=per_gpu,
        evictions={reason.value: evictions[reason] for reason in EvictReason},
        stops=stops,
        idle=idle,
    )
