"""One queue over several upstreams (issue 27): the node rule (`dispatch.choose`, walked by
`Scheduler.next`). Exact cases first; then the scheduler against the brute-force node of
tests/reference.py (`ReferenceNode`, the rule as docs/scheduling.md states it) over random
traffic on two or three upstreams; then scenarios run on both, among them the four places where
the code once read the rule otherwise than the docs (issue 36)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llamaswap.core import Decision, ManualClock, Priority, PrioritySource, Scheduler, SchedulerError, Slots
from llamaswap.core.dispatch import NO_TIMES
from llamaswap.core.holding import GpuHolding
from llamaswap.core.policy import GpuPolicy
import learnt_times
from learnt_times import Times
from policies import fifo, serial
from reference import ReferenceNode, RefGpuPolicy, RefNodeDecision, RefPolicy, float_close, residents


def node(*gpus: GpuPolicy, bonus: int = 0, reserved: int = 0) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    policy = serial(aging_divisor_s=0.0, swap_affinity_bonus=bonus).with_gpus(tuple(gpus))
    return Scheduler(policy, clock), clock


def gpu(name: str, slots: int = 1, models: tuple[str, ...] | None = None, reserved: int = 0) -> GpuPolicy:
    return GpuPolicy(name, Slots(slots, {}, reserved), frozenset(models) if models is not None else None)


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def grants(scheduler: Scheduler) -> list[tuple[str, str]]:
    """Grant until nothing more starts: (request, upstream) in grant order."""
    made = []
    while (decision := scheduler.next()) is not None:
        made.append((decision.request_id, decision.gpu))
    return made


def hold(scheduler: Scheduler, blocked: frozenset[str]) -> None:
    """The ``blocked`` upstreams held by a settle (as the runtime tells the scheduler), the others by nothing."""
    for name in scheduler.gpus:
        scheduler.blocked_by(name, settling=name in blocked, adopted=0)


def test_two_models_start_at_once_on_two_idle_upstreams() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    scheduler.enqueue("a", prio(10), "x")
    scheduler.enqueue("b", prio(0), "y")
    assert grants(scheduler) == [("a", "gpu0"), ("b", "gpu1")]
    assert scheduler.residents_on("gpu0") == frozenset({"x"}) and scheduler.residents_on("gpu1") == frozenset({"y"})


def test_a_request_goes_where_its_model_is_loaded() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    scheduler.set_residents(frozenset({"x"}), as_of=0, gpu="gpu0")
    scheduler.set_residents(frozenset({"y"}), as_of=0, gpu="gpu1")
    scheduler.enqueue("wants-y", prio(0), "y")
    scheduler.enqueue("wants-x", prio(0), "x")
    decisions = {}
    while (decision := scheduler.next()) is not None:
        decisions[decision.request_id] = decision
    assert decisions["wants-y"].gpu == "gpu1" and not decisions["wants-y"].model_load
    assert decisions["wants-x"].gpu == "gpu0" and not decisions["wants-x"].model_load


def test_an_idle_upstream_with_nothing_loaded_is_preferred_then_the_least_wanted_model() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"), gpu("gpu2"))
    scheduler.set_residents(frozenset({"x"}), as_of=0, gpu="gpu0")
    scheduler.set_residents(frozenset({"y"}), as_of=0, gpu="gpu1")
    scheduler.enqueue("z1", prio(50), "z")
    first = scheduler.next()
    assert first is not None and first.gpu == "gpu2" and first.load
    scheduler.enqueue("x1", prio(1), "x")  # x is wanted, y is not: y's upstream is the one to swap
    scheduler.enqueue("w1", prio(40), "w")
    taken = dict(grants(scheduler))
    assert taken == {"w1": "gpu1", "x1": "gpu0"}


def test_drain_then_swap_per_upstream_while_the_other_serves() -> None:
    scheduler, _ = node(gpu("gpu0", slots=2), gpu("gpu1", slots=2))
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
    assert scheduler.residents_on("gpu0") == frozenset({"z"})


def test_the_upstream_expected_to_drain_first_is_the_one_that_drains() -> None:
    @dataclasses.dataclass
    class Times:
        def slot_free_in_s(self, gpu: str) -> float:
            return self.drained_in_s(gpu)

        def drained_in_s(self, gpu: str) -> float:
            return {"gpu0": 30.0, "gpu1": 2.0}[gpu]

        def swap_s(self, model: str | None, gpu: str) -> float:
            return 5.0

    for times, drains in ((Times(), "gpu1"), (None, "gpu0")):
        scheduler, _ = node(gpu("gpu0", slots=2), gpu("gpu1", slots=2))
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
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    scheduler.enqueue("x1", prio(0), "x")
    grants(scheduler)  # gpu0 runs x; gpu1 idle

    class Times:
        def slot_free_in_s(self, gpu: str) -> float:
            return 1.0

        def drained_in_s(self, gpu: str) -> float:
            return 1.0

        def swap_s(self, model: str | None, gpu: str) -> float:
            return 20.0

    scheduler.enqueue("x2", prio(50), "x")
    scheduler.enqueue("y1", prio(0), "y")
    decision = scheduler.next(times=Times())
    # x2 waits for gpu0 (a slot in 1 s beats a 20 s load); y1 takes the idle gpu1 meanwhile.
    assert decision is not None and (decision.request_id, decision.gpu) == ("y1", "gpu1")
    assert scheduler.next(times=Times()) is None
    # Knowing nothing of times, an idle upstream takes the best request it may serve.
    scheduler.release("y1")
    decision = scheduler.next()
    assert decision is not None and (decision.request_id, decision.gpu) == ("x2", "gpu1")


def test_a_model_goes_only_to_the_upstreams_that_may_serve_it() -> None:
    scheduler, _ = node(gpu("small", models=("tiny",)), gpu("big"))
    scheduler.enqueue("huge1", prio(10), "huge")
    scheduler.enqueue("huge2", prio(10), "huge")
    scheduler.enqueue("tiny1", prio(0), "tiny")
    assert grants(scheduler) == [("huge1", "big"), ("tiny1", "small")]
    assert scheduler.depth == 1  # huge2 waits for "big"; "small" may not serve it


def test_a_blocked_upstream_takes_nothing_and_the_other_serves() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    scheduler.enqueue("a", prio(0), "x")
    scheduler.enqueue("b", prio(0), "x")
    assert scheduler.blocked_by("gpu0", settling=True, adopted=0)
    assert [gpu.blocked for gpu in scheduler.holdings()] == [True, False]
    decision = scheduler.next()
    assert decision is not None and decision.gpu == "gpu1"
    assert scheduler.next() is None
    assert scheduler.blocked_by("gpu0", settling=False, adopted=1)  # an adopted exchange holds it as well
    assert scheduler.next() is None
    assert scheduler.blocked_by("gpu0", settling=False, adopted=0)
    decision = scheduler.next()
    assert decision is not None and decision.gpu == "gpu0"


def test_an_unload_runs_alone_on_the_upstream_that_has_the_model() -> None:
    scheduler, _ = node(gpu("gpu0", slots=2), gpu("gpu1", slots=2))
    scheduler.set_residents(frozenset({"y"}), as_of=0, gpu="gpu1")
    scheduler.enqueue("y1", prio(0), "y")
    grants(scheduler)
    scheduler.enqueue("unload-y", prio(5), "y", alone=True)
    scheduler.enqueue("y2", prio(0), "y")
    # gpu1 drains for the unload; the idle gpu0 takes y2 meanwhile (loading y there).
    assert grants(scheduler) == [("y2", "gpu0")]
    scheduler.release("y1")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "unload-y" and decision.gpu == "gpu1"
    scheduler.enqueue("y3", prio(0), "y")
    assert grants(scheduler) == [("y3", "gpu0")]  # nothing beside the unload on gpu1


def test_reserved_slots_hold_per_upstream() -> None:
    scheduler, _ = node(gpu("gpu0", slots=2, reserved=1), gpu("gpu1", slots=2, reserved=1))
    for n in range(4):
        scheduler.enqueue(f"batch{n}", prio(-60), "x")
    made = grants(scheduler)
    # One batch request per upstream: the other slot of each is kept for the interactive band.
    assert sorted(upstream for _, upstream in made) == ["gpu0", "gpu1"]
    scheduler.enqueue("chat", prio(80), "x")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "chat" and decision.reserved_slot


def test_release_and_loaded_model_reports_are_per_upstream() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    scheduler.enqueue("a", prio(0), "x")
    scheduler.enqueue("b", prio(0), "y")
    grants(scheduler)
    as_of = scheduler.dispatches_on("gpu1")
    assert not scheduler.set_residents(frozenset({"q"}), as_of=as_of, gpu="gpu1")  # b runs there
    scheduler.release("b", model_loaded=False)
    assert scheduler.residents_on("gpu1") == frozenset() and scheduler.residents_on("gpu0") == frozenset({"x"})
    assert scheduler.set_residents(frozenset({"q"}), as_of=as_of, gpu="gpu1")
    snapshot = scheduler.snapshot()
    assert [(view.name, view.resident_models, view.slots_busy) for view in snapshot.gpus] == [
        ("gpu0", ("x",), 1), ("gpu1", ("q",), 0)]
    assert [grant.gpu for grant in snapshot.grants] == ["gpu0"]


def test_the_gpus_cannot_change_under_a_running_scheduler() -> None:
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    with pytest.raises(SchedulerError, match="GPUs cannot change"):
        scheduler.reconfigure(serial().with_gpus((gpu("gpu0"), gpu("gpu7"))))


# -- properties: the scheduler against the brute-force node (tests/reference.py) --------------

MODELS = ("a", "b", "c", None)
def times_for(names: list[str]) -> st.SearchStrategy[Times | None]:
    return learnt_times.times_for(names, MODELS, unknown_in_3=1)


class NodeMachine(RuleBasedStateMachine):
    """Random arrivals (unloads among them), grants, releases (with what each answer says of the
    model), loaded-model reports, cancels, learnt times and blocked upstreams over two or three
    upstreams with random slots (per model too), reserved slots and model limits. Every grant
    must be the brute-force reference's (`ReferenceNode`): the same request on the same upstream,
    loading or swapping the same, with the same score; when the scheduler grants nothing,
    neither does the reference; each upstream's loaded model is the reference's after every
    step. What runs where is also checked on its own, as the upstreams would see it."""

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(2, 3))
        reserved = data.draw(st.integers(0, 1))  # the node's: every upstream keeps as many
        counts = st.integers(reserved + 1, 3)
        self.policies = []
        for index in range(count):
            slots = Slots(data.draw(counts), data.draw(st.dictionaries(st.sampled_from(("a", "b", "c")), counts,
                                                                        max_size=2)), reserved)
            models = data.draw(st.one_of(st.none(), st.sets(st.sampled_from(("a", "b", "c")), min_size=1)))
            self.policies.append(GpuPolicy(f"gpu{index}", slots, frozenset(models) if models is not None else None))
        self.names = [p.name for p in self.policies]
        self.clock = ManualClock()
        serials = st.builds(lambda divisor, bonus: serial(aging_divisor_s=divisor, swap_affinity_bonus=bonus),
                            st.sampled_from((0.0, 1.0, 60.0)), st.sampled_from((0, 5, 30, 1000)))
        fifos = st.builds(fifo, st.dictionaries(st.sampled_from(("a", "b", "c")), st.integers(-60, 60)))
        policy = data.draw(st.one_of(serials, serials, fifos))
        policy = policy.with_gpus(tuple(self.policies))
        self.scheduler = Scheduler(policy, self.clock)
        self.reference = ReferenceNode(RefPolicy.of(policy), [RefGpuPolicy.of(p) for p in self.policies],
                                       self.clock.now_ns)
        self.running: dict[str, tuple[str, str | None, bool]] = {}  # request -> (upstream, model, alone)
        self.waiting: set[str] = set()
        self.times: Times | None = data.draw(times_for(self.names))
        self.seq = 0

    def _servable(self, model: str | None) -> bool:
        return model is None or any(p.models is None or model in p.models for p in self.policies)

    @rule(arrivals=st.lists(st.tuples(st.integers(-100, 100), st.sampled_from(("a", "a", "b", "c", None)),
                                      st.sampled_from((False, False, False, True))), min_size=1, max_size=6),
          grant=st.booleans())
    def arrive(self, arrivals: list[tuple[int, str | None, bool]], grant: bool) -> None:
        """Requests arrive; ``grant``: then the grants, as the coordinator asks after each one."""
        for priority, model, alone in arrivals:
            if not self._servable(model):
                continue  # the configuration refuses a model no upstream may serve
            self.seq += 1
            alone = alone and model is not None  # an unload names its model
            self.scheduler.enqueue(f"r{self.seq}", prio(priority), model, alone=alone)
            self.reference.enqueue(f"r{self.seq}", priority, model, alone)
            self.waiting.add(f"r{self.seq}")
        if grant:
            self.grant_all()

    @rule(seconds=st.sampled_from((0.0, 0.5, 3.0)))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(data=st.data())
    def learn_times(self, data: st.DataObject) -> None:
        self.times = data.draw(times_for(self.names))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.waiting)))
        assert self.scheduler.cancel(request_id) is not None and self.reference.cancel(request_id)
        self.waiting.remove(request_id)

    @rule(data=st.data(), model=st.sampled_from(MODELS))
    def report_loaded(self, data: st.DataObject, model: str | None) -> None:
        upstream = data.draw(st.sampled_from(self.names))
        idle = self.scheduler.slots_busy_on(upstream) == 0
        applied = self.scheduler.set_residents(residents(model), as_of=self.scheduler.dispatches_on(upstream),
                                               gpu=upstream)
        assert applied == idle  # a fresh report is taken exactly while nothing runs there
        self.reference.set_loaded_model(model, upstream)

    @rule(data=st.data())
    def grant_while_blocked(self, data: st.DataObject) -> None:
        """Grants while settles or adopted exchanges hold some upstreams (never all)."""
        names = self.names
        self.grant_all(frozenset(data.draw(st.sets(st.sampled_from(names), min_size=1, max_size=len(names) - 1))))

    @rule()
    def grant_all(self, blocked: frozenset[str] = frozenset()) -> None:
        times = self.times if self.times is not None else NO_TIMES
        while True:
            hold(self.scheduler, blocked)
            decision = self.scheduler.next(times)
            expected = self.reference.next(blocked, self.times)
            if decision is None or expected is None:
                assert decision is None and expected is None, f"granted {decision}, the reference {expected}"
                return
            self._same_grant(decision, expected)
            assert decision.gpu not in blocked
            self._what_the_upstream_sees(decision)

    def _same_grant(self, decision: Decision, expected: RefNodeDecision) -> None:
        got = (decision.request_id, decision.gpu, decision.model, decision.load, decision.swap,
               decision.residents_before, decision.alone, decision.swap_affinity, decision.reserved_slot,
               decision.slots_busy, decision.queue_depth_after)
        assert got == (expected.request_id, expected.gpu, expected.model, expected.load, expected.swap,
                       residents(expected.previous_model), expected.alone, expected.swap_affinity,
                       expected.reserved_slot, expected.slots_busy, expected.queue_depth_after)
        assert float_close(decision.score, expected.score), (decision.score, expected.score)

    def _what_the_upstream_sees(self, decision: Decision) -> None:
        """The rules of one upstream, checked from what runs there (kept here, not asked)."""
        upstream = decision.gpu
        policy = next(p for p in self.policies if p.name == upstream)
        assert policy.models is None or decision.model is None or decision.model in policy.models
        others = [(m, alone) for (u, m, alone) in self.running.values() if u == upstream]
        if decision.alone:
            assert not others, "an unload runs alone"
        assert not any(alone for _, alone in others), "nothing runs beside an unload"
        if decision.model is not None and not decision.alone and others:
            assert all(m in (None, decision.model) for m, _ in others), "two models on one upstream"
            assert not decision.model_load, "a load only when nothing runs there"
        self.running[decision.request_id] = (upstream, decision.model, decision.alone)
        self.waiting.remove(decision.request_id)
        assert self.scheduler.slots_busy_on(upstream) <= _holding(self.scheduler, upstream).slots_in_effect

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), loaded=st.sampled_from((True, False, None)), reached=st.booleans(), grant=st.booleans())
    def release(self, data: st.DataObject, loaded: bool | None, reached: bool, grant: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        upstream, model, alone = self.running.pop(request_id)
        assert self.scheduler.gpu_of(request_id) == upstream
        loaded = False if alone and loaded else loaded  # an unload's success: its model is gone
        self.scheduler.release(request_id, model_loaded=loaded, reached_upstream=reached)
        self.reference.release(request_id, model_loaded=loaded, reached_upstream=reached)
        if grant:
            self.grant_all()

    @invariant()
    def per_upstream_records_agree(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for policy in self.policies:
            mine = [m for (u, m, _) in self.running.values() if u == policy.name]
            assert self.scheduler.slots_busy_on(policy.name) == len(mine)
            assert len({m for m in mine if m is not None}) <= 1
            assert self.scheduler.residents_on(policy.name) == residents(self.reference.gpu(policy.name).loaded_model)
        assert self.scheduler.slots_busy == len(self.running)
        # The queue holds exactly the requests that arrived and were neither granted nor cancelled.
        assert self.scheduler.depth == len(self.waiting)
        assert {view.request_id for view in self.scheduler.snapshot().waiting} == self.waiting


NodeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_node_rule_properties = NodeMachine.TestCase


def test_the_bonus_counts_where_a_request_can_start_without_a_swap() -> None:
    # gpu1 runs y (one slot, full); gpu0 is idle with x loaded. y1 is older than x1, both at 0:
    # y1's model is loaded only where it cannot start now, so x1 (the idle GPU's model) wins by
    # the bonus and starts on gpu0 without a swap, as it would with one GPU.
    scheduler, clock = node(gpu("gpu0"), gpu("gpu1"), bonus=10)
    scheduler.set_residents(frozenset({"x"}), as_of=0, gpu="gpu0")
    scheduler.enqueue("y0", prio(0), "y")
    first = scheduler.next()
    assert first is not None and first.gpu == "gpu1"  # gpu1: nothing loaded there yet
    scheduler.enqueue("y1", prio(0), "y")
    clock.advance(1.0)
    scheduler.enqueue("x1", prio(0), "x")
    decision = scheduler.next()
    assert decision is not None and (decision.request_id, decision.gpu) == ("x1", "gpu0")
    assert not decision.model_load and decision.swap_affinity


# -- scenarios run on the scheduler and on the reference -------------------------------------


class Drive:
    """One scenario over the scheduler or the reference (``reference``)."""

    def __init__(self, reference: bool, *gpus: GpuPolicy, aging_divisor_s: float = 0.0,
                 bonus: int = 0) -> None:
        self.clock = ManualClock()
        policy = serial(aging_divisor_s=aging_divisor_s, swap_affinity_bonus=bonus).with_gpus(gpus)
        self.scheduler = None if reference else Scheduler(policy, self.clock)
        self.reference = ReferenceNode(RefPolicy.of(policy), [RefGpuPolicy.of(p) for p in gpus],
                                       self.clock.now_ns) if reference else None

    def loaded(self, model: str, upstream: str) -> None:
        if self.scheduler is not None:
            assert self.scheduler.set_residents(frozenset({model}), as_of=0, gpu=upstream)
        else:
            self.reference.set_loaded_model(model, upstream)

    def enqueue(self, request_id: str, priority: int, model: str | None, alone: bool = False) -> None:
        if self.scheduler is not None:
            self.scheduler.enqueue(request_id, prio(priority), model, alone=alone)
        else:
            self.reference.enqueue(request_id, priority, model, alone)

    def grants(self, blocked: frozenset[str] = frozenset(), times: Times | None = None) -> list[tuple[str, str]]:
        made = []
        while True:
            if self.scheduler is not None:
                hold(self.scheduler, blocked)
                decision = self.scheduler.next(times if times is not None else NO_TIMES)
            else:
                decision = self.reference.next(blocked, times)
            if decision is None:
                return made
            made.append((decision.request_id, decision.gpu))


def only_the_best_holds_a_gpu_back(reference: bool) -> list[tuple[str, str]]:
    """gpu0 runs x (one of 3 slots), gpu1 runs w and is expected to drain first, gpu2 serves
    only z. v (the best) waits for gpu1 to drain; u waits too, but holds nothing, so x3 takes
    gpu0's free slot."""
    drive = Drive(reference, gpu("gpu0", slots=3), gpu("gpu1", slots=3), gpu("gpu2", models=("z",)))
    drive.enqueue("x1", 0, "x")
    drive.enqueue("w1", 0, "w")
    assert drive.grants() == [("x1", "gpu0"), ("w1", "gpu1")]
    drive.enqueue("v", 90, "v")
    drive.enqueue("u", 50, "u")
    drive.enqueue("x3", 0, "x")
    names = ("gpu0", "gpu1", "gpu2")
    times = Times(dict.fromkeys(names, 1.0), {"gpu0": 10.0, "gpu1": 1.0, "gpu2": 1.0},
                  {(model, name): 1.0 for model in MODELS for name in names})
    return drive.grants(times=times)


