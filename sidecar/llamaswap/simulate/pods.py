"""Many nodes (issue 28): one workload over pods of several GPUs, routed three ways. No I/O.

Each pod is a llamaswap node: the real `Scheduler` over its GPUs (one upstream each), its one
queue over them. In front of the pods, the request is sent by one of:

- ``picker``: what an endpoint picker does with llamaswap's gauges (llm-d's router with the
  engine config the chart renders): among the pods whose queue is within ``AFFINITY_SLACK`` of
  the shortest, one that has the request's model loaded on a GPU first (the model/adapter
  affinity read from the loaded-model gauge), then the fewest requests waiting, then the fewest
  running, then the first;
- ``round-robin``: a Service spreading requests without knowing them;
- ``one-queue``: no routing at all, one llamaswap queue over every GPU of every pod (what a
  single node with that many GPUs would do; the bound the routed ones are measured against).

Every request waits until it is granted (patience and max wait are the single-node simulator's
business, `engine.py`); a grant holds its GPU for its recorded run from its ready time (the one
its grant set, `Decision.ready_at`: once its own load, or the load it was granted beside, ends;
`estimate.grant_ready_s`); a request with no recorded run holds it as long as the runtime expects
its grant to take (`estimate.grant_end_s`). Each pod's rule reads the times the runtime reads
(`NodeTimes.of_grants`: its running grants' expected ends, built when the rule asks), never the
replay's own release times. Time is virtual (`ManualClock`), events in order: releases first, then
arrivals at the same instant, then grants.

Figures: interactive p95 wait (arrival to grant), swaps (grants that replaced a loaded model) and
loads from nothing, and "GPU idle while work waited": the share of all GPU time during which a
GPU ran nothing while a request it may serve waited somewhere in the cluster (in any pod's
queue: the price of routing a request to a queue that a free GPU elsewhere does not read).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import json
import math
from collections.abc import Sequence

from llamaswap.core import Band, ManualClock, Policy, Priority, PrioritySource, Scheduler
from llamaswap.core.estimate import Figures, grant_end_s, grant_ready_s
from llamaswap.core.policy import GpuPolicy
from llamaswap.simulate.engine import quantile, running_times
from llamaswap.simulate.records import RequestRecord

_NS_PER_MS = 1_000_000
# How many more waiting requests than the shortest queue a pod may have and still win by affinity.
AFFINITY_SLACK = 2
_NS_PER_S = 1_000_000_000


class Routing(enum.StrEnum):
    PICKER = "picker"
    ROUND_ROBIN = "round-robin"
    ONE_QUEUE = "one-queue"


@dataclasses.dataclass(frozen=True, slots=True)
class PodsResult:
    routing: Routing
    pods: int
    gpus: int  # per pod
    granted: int
    interactive_p95_wait_s: float | None  # None: no interactive request
    wait_p95_s: float | None
    swaps: int
    loads: int
    idle_while_waiting: float  # share of GPU time, 0..1


class _Pod:
    """One pod: its scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def queued(self) -> int:
        return self.scheduler.depth

    def running(self) -> int:
        return self.scheduler.slots_busy

    def has_loaded(self, model: str | None) -> bool:
        return any(gpu.has(model) for gpu in self.scheduler.holdings())


