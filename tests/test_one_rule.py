"""One rule for one resident model and for several (issue 45): the cases where the one-model
form and the several-model form of a rule disagreed, and what the one rule decides now. Each
test pins one case; the closing note of issue 45 lists them."""

from __future__ import annotations

import types

import pytest

from llamaswap.core import Estimator, ManualClock, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.dispatch import Turn, full, takes_nothing, turn
from llamaswap.core.estimate import remaining_of
from llamaswap.core.estimate_node import starts_of_node
from llamaswap.core.policy import GpuPolicy
from llamaswap.runtime.forecast import Forecast
from llamaswap.runtime.observer import SettleReason
from llamaswap.runtime.settle import Settling
from policies import serial


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def gpu(name: str = "gpu0", *, max_loaded: int = 3, slots: int = 1, per_model: dict[str, int] | None = None,
        memory: int | None = None) -> GpuPolicy:
    return GpuPolicy(name, Slots(slots, per_model or {}, 0), None, Residency(max_loaded, frozenset(), memory, {}))


def node(*gpus: GpuPolicy) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    return Scheduler(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus(tuple(gpus)), clock), clock


class _NoModel:
    model = None
    alone = False
    interactive = False


def test_a_request_of_no_model_fills_the_slots_in_effect_whatever_the_room() -> None:
    # Several resident (before): a request of no model counted against the default slots (1), so
    # with one grant of A running it waited. One model (before and now): the slots in effect, A's 3.
    for max_loaded in (1, 3):
        scheduler, _ = node(gpu(max_loaded=max_loaded, per_model={"A": 3}))
        scheduler.enqueue("a1", prio(10), "A")
        assert scheduler.next() is not None
        held = scheduler.holdings()[0]
        assert held.slots_in_effect == 3
        assert turn(held, _NoModel()) is Turn.FREE


def test_retry_after_waits_for_no_grant_where_a_gpu_has_room_to_load() -> None:
    # One slot, A's one grant running: full for A, but room for two more models. Before,
    # `Forecast.busy_s` read every slot taken as full (the grant's end), while the rule would
    # start a load of another model at once; now both read `dispatch.full`.
    scheduler, clock = node(gpu(max_loaded=3))
    scheduler.enqueue("a1", prio(10), "A")
    assert scheduler.next() is not None
    held = scheduler.holdings()[0]
    assert not full(held) and not takes_nothing(held)
    estimator = Estimator(default_run_s=10, default_swap_s=5, samples=3)
    assert Forecast(clock, scheduler, estimator, schedule_model=lambda model: model).busy_s() == 0.0
    # Room for one model: full, so the wait is the grant's (its load, then its run).
    one, clock = node(gpu(max_loaded=1))
    one.enqueue("a1", prio(10), "A")
    assert one.next() is not None
    assert full(one.holdings()[0])
    assert Forecast(clock, one, estimator, schedule_model=lambda model: model).busy_s() == pytest.approx(15.0)


def test_a_request_of_no_model_granted_beside_a_load_runs_after_it() -> None:
    # Several resident (before): the grant said it ran at once (no ready time after the load) while the
    # estimates inferred it ran after the load. Now the grant sets it once, as with one model.
    for max_loaded in (1, 3):
        scheduler, _ = node(gpu(max_loaded=max_loaded, slots=2))
        scheduler.enqueue("a1", prio(10), "A")
        scheduler.enqueue("n1", prio(5), None)
        load, beside = scheduler.next(), scheduler.next()
        assert load is not None and load.load
        assert beside is not None and beside.model is None
        assert beside.ready_at == ("A", load.granted_ns)


def test_the_walk_starts_a_request_of_no_model_after_the_load_under_way() -> None:
    # The estimates' walk: the load of A begins now (4 s); a request of no model started beside
    # it runs once it ends, with one model as with several (before, several: at once).
    estimator = Estimator(default_run_s=10, default_swap_s=4, samples=3)
    for max_loaded in (1, 3):
        scheduler, _ = node(gpu(max_loaded=max_loaded, slots=3))
        for request_id, model in (("a1", "A"), ("n1", None), ("n2", None)):
            scheduler.enqueue(request_id, prio(10), model)
        assert scheduler.next() is not None and scheduler.next() is not None
        snapshot = scheduler.snapshot()
        # n2 waits in the queue; it would start now in the third slot, its run after A's load.
        starts = starts_of_node(estimator, snapshot, scheduler.holdings())
        assert starts == [(0.0, "gpu0")]
        running = {grant.request_id: grant for grant in snapshot.grants}
        assert running["n1"].ready_at == ("A", 0.0)
        assert remaining_of(estimator, snapshot.grants) == [14.0, 14.0]


