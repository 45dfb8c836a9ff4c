"""Estimated starts over a node (`estimate_node.starts_of_node`).

Two things (one upstream: test_estimate.py and test_estimate_grants.py): a few exact cases over
two upstreams; and the property that ties the walk to `Scheduler.next` over
two or three upstreams, as tests/test_estimate_grants.py does for one: a random queue is played
on a `ManualClock` against a real scheduler that reads its times from `NodeTimes` (as the
runtime does), every grant released exactly at its expected end (all ends of one instant
before the next grant, as the simulator does), and each request waiting at one instant must be
granted exactly when and where the estimate said.

What the property leaves out, and why: swap affinity (0: with a bonus the order over a node
moves with the models loaded, which a snapshot's order cannot say in advance); unloads,
failed releases and max_wait (as in test_estimate_grants.py). Settles are in: an upstream may
be blocked from before the instant until a known time after it. Grants made beside a load run
once it ends, which `NodeTimes` and the estimate read from the snapshot (`ready_at`, set at the
grant) also after the grant that loaded has ended.
"""

from __future__ import annotations

import dataclasses

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from policies import fifo, serial

from llamaswap.core import (
    Band,
    Estimator,
    ManualClock,
    Policy,
    PolicyName,
    Priority,
    PrioritySource,
    QueueSnapshot,
    RunningView,
    Scheduler,
    Slots,
    WaitingView,
)
from llamaswap.core.holding import GpuHolding
from llamaswap.core.estimate_node import NodeTimes, starts_of_node
from llamaswap.core.policy import GpuPolicy

MODELS = ("a", "b", "c")
NS = 1_000_000_000
BANDS = (Band.INTERACTIVE, Band.NORMAL, Band.BATCH)


# -- two upstreams, exact cases -------------------------------------------------------------


def _gpu(name: str, loaded: str | None = None, slots: int = 1, models: frozenset[str] | None = None) -> GpuHolding:
    return GpuHolding(name, Slots(slots), models, frozenset() if loaded is None else frozenset((loaded,)))


def _snapshot(waiting: list[str | None], grants: Sequence[tuple[str, str | None, float, bool]] = ()) -> QueueSnapshot:
    return QueueSnapshot(
        PolicyName.SERIAL,
        tuple(WaitingView(f"w{i}", i + 1, 0, Band.NORMAL, 0.0, False, 0.0, m) for i, m in enumerate(waiting)),
        {},
        tuple(RunningView(f"g{i}", 0, Band.NORMAL, 0.0, model, load, 0.0, running_s, gpu=upstream,
                          ready_at=(model, running_s) if load and model is not None else None)  # (its own load)
              for i, (upstream, model, running_s, load) in enumerate(grants)))


def test_two_idle_upstreams_start_two_models_at_once() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=4, samples=3)
    starts = starts_of_node(estimator, _snapshot(["x", "y", "x"]), [_gpu("gpu0"), _gpu("gpu1")])
    # x loads on gpu0, y on gpu1; the second x waits for gpu0 (free in 14 s, sooner than nothing).
    assert starts == [(0.0, "gpu0"), (0.0, "gpu1"), (14.0, "gpu0")]


def test_a_settle_on_one_upstream_sends_the_work_to_the_other() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=0, samples=3)
    gpus = [_gpu("gpu0", "x"), _gpu("gpu1", "x")]
    starts = starts_of_node(estimator, _snapshot(["x", "x", "x"]), gpus, {"gpu0": 25.0})
    assert starts == [(0.0, "gpu1"), (10.0, "gpu1"), (20.0, "gpu1")]
    assert starts_of_node(estimator, _snapshot(["x", "x", "x"]), gpus, {"gpu0": 15.0})[2] == (15.0, "gpu0")
    # Blocked for a time nobody said (an adopted exchange holds gpu0): gpu1 serves all three.
    blocked = [gpus[0]._replace(adopted=1, blocked=True), gpus[1]]
    assert starts_of_node(estimator, _snapshot(["x", "x", "x"]), blocked)[2] == (20.0, "gpu1")


def test_waiting_for_the_warm_upstream_beats_a_slow_load() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=30, samples=3)
    gpus = [_gpu("gpu0", "x"), _gpu("gpu1", "y")]
    snapshot = _snapshot(["x"], [("gpu0", "x", 4.0, False)])
    # gpu0 frees in 6 s, a load of x on the idle gpu1 takes 30: x waits for gpu0.
    assert starts_of_node(estimator, snapshot, gpus) == [(6.0, "gpu0")]
    quick = Estimator(default_run_s=10, default_swap_s=3, samples=3)
    assert starts_of_node(quick, snapshot, gpus) == [(0.0, "gpu1")]


def test_a_model_only_one_upstream_may_serve_waits_for_it() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=0, samples=3)
    gpus = [_gpu("small", "x", models=frozenset({"x"})), _gpu("big", "x")]
    snapshot = _snapshot(["big-model", "x"], [("big", "x", 2.0, False)])
    assert starts_of_node(estimator, snapshot, gpus) == [(8.0, "big"), (0.0, "small")]