def test_only_the_best_holds_an_upstream_back() -> None:
    for reference in (False, True):
        assert only_the_best_holds_a_gpu_back(reference) == [("x3", "gpu0")], reference


def no_bonus_from_a_blocked_gpu(reference: bool) -> list[tuple[str, str]]:
    """x is loaded on gpu0, which a settle holds: x1 cannot start there without a swap, so it
    gets no swap-affinity bonus and y1 (5 points against 0 + 10) goes first."""
    drive = Drive(reference, gpu("gpu0"), gpu("gpu1"), bonus=10)
    drive.loaded("x", "gpu0")
    drive.enqueue("x1", 0, "x")
    drive.enqueue("y1", 5, "y")
    return drive.grants(blocked=frozenset({"gpu0"}))


def test_a_model_loaded_on_a_blocked_upstream_earns_no_bonus() -> None:
    for reference in (False, True):
        assert no_bonus_from_a_blocked_gpu(reference) == [("y1", "gpu1")], reference


# -- where the code once read the rule otherwise than the docs (issue 36) -------------------
#
# Each case runs on the scheduler and on the reference; both say what docs/scheduling.md says.


def free_slots_of_different_sizes(reference: bool) -> list[tuple[str, str]]:
    """gpu0 (4 slots) runs two x, gpu1 (2 slots) one: both have x loaded and a free slot; gpu1
    is the least busy, gpu0 has more free slots."""
    drive = Drive(reference, gpu("gpu0", slots=4), gpu("gpu1", slots=2))
    drive.loaded("x", "gpu0")
    drive.loaded("x", "gpu1")
    drive.enqueue("x1", 0, "x")
    assert drive.grants(blocked=frozenset({"gpu0"})) == [("x1", "gpu1")]
    drive.enqueue("x2", 0, "x")
    drive.enqueue("x3", 0, "x")
    assert drive.grants(blocked=frozenset({"gpu1"})) == [("x2", "gpu0"), ("x3", "gpu0")]
    drive.enqueue("x4", 0, "x")
    return drive.grants()