def test_a_request_of_no_model_goes_where_the_resident_models_are_wanted_least() -> None:
    # Two idle GPUs, A resident on gpu0, nothing on gpu1: the request of no model takes gpu1 (it
    # would take a slot A's requests could use). Before, with several resident: the first, gpu0.
    for max_loaded in (1, 3):
        scheduler, _ = node(gpu("gpu0", max_loaded=max_loaded), gpu("gpu1", max_loaded=max_loaded))
        assert scheduler.set_residents(frozenset({"A"}), as_of=0, gpu="gpu0")
        scheduler.enqueue("n1", prio(10), None)
        decision = scheduler.next()
        assert decision is not None and decision.gpu == "gpu1"


def test_nothing_loads_beside_work_of_no_model_where_there_is_room_for_one() -> None:
    # Nothing known resident, a request of no model runs: with room for one model a load of A
    # waits for it (the upstream's own model holds the one place); with room for more it goes.
    for max_loaded, starts in ((1, False), (3, True)):
        scheduler, _ = node(gpu(max_loaded=max_loaded, slots=2))
        scheduler.enqueue("n1", prio(10), None)
        scheduler.enqueue("a1", prio(5), "A")
        assert scheduler.next() is not None
        assert (scheduler.next() is not None) is starts


def test_a_model_the_best_holds_back_for_its_load_goes_for_that_load_only() -> None:
    # Found by the resident reference (tests/reference_resident.py): d (of unknown size, the whole
    # budget) is best and holds back c (busy) and a (idle) to load once both have gone; b, behind
    # it, must not evict a to load into the place d waits for (before: it did, and d waited on).
    residency = Residency(2, frozenset(), 2, {"a": 1, "b": 1, "c": 1})
    scheduler, _ = node(GpuPolicy("gpu0", Slots(4, {}, 1), None, residency))
    for request_id, priority, model in (("r1", -100, "a"), ("r2", -100, "b"), ("r3", -60, "d"), ("r4", 0, "c")):
        scheduler.enqueue(request_id, prio(priority), model)
    granted = [scheduler.next(), scheduler.next()]
    assert [decision.request_id for decision in granted if decision is not None] == ["r4", "r1"]
    scheduler.release("r1")
    assert scheduler.next() is None
    assert scheduler.residents_on("gpu0") == frozenset({"a", "c"})
    # Once c has drained, both go for d's load.
    scheduler.release("r4")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "r3"
    assert {eviction.model for eviction in decision.evicts} == {"a", "c"}


class _SettlingGpus:
    """What `Forecast` reads of the runtime's GPUs: each one's settle under way (`Gpus.named`)."""

    def __init__(self, settling: Settling) -> None:
        self._gpu = types.SimpleNamespace(settling=settling)

    def named(self, name: str | None) -> types.SimpleNamespace:
        return self._gpu


def test_retry_after_waits_for_no_settle_of_one_model_where_the_others_serve() -> None:
    # Several resident, A's abandoned generation settling: the rule grants B beside it
    # (`takes_nothing` is False), while `Forecast.busy_s` waited for the settle's expected end.
    # Now it reads `takes_nothing`; a settle that holds the whole GPU is waited for as before.
    estimator = Estimator(default_run_s=10, default_swap_s=5, samples=3)
    for settling_model, expected_s in (("A", 0.0), (None, 10.0)):
        scheduler, clock = node(gpu(max_loaded=2))
        scheduler.set_residents(frozenset({"A", "B"}), as_of=0, gpu="gpu0")
        scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model=settling_model)
        settling = Settling(SettleReason.ABANDONED, "A", "a1", clock.now_ns(), clock.now_ns())
        forecast = Forecast(clock, scheduler, estimator, gpus=_SettlingGpus(settling),  # type: ignore[arg-type]
                            schedule_model=lambda model: model)
        assert takes_nothing(scheduler.holdings()[0]) is (settling_model is None)
        assert forecast.busy_s() == pytest.approx(expected_s)