def test_an_overdue_grant_leaves_its_upstream_unknown() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=0, samples=3)
    gpus = [_gpu("gpu0", "x", models=frozenset({"x"})), _gpu("gpu1", "y", models=frozenset({"y"}))]
    snapshot = _snapshot(["x", "y"], [("gpu0", "x", 30.0, False)])
    assert starts_of_node(estimator, snapshot, gpus) == [(math.inf, None), (0.0, "gpu1")]


def test_node_times_read_each_upstreams_grants() -> None:
    estimator = Estimator(default_run_s=10, default_swap_s=5, samples=3)
    snapshot = _snapshot([], [("gpu0", "x", 2.0, False), ("gpu0", "x", 7.0, False), ("gpu1", "y", 1.0, True)])
    # (A grant beside a load says so from its grant on: `Decision.ready_at`, the load's model
    # and how long ago it began; the estimates never guess it.)
    snapshot = dataclasses.replace(snapshot, grants=(*snapshot.grants, RunningView(
        "g3", 0, Band.NORMAL, 0.0, "y", False, 0.0, 0.5, gpu="gpu1", ready_at=("y", 1.0))))
    times = NodeTimes.of_snapshot(snapshot, estimator)
    assert (times.slot_free_in_s("gpu0"), times.drained_in_s("gpu0")) == (3.0, 8.0)
    # gpu1: a load under way (14 s left) and a grant beside it that runs after it.
    assert (times.slot_free_in_s("gpu1"), times.drained_in_s("gpu1")) == (14.0, 14.0)
    assert (times.slot_free_in_s("gpu2"), times.drained_in_s("gpu2"), times.swap_s("x", "gpu2")) == (0.0, 0.0, 5.0)
    # Granted beside a load of z 4 s ago, that grant gone: the load ends in 1 s, its 10 s run after.
    beside = QueueSnapshot(PolicyName.SERIAL, (), {}, (
        RunningView("g", 0, Band.NORMAL, 0.0, "z", False, 0.0, 3.0, gpu="gpu0", ready_at=("z", 4.0)),))
    assert NodeTimes.of_snapshot(beside, estimator).slot_free_in_s("gpu0") == 11.0
    overdue = NodeTimes.of_snapshot(_snapshot([], [("gpu0", "x", 12.0, False), ("gpu0", "x", 1.0, False)]), estimator)
    assert (overdue.slot_free_in_s("gpu0"), overdue.drained_in_s("gpu0")) == (9.0, math.inf)


# -- the property: estimates are the grants of a node ---------------------------------------


@dataclass(frozen=True)
class NodeCase:
    policy: Policy
    default_run_s: int
    swap_s: int
    learnt_runs: dict[str, int]
    arrivals: list[tuple[int, int, str | None]]  # (gap in seconds, priority, model)
    look_after_s: int
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # upstream -> (s before the look, s after)


@st.composite
def node_cases(draw: st.DrawFn) -> NodeCase:
    count = draw(st.integers(2, 3))
    gpus = []
    sizes = []
    for i in range(count):
        default = draw(st.integers(1, 2))
        per_model = draw(st.dictionaries(st.sampled_from(MODELS), st.integers(1, 3), max_size=2))
        models = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(MODELS), min_size=1)))
        gpus.append((f"gpu{i}", default, per_model, models))
        sizes.append(min([default, *per_model.values()]))
    reserved = draw(st.integers(0, min(sizes) - 1))  # node-wide, as `upstream.reservedSlots`
    if set().union(*(m for *_, m in gpus if m is not None)) != set(MODELS) and all(m is not None for *_, m in gpus):
        gpus[0] = (*gpus[0][:3], None)  # every model has an upstream that may serve it
    gpu_policies = tuple(GpuPolicy(name, Slots(default, per_model, reserved), models)
                          for name, default, per_model, models in gpus)
    if draw(st.booleans()):
        policy = serial(draw(st.sampled_from([0, 1, 7, 60])), 0)
    else:
        policy = fifo(draw(st.dictionaries(st.sampled_from(MODELS), st.sampled_from([-60, -10, 0, 10, 60]))))
    priority = st.one_of(st.sampled_from([-100, -60, -50, -49, -1, 0, 1, 10, 49, 50, 51, 60, 99, 100]),
                         st.integers(-3, 3))
    model = st.one_of(st.none(), st.sampled_from(MODELS), st.sampled_from(MODELS))
    # Arrivals closer than the runs: a queue builds over the node.
    arrivals = draw(st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 2]), priority, model), min_size=6, max_size=24))
    blocks = draw(st.dictionaries(st.sampled_from([name for name, *_ in gpus]),
                                  st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=1))
    return NodeCase(policy.with_gpus(gpu_policies), draw(st.integers(2, 5)), draw(st.sampled_from([0, 0, 3, 5])),
                    draw(st.dictionaries(st.sampled_from(MODELS), st.integers(2, 9))), arrivals,
                    draw(st.sampled_from([0, 0, 1, 3])), blocks)