def a_full_gpu_drains_first(reference: bool) -> list[tuple[str, str]]:
    """gpu0 runs b with a slot free, gpu1 runs an unload (full) and is expected to drain first;
    the best request needs a, loaded nowhere, and b2 waits behind it."""
    drive = Drive(reference, gpu("gpu0", slots=2), gpu("gpu1", slots=2))
    drive.enqueue("b1", 0, "b")
    drive.enqueue("unload-a", 0, "a", alone=True)
    assert drive.grants() == [("b1", "gpu0"), ("unload-a", "gpu1")]
    drive.enqueue("a1", 10, "a")
    drive.enqueue("b2", 0, "b")
    times = Times({"gpu0": 2.0, "gpu1": 2.0}, {"gpu0": 2.0, "gpu1": 0.5},
                  {(model, name): 0.5 for model in MODELS for name in ("gpu0", "gpu1")})
    return drive.grants(times=times)


def no_model_waits_for_its_share(reference: bool) -> list[tuple[str, str]]:
    """Two GPUs of 2 slots, 1 reserved, each running one batch request (x, y): the best waiting
    request names no model and has used its share everywhere; behind it, an interactive request
    of each model."""
    reserved = Slots(2, {}, 1)
    drive = Drive(reference, GpuPolicy("gpu0", reserved), GpuPolicy("gpu1", reserved), aging_divisor_s=1.0)
    drive.enqueue("x1", 0, "x")
    drive.enqueue("y1", 0, "y")
    assert drive.grants() == [("x1", "gpu0"), ("y1", "gpu1")]
    drive.enqueue("no-model", 40, None)
    drive.clock.advance(30)  # 40 + 30 points: ahead of the interactive ones
    drive.enqueue("x-chat", 60, "x")
    drive.enqueue("y-chat", 60, "y")
    return drive.grants()


