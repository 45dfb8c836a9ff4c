"""One queue over several upstreams (issue 27): the node rule (`dispatch.choose`, walked by
`Scheduler.next`), exact cases first, then properties over random traffic."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llamaswap.core import ManualClock, Priority, PrioritySource, Scheduler, SchedulerError, Slots
from llamaswap.core.dispatch import LaneTurn, fits, lane_turn
from llamaswap.core.policy import LanePolicy
from policies import serial


def node(*lanes: LanePolicy, bonus: int = 0, reserved: int = 0) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    policy = serial(aging_divisor_s=0.0, swap_affinity_bonus=bonus).with_lanes(tuple(lanes))
    return Scheduler(policy, clock), clock


def lane(name: str, slots: int = 1, models: tuple[str, ...] | None = None, reserved: int = 0) -> LanePolicy:
    return LanePolicy(name, Slots(slots, {}, reserved), frozenset(models) if models is not None else None)


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def grants(scheduler: Scheduler) -> list[tuple[str, str]]:
    """Grant until nothing more starts: (request, upstream) in grant order."""
    made = []
    while (decision := scheduler.next()) is not None:
        made.append((decision.request_id, decision.upstream))
    return made


def test_two_models_start_at_once_on_two_idle_upstreams() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    scheduler.enqueue("a", prio(10), "x")
    scheduler.enqueue("b", prio(0), "y")
    assert grants(scheduler) == [("a", "gpu0"), ("b", "gpu1")]
    assert scheduler.loaded_on("gpu0") == "x" and scheduler.loaded_on("gpu1") == "y"


def test_a_request_goes_where_its_model_is_loaded() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    scheduler.set_loaded_model("x", as_of=0, upstream="gpu0")
    scheduler.set_loaded_model("y", as_of=0, upstream="gpu1")
    scheduler.enqueue("wants-y", prio(0), "y")
    scheduler.enqueue("wants-x", prio(0), "x")
    decisions = {}
    while (decision := scheduler.next()) is not None:
        decisions[decision.request_id] = decision
    assert decisions["wants-y"].upstream == "gpu1" and not decisions["wants-y"].model_load
    assert decisions["wants-x"].upstream == "gpu0" and not decisions["wants-x"].model_load


def test_an_idle_upstream_with_nothing_loaded_is_preferred_then_the_least_wanted_model() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"), lane("gpu2"))
    scheduler.set_loaded_model("x", as_of=0, upstream="gpu0")
    scheduler.set_loaded_model("y", as_of=0, upstream="gpu1")
    scheduler.enqueue("z1", prio(50), "z")
    first = scheduler.next()
    assert first is not None and first.upstream == "gpu2" and first.load
    scheduler.enqueue("x1", prio(1), "x")  # x is wanted, y is not: y's upstream is the one to swap
    scheduler.enqueue("w1", prio(40), "w")
    taken = dict(grants(scheduler))
    assert taken == {"w1": "gpu1", "x1": "gpu0"}


def test_drain_then_swap_per_upstream_while_the_other_serves() -> None:
    scheduler, _ = node(lane("gpu0", slots=2), lane("gpu1", slots=2))
    scheduler.enqueue("x1", prio(0), "x")
    scheduler.enqueue("y1", prio(0), "y")
    assert grants(scheduler) == [("x1", "gpu0"), ("y1", "gpu1")]
    scheduler.enqueue("z-best", prio(90), "z")  # another model everywhere: one upstream drains for it
    scheduler.enqueue("x2", prio(0), "x")
    scheduler.enqueue("y2", prio(0), "y")
    made = dict(grants(scheduler))
    # gpu0 (first of two equally expected drains) takes nothing more; gpu1 keeps serving y.
    assert made == {"y2": "gpu1"}
    assert scheduler.slots_busy_on("gpu0") == 1
    scheduler.release("x1")
    made = dict(grants(scheduler))
    assert made == {"z-best": "gpu0"}
    assert scheduler.loaded_on("gpu0") == "z"


def test_the_upstream_expected_to_drain_first_is_the_one_that_drains() -> None:
    @dataclasses.dataclass
    class Times:
        def slot_free_in_s(self, lane: str) -> float:
            return self.drained_in_s(lane)

        def drained_in_s(self, lane: str) -> float:
            return {"gpu0": 30.0, "gpu1": 2.0}[lane]

        def swap_s(self, model: str | None, lane: str) -> float:
            return 5.0

    for times, drains in ((Times(), "gpu1"), (None, "gpu0")):
        scheduler, _ = node(lane("gpu0", slots=2), lane("gpu1", slots=2))
        scheduler.enqueue("x1", prio(0), "x")
        scheduler.enqueue("y1", prio(0), "y")
        grants(scheduler)
        scheduler.enqueue("z", prio(10), "z")
        scheduler.enqueue("x2", prio(0), "x")
        scheduler.enqueue("y2", prio(0), "y")
        made = []
        while (decision := scheduler.next(times=times) if times else scheduler.next()) is not None:
            made.append(decision.request_id)
        # The one that drains for z takes nothing more; the other serves its model beside it.
        assert made == (["x2"] if drains == "gpu1" else ["y2"])


def test_waiting_for_a_warm_upstream_when_it_frees_sooner_than_a_load() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    scheduler.enqueue("x1", prio(0), "x")
    grants(scheduler)  # gpu0 runs x; gpu1 idle

    class Times:
        def slot_free_in_s(self, lane: str) -> float:
            return 1.0

        def drained_in_s(self, lane: str) -> float:
            return 1.0

        def swap_s(self, model: str | None, lane: str) -> float:
            return 20.0

    scheduler.enqueue("x2", prio(50), "x")
    scheduler.enqueue("y1", prio(0), "y")
    decision = scheduler.next(times=Times())
    # x2 waits for gpu0 (a slot in 1 s beats a 20 s load); y1 takes the idle gpu1 meanwhile.
    assert decision is not None and (decision.request_id, decision.upstream) == ("y1", "gpu1")
    assert scheduler.next(times=Times()) is None
    # Knowing nothing of times, an idle upstream takes the best request it may serve.
    scheduler.release("y1")
    decision = scheduler.next()
    assert decision is not None and (decision.request_id, decision.upstream) == ("x2", "gpu1")


def test_a_model_goes_only_to_the_upstreams_that_may_serve_it() -> None:
    scheduler, _ = node(lane("small", models=("tiny",)), lane("big"))
    scheduler.enqueue("huge1", prio(10), "huge")
    scheduler.enqueue("huge2", prio(10), "huge")
    scheduler.enqueue("tiny1", prio(0), "tiny")
    assert grants(scheduler) == [("huge1", "big"), ("tiny1", "small")]
    assert scheduler.depth == 1  # huge2 waits for "big"; "small" may not serve it


def test_a_blocked_upstream_takes_nothing_and_the_other_serves() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    scheduler.enqueue("a", prio(0), "x")
    scheduler.enqueue("b", prio(0), "x")
    decision = scheduler.next(blocked=frozenset({"gpu0"}))
    assert decision is not None and decision.upstream == "gpu1"
    assert scheduler.next(blocked=frozenset({"gpu0"})) is None
    decision = scheduler.next()
    assert decision is not None and decision.upstream == "gpu0"


def test_an_unload_runs_alone_on_the_upstream_that_has_the_model() -> None:
    scheduler, _ = node(lane("gpu0", slots=2), lane("gpu1", slots=2))
    scheduler.set_loaded_model("y", as_of=0, upstream="gpu1")
    scheduler.enqueue("y1", prio(0), "y")
    grants(scheduler)
    scheduler.enqueue("unload-y", prio(5), "y", alone=True)
    scheduler.enqueue("y2", prio(0), "y")
    # gpu1 drains for the unload; the idle gpu0 takes y2 meanwhile (loading y there).
    assert grants(scheduler) == [("y2", "gpu0")]
    scheduler.release("y1")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "unload-y" and decision.upstream == "gpu1"
    scheduler.enqueue("y3", prio(0), "y")
    assert grants(scheduler) == [("y3", "gpu0")]  # nothing beside the unload on gpu1


def test_reserved_slots_hold_per_upstream() -> None:
    scheduler, _ = node(lane("gpu0", slots=2, reserved=1), lane("gpu1", slots=2, reserved=1))
    for n in range(4):
        scheduler.enqueue(f"batch{n}", prio(-60), "x")
    made = grants(scheduler)
    # One batch request per upstream: the other slot of each is kept for the interactive band.
    assert sorted(upstream for _, upstream in made) == ["gpu0", "gpu1"]
    scheduler.enqueue("chat", prio(80), "x")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "chat" and decision.reserved_slot


def test_release_and_loaded_model_reports_are_per_upstream() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    scheduler.enqueue("a", prio(0), "x")
    scheduler.enqueue("b", prio(0), "y")
    grants(scheduler)
    as_of = scheduler.dispatches_on("gpu1")
    assert not scheduler.set_loaded_model("q", as_of=as_of, upstream="gpu1")  # b runs there
    scheduler.release("b", model_loaded=False)
    assert scheduler.loaded_on("gpu1") is None and scheduler.loaded_on("gpu0") == "x"
    assert scheduler.set_loaded_model("q", as_of=as_of, upstream="gpu1")
    snapshot = scheduler.snapshot()
    assert [(view.name, view.loaded_model, view.slots_busy) for view in snapshot.lanes] == [
        ("gpu0", "x", 1), ("gpu1", "q", 0)]
    assert [grant.upstream for grant in snapshot.grants] == ["gpu0"]


def test_the_upstreams_cannot_change_under_a_running_scheduler() -> None:
    scheduler, _ = node(lane("gpu0"), lane("gpu1"))
    with pytest.raises(SchedulerError, match="upstreams"):
        scheduler.reconfigure(serial().with_lanes((lane("gpu0"), lane("gpu7"))))


# -- properties ----------------------------------------------------------------------------

MODELS = ("a", "b", "c", None)


class NodeMachine(RuleBasedStateMachine):
    """Random arrivals, grants, releases and blocked upstreams over two or three upstreams with
    random slots and model restrictions; what runs where is also kept here, by hand, as the
    upstreams would see it."""

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(2, 3))
        reserved = data.draw(st.integers(0, 1))
        self.policies = []
        for index in range(count):
            slots = data.draw(st.integers(reserved + 1, 3))
            models = data.draw(st.one_of(st.none(), st.sets(st.sampled_from(("a", "b", "c")), min_size=1)))
            self.policies.append(LanePolicy(f"gpu{index}", Slots(slots, {}, reserved),
                                            frozenset(models) if models is not None else None))
        self.clock = ManualClock()
        bonus = data.draw(st.sampled_from((0, 5, 1000)))
        self.scheduler = Scheduler(serial(aging_divisor_s=data.draw(st.sampled_from((0.0, 1.0))),
                                          swap_affinity_bonus=bonus).with_lanes(tuple(self.policies)), self.clock)
        self.running: dict[str, tuple[str, str | None, bool]] = {}  # request -> (upstream, model, alone)
        self.on_upstream: dict[str, str | None] = {p.name: None for p in self.policies}  # what each has loaded
        self.blocked: frozenset[str] = frozenset()
        self.seq = 0

    def _servable(self, model: str | None) -> bool:
        return model is None or any(p.models is None or model in p.models for p in self.policies)

    @rule(priority=st.integers(-100, 100), model=st.sampled_from(MODELS), alone=st.booleans())
    def arrive(self, priority: int, model: str | None, alone: bool) -> None:
        if not self._servable(model):
            return  # the configuration refuses a model no upstream may serve
        self.seq += 1
        self.scheduler.enqueue(f"r{self.seq}", prio(priority), model, alone=alone and model is not None)

    @rule(seconds=st.sampled_from((0.0, 0.5, 3.0)))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(data=st.data())
    def block(self, data: st.DataObject) -> None:
        names = [p.name for p in self.policies]
        self.blocked = frozenset(data.draw(st.sets(st.sampled_from(names), max_size=len(names) - 1)))

    @rule()
    def grant_all(self) -> None:
        while (decision := self.scheduler.next(blocked=self.blocked)) is not None:
            upstream = decision.upstream
            assert upstream not in self.blocked
            policy = next(p for p in self.policies if p.name == upstream)
            assert policy.models is None or decision.model is None or decision.model in policy.models
            others = [(m, alone) for (u, m, alone) in self.running.values() if u == upstream]
            if decision.alone:
                assert not others, "an unload runs alone"
            assert not any(alone for _, alone in others), "nothing runs beside an unload"
            if decision.model is not None and not decision.alone:
                if others:
                    assert all(m in (None, decision.model) for m, _ in others), "two models on one upstream"
                    assert not decision.model_load
                if decision.model_load:
                    assert not others, "a load only when nothing runs there"
                self.on_upstream[upstream] = decision.model
            self.running[decision.request_id] = (upstream, decision.model, decision.alone)
            assert self.scheduler.slots_busy_on(upstream) <= self.scheduler.slots_total_on(upstream)
        self._nothing_could_start()

    def _nothing_could_start(self) -> None:
        """After the grants, every request that could start somewhere is behind one that claims it."""
        snapshot = self.scheduler.snapshot()
        lanes = self.scheduler.lane_views(self.blocked)
        order = {view.request_id: index for index, view in enumerate(snapshot.waiting)}
        loaded = {view.loaded for view in lanes}
        waiting = list(self.scheduler._waiting.values())  # noqa: SLF001  # the candidates, as the rule sees them
        for candidate in waiting:
            for view in lanes:
                verdict = lane_turn(view, candidate)
                if verdict is LaneTurn.IDLE and not (candidate.alone and candidate.model in loaded):
                    # (An unload waits for the upstream that has its model loaded.)
                    pytest.fail(f"{view.name} idles while {candidate.request_id} ({candidate.model}) waits")
                if verdict is LaneTurn.FREE:
                    # Some request ahead of it waits that this upstream may serve but not now.
                    ahead = [other for other in waiting if order[other.request_id] < order[candidate.request_id]
                             and view.may_serve(other) and (not fits(other, view.loaded) or not other.interactive)]
                    assert ahead, f"{candidate.request_id} waits while {view.name} has a free slot for it"

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), loaded=st.booleans())
    def release(self, data: st.DataObject, loaded: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        upstream, model, alone = self.running.pop(request_id)
        assert self.scheduler.upstream_of(request_id) == upstream
        self.scheduler.release(request_id, model_loaded=loaded and not alone)

    @invariant()
    def per_upstream_records_agree(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for policy in self.policies:
            mine = [m for (u, m, _) in self.running.values() if u == policy.name]
            assert self.scheduler.slots_busy_on(policy.name) == len(mine)
            assert len({m for m in mine if m is not None}) <= 1
        assert self.scheduler.slots_busy == len(self.running)
        assert not math.isnan(float(self.scheduler.depth))


NodeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_node_rule_properties = NodeMachine.TestCase


def test_the_bonus_counts_where_a_request_can_start_without_a_swap() -> None:
    # gpu1 runs y (one slot, full); gpu0 is idle with x loaded. y1 is older than x1, both at 0:
    # y1's model is loaded only where it cannot start now, so x1 (the idle GPU's model) wins by
    # the bonus and starts on gpu0 without a swap, as it would with one GPU.
    scheduler, clock = node(lane("gpu0"), lane("gpu1"), bonus=10)
    scheduler.set_loaded_model("x", as_of=0, upstream="gpu0")
    scheduler.enqueue("y0", prio(0), "y")
    first = scheduler.next()
    assert first is not None and first.upstream == "gpu1"  # gpu1: nothing loaded there yet
    scheduler.enqueue("y1", prio(0), "y")
    clock.advance(1.0)
    scheduler.enqueue("x1", prio(0), "x")
    decision = scheduler.next()
    assert decision is not None and (decision.request_id, decision.upstream) == ("x1", "gpu0")
    assert not decision.model_load and decision.swap_affinity