def look_ns_of(case: NodeCase) -> int:
    """When the case looks at the queue: after its last arrival, and its ``look_after_s``."""
    return sum(gap for gap, _, _ in case.arrivals) * NS + case.look_after_s * NS


class NodePlay:
    """A node's scheduler and its grants, each released at its expected end; `next` reads
    its times from `NodeTimes`, the blocked upstreams from the case's settles."""

    def __init__(self, case: NodeCase, estimator: Estimator, look_ns: int) -> None:
        self.clock = ManualClock()
        self.scheduler = Scheduler(case.policy, self.clock)
        self.estimator = estimator
        self.blocks = {name: (max(0, look_ns - before * NS), look_ns + after * NS)
                       for name, (before, after) in case.blocks.items()}
        self.ends: list[tuple[int, str]] = []  # (end ns, request id): a heap
        self.ready_ns: dict[str, int] = {}  # per upstream: when its last load ends
        self.granted: dict[str, tuple[int, str]] = {}  # request -> (grant ns, upstream)

    def arrive(self, case: NodeCase) -> int:
        """Play the case's arrivals, then on to its instant of looking (returned)."""
        t_ns = 0
        for number, (gap_s, value, model) in enumerate(case.arrivals):
            t_ns += gap_s * NS
            self.run_until(t_ns)
            self.scheduler.enqueue(f"r{number}", Priority(value, PrioritySource.NUMBER), model)
        look_ns = look_ns_of(case)
        self.run_until(look_ns)
        return look_ns

    def blocked(self) -> frozenset[str]:
        now = self.clock.now_ns()
        return frozenset(name for name, (start, end) in self.blocks.items() if start <= now < end)

    def _next_event(self) -> int:
        now = self.clock.now_ns()
        bounds = [t for start, end in self.blocks.values() for t in (start, end) if t > now]
        return min([*bounds, *(self.ends[:1] and [self.ends[0][0]])], default=2**62)

    def run_until(self, t_ns: int) -> None:
        """Release and grant everything due up to and including ``t_ns``; the clock ends there."""
        while True:
            self.grant_all()
            when = self._next_event()
            if when > t_ns:
                break
            self.clock.set_ns(when)
            while self.ends and self.ends[0][0] == when:  # every end of the instant, then grants
                request_id = heapq.heappop(self.ends)[1]
                self.scheduler.release(request_id)
        self.clock.set_ns(t_ns)
        self.grant_all()

    def grant_all(self) -> None:
        while True:
            times = NodeTimes.of_snapshot(self.scheduler.snapshot(), self.estimator)
            cheap = NodeTimes.of_grants(lambda: self.scheduler.running_grants, self.clock.now_ns(), self.estimator)
            assert all((times.slot_free_in_s(u), times.drained_in_s(u))
                       == (cheap.slot_free_in_s(u), cheap.drained_in_s(u)) for u in self.scheduler.gpus)
            blocked = self.blocked()
            for name in self.scheduler.gpus:
                self.scheduler.blocked_by(name, settling=name in blocked, adopted=0)
            decision = self.scheduler.next(times)
            if decision is None:
                return
            now = self.clock.now_ns()
            upstream = decision.gpu
            if decision.model_load:
                self.ready_ns[upstream] = now + round(self.estimator.expected_swap_s(decision.model) * NS)
            ready = self.ready_ns.get(upstream, 0)
            run_ns = round(self.estimator.expected_request_run_s(decision.model, None) * NS)
            heapq.heappush(self.ends, (max(now, ready) + run_ns, decision.request_id))
            self.granted[decision.request_id] = (now, upstream)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node_cases())
def test_estimated_starts_over_a_node_are_the_grants(case: NodeCase) -> None:
    estimator = Estimator(default_run_s=case.default_run_s, default_swap_s=case.swap_s, samples=3)
    for model, run_s in case.learnt_runs.items():
        estimator.record(model, run_s=run_s, first_byte_s=None, model_load=False)
    play = NodePlay(case, estimator, look_ns_of(case))
    look_ns = play.arrive(case)

    snapshot = play.scheduler.snapshot()
    blocked_s = {name: (end - look_ns) / NS for name, (start, end) in play.blocks.items() if start <= look_ns < end}
    estimates = starts_of_node(estimator, snapshot, play.scheduler.holdings(), blocked_s)
    event(f"waiting at the instant: {min(len(snapshot.waiting), 4)}{'+' if len(snapshot.waiting) >= 4 else ''}")
    event(f"upstreams the estimates name: {len({u for _, u in estimates if u is not None})}")
    if blocked_s:
        event("a settle at the instant")
    expected = {view.request_id: (look_ns + round(start * NS), upstream) if math.isfinite(start) else None
                for view, (start, upstream) in zip(snapshot.waiting, estimates, strict=True)}
    while play.ends or play._next_event() < 2**62:  # no new arrival: play every grant out
        play.run_until(play._next_event())
    assert not play.scheduler.snapshot().waiting
    actual = {request_id: play.granted[request_id] for request_id in expected}
    assert actual == expected