def an_unload_heads_its_model(reference: bool) -> list[tuple[str, str]]:
    """gpu0 runs two x (3 slots), gpu1 one y (3 slots); the best needs z, then an unload of x,
    then x2, which fits gpu0's free slot."""
    drive = Drive(reference, gpu("gpu0", slots=3), gpu("gpu1", slots=3))
    drive.loaded("x", "gpu0")
    drive.enqueue("x0", 0, "x")
    drive.enqueue("x1", 0, "x")
    assert drive.grants() == [("x0", "gpu0"), ("x1", "gpu0")]
    drive.enqueue("y1", 0, "y")
    assert drive.grants() == [("y1", "gpu1")]
    drive.enqueue("z", 90, "z")
    drive.enqueue("unload-x", 50, "x", alone=True)
    drive.enqueue("x2", 0, "x")
    return drive.grants()


# (scenario, what the docs say)
AS_DOCUMENTED = {
    # "a free slot on a GPU that has its model loaded (the least busy first)": the fewest running
    # grants, not the most free slots (a GPU of more slots is not the emptier one).
    "least busy": (free_slots_of_different_sizes, [("x4", "gpu1")]),
    # "else the one expected to drain first ... The other GPUs keep serving": gpu1, full, drains
    # for a1 and b2 takes gpu0's free slot meanwhile.
    "drain first": (a_full_gpu_drains_first, [("b2", "gpu0")]),
    # "reserved slots (per GPU) mean what they mean with one GPU": while the best (of no model)
    # waits for its share, the interactive requests take the reserved slots.
    "share of no model": (no_model_waits_for_its_share, [("x-chat", "gpu0"), ("y-chat", "gpu1")]),
    # "only the best holds a GPU back: a lower request starts where the rule lets it": an unload
    # at the head of its model's requests does not hide x2 from gpu0's free slot.
    "unload heads its model": (an_unload_heads_its_model, [("x2", "gpu0")]),
}


@pytest.mark.parametrize("case", AS_DOCUMENTED)
def test_the_scheduler_and_the_reference_read_the_docs(case: str) -> None:
    scenario, docs = AS_DOCUMENTED[case]
    assert scenario(True) == docs
    assert scenario(False) == docs


def _holding(scheduler: Scheduler, upstream: str) -> GpuHolding:
    return next(holding for holding in scheduler.holdings() if holding.name == upstream)