def simulate_pods(records: Sequence[RequestRecord], policy: Policy, costs: Figures, *, pods: int, gpus: int,
                  routing: Routing) -> PodsResult:
    """The records (in arrival order) over ``pods`` pods of ``gpus`` GPUs each, routed by ``routing``.
    ``policy``, of one GPU, gives the order and each GPU's slots."""
    if pods < 1 or gpus < 1:
        raise ValueError("pods and gpus must be at least 1")
    clock = ManualClock()
    groups = 1 if routing is Routing.ONE_QUEUE else pods
    per_group = gpus * pods // groups
    slots = policy.gpus[0].slots  # every GPU's (a policy of one GPU: the one of each pod)
    nodes = [_Pod(Scheduler(policy.with_gpus(tuple(GpuPolicy(f"gpu{index}", slots)
                                                    for index in range(per_group))), clock))
             for _ in range(groups)]
    ordered = sorted(records, key=lambda r: (r.arrival_ms, r.order))
    start_ms = ordered[0].arrival_ms if ordered else 0.0
    arrivals = [(round((r.arrival_ms - start_ms) * _NS_PER_MS), r) for r in ordered]
    releases: list[tuple[int, int, int, str, str]] = []  # (at, seq, pod, GPU, request)
    seq = itertools.count()
    arrived_ns: dict[str, int] = {}
    run_ns_of: dict[str, int | None] = {}  # each waiting request's recorded run (None: not recorded)
    interactive: dict[str, bool] = {}
    waits: list[int] = []
    interactive_waits: list[int] = []
    swaps = loads = 0
    idle_ns = 0
    total_gpus = groups * per_group
    turn = 0
    next_arrival = 0
    now = 0
    while next_arrival < len(arrivals) or releases:
        upcoming = min(arrivals[next_arrival][0] if next_arrival < len(arrivals) else math.inf,
                       releases[0][0] if releases else math.inf)
        at = int(upcoming)
        idle_ns += (at - now) * _idle_gpus_while_waiting(nodes)
        clock.advance((at - now) / _NS_PER_S)
        now = at
        while releases and releases[0][0] == now:
            _, _, index, gpu, request_id = heapq.heappop(releases)
            nodes[index].scheduler.release(request_id, model_loaded=True)
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] == now:
            record = arrivals[next_arrival][1]
            next_arrival += 1
            index = _route(nodes, record.model, routing, turn)
            turn += 1
            priority = Priority(record.priority, PrioritySource.NUMBER)
            nodes[index].scheduler.enqueue(record.request_id, priority, record.model, max_tokens=record.max_tokens)
            arrived_ns[record.request_id] = now
            interactive[record.request_id] = priority.band is Band.INTERACTIVE
            run_ns_of[record.request_id] = None if record.run_ms is None else round(record.run_ms * _NS_PER_MS)
        for index, node in enumerate(nodes):
            scheduler = node.scheduler
            # (Built only if the rule asks: it reads time only to choose among GPUs.)
            while (decision := scheduler.next(times=running_times(scheduler, now, costs))) is not None:
                hold = run_ns_of.pop(decision.request_id)
                if hold is None:  # never recorded: as long as the runtime expects the grant to take
                    hold = round(grant_end_s(costs, decision) * _NS_PER_S)
                else:  # a recorded run, once the grant is ready (its own load, or the one it went beside)
                    hold += round(grant_ready_s(costs, decision) * _NS_PER_S)
                if decision.model_load:
                    swaps += decision.swap
                    loads += decision.load
                end = now + max(hold, 1)
                heapq.heappush(releases, (end, next(seq), index, decision.gpu, decision.request_id))
                wait = now - arrived_ns.pop(decision.request_id)
                waits.append(wait)
                if interactive.pop(decision.request_id):
                    interactive_waits.append(wait)
    span = now * total_gpus
    return PodsResult(routing, pods, gpus, len(waits), _p95_s(interactive_waits), _p95_s(waits), swaps, loads,
                      idle_ns / span if span else 0.0)


def _route(nodes: Sequence[_Pod], model: str | None, routing: Routing, turn: int) -> int:
    if len(nodes) == 1:
        return 0
    if routing is Routing.ROUND_ROBIN:
        return turn % len(nodes)
    # Affinity among the pods whose queue is near the shortest (within AFFINITY_SLACK requests),
    # as the inference extension's adapter-affinity filter does; else the shortest queue.
    shortest = min(node.queued() for node in nodes)
    near = [i for i in range(len(nodes)) if nodes[i].queued() <= shortest + AFFINITY_SLACK]
    return min(near, key=lambda i: (not nodes[i].has_loaded(model), nodes[i].queued(), nodes[i].running(), i))


def _idle_gpus_while_waiting(nodes: Sequence[_Pod]) -> int:
    """GPUs that run nothing while some request they may serve waits (in any pod's queue)."""
    if not any(node.scheduler.depth for node in nodes):
        return 0
    return sum(1 for node in nodes for gpu in node.scheduler.holdings() if not gpu.running.busy)


def _p95_s(waits: list[int]) -> float | None:
    if not waits:
        return None
    return quantile(sorted(waits), 0.95) / _NS_PER_S


def render_pods_table(source: str, results: Sequence[PodsResult]) -> str:
    """One row per routing, the figures side by side."""
    first = results[0]
    lines = [f"{first.granted} requests from {source} over {first.pods} pods x {first.gpus} GPUs",
             f"{'routing':<12} {'interactive p95 wait':>21} {'all p95 wait':>13} {'swaps':>6} {'loads':>6} "
             f"{'GPU idle while work waited':>27}"]
    for result in results:
        lines.append(f"{result.routing.value:<12} {_seconds(result.interactive_p95_wait_s):>21} "
                     f"{_seconds(result.wait_p95_s):>13} {result.swaps:>6} {result.loads:>6} "
                     f"{result.idle_while_waiting * 100:>26.1f}%")
    lines.append("picker: least queued with model affinity (within 2 requests of the shortest queue); "
                 "one-queue: one llamaswap queue over every GPU (no routing)")
    return "\n".join(lines) + "\n"


def render_pods_json(source: str, results: Sequence[PodsResult]) -> str:
    rows = [{"routing": r.routing.value, "pods": r.pods, "gpus": r.gpus, "granted": r.granted,
             "interactive_p95_wait_s": r.interactive_p95_wait_s, "wait_p95_s": r.wait_p95_s, "swaps": r.swaps,
             "loads": r.loads, "gpu_idle_while_work_waited": r.idle_while_waiting} for r in results]
    return json.dumps({"source": source, "routings": rows}, indent=2) + "\n"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"
