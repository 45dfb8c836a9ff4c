"""Slots: several grants of the loaded model at once, swaps one at a time, reserved slots for
interactive work. Exact cases on a fake clock (the random ones are in test_scheduler_properties)."""

from __future__ import annotations


import pytest

from core_lines import core_lines
from policies import fifo, serial

from llamaswap.core import (
    GpuPolicy,
    Band,
    InvalidSlots,
    ManualClock,
    Policy,
    Priority,
    PrioritySource,
    Scheduler,
    SchedulerError,
    Slots,
    UnknownRequest,
)

S = 1_000_000_000


def P(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def make(slots: Slots, policy: Policy | None = None) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    base = policy if policy is not None else serial(60, 10)
    return Scheduler(base.with_gpus((GpuPolicy("gpu0", slots),)), clock), clock


def granted(s: Scheduler) -> list[str]:
    """Grant until nothing more can start; the ids in grant order."""
    ids = []
    while (decision := s.next()) is not None:
        ids.append(decision.request_id)
    return ids


def running(s: Scheduler) -> list[str]:
    return [d.request_id for d in s.running_grants]


# -- filling the slots ---------------------------------------------------------------------


def test_four_slots_take_four_requests_of_the_loaded_model_at_once():
    s, clock = make(Slots(4))
    for i in range(6):
        s.enqueue(f"a{i}", P(0), "a")
        clock.advance(1)
    decisions = [s.next() for _ in range(4)]
    assert [d.request_id for d in decisions] == ["a0", "a1", "a2", "a3"]
    assert [d.slots_busy for d in decisions] == [1, 2, 3, 4]
    assert [d.load for d in decisions] == [True, False, False, False]  # only the first loads the model
    assert s.next() is None  # every slot busy
    assert (s.slots_busy, s.holdings()[0].slots_in_effect) == (4, 4)
    clock.advance(10)
    released = s.release("a1")  # any grant ends on its own, by its id
    assert (released.request_id, released.granted_ns, released.run_ns) == ("a1", 6 * S, 10 * S)
    assert running(s) == ["a0", "a2", "a3"]
    d = s.next()
    assert (d.request_id, d.slots_busy) == ("a4", 4)
    assert s.next() is None
    assert running(s) == ["a0", "a2", "a3", "a4"]
    assert next(s.running_ids(), None) == "a0" and s.running_grants[0].request_id == "a0"  # the earliest running grant


def test_requests_naming_no_model_run_beside_the_loaded_model():
    s, _ = make(Slots(3))
    s.enqueue("a1", P(0), "a")
    s.enqueue("none", P(0), None)
    s.enqueue("a2", P(0), "a")
    assert granted(s) == ["a1", "a2", "none"]  # a2 with the loaded model's bonus, then the one without a model
    assert [d.slots_busy for d in s.running_grants] == [1, 2, 3]
    assert s.residents_on("gpu0") == frozenset({"a"})


# -- swaps ---------------------------------------------------------------------------------


def test_a_swap_waits_until_every_slot_has_drained_and_nothing_overtakes_it():
    s, clock = make(Slots(2))
    s.enqueue("a1", P(0), "a")
    s.enqueue("a2", P(0), "a")
    assert granted(s) == ["a1", "a2"]
    s.release("a1")
    s.enqueue("b1", P(50), "b")  # the best request needs another model
    s.enqueue("a3", P(0), "a")  # lower-scored work of the loaded model (0 + 10 < 50)
    assert s.next() is None  # a slot is free, but the swap waits and a3 may not overtake it
    clock.advance(5)
    s.release("a2")
    d = s.next()
    assert (d.request_id, d.swap, d.residents_before, d.slots_busy) == ("b1", True, {"a"}, 1)
    assert s.next() is None  # a3 needs a, b is loaded now: it waits for b1 to end


def test_equal_scores_keep_arrival_order_across_a_swap():
    s, _ = make(Slots(2), serial(0, 0))
    s.enqueue("a1", P(0), "a")
    assert s.next().request_id == "a1"
    s.enqueue("b1", P(0), "b")
    s.enqueue("a2", P(0), "a")  # the same score as b1, later: b1 goes first, so a2 waits too
    assert s.next() is None
    s.release("a1")
    assert granted(s) == ["b1"]


def test_higher_scored_work_of_the_loaded_model_goes_before_a_waiting_swap():
    s, _ = make(Slots(2))
    s.enqueue("a1", P(0), "a")
    s.next()
    s.enqueue("b1", P(0), "b")
    s.enqueue("a2", P(100), "a")  # better than the swap: it starts now
    d = s.next()
    assert (d.request_id, d.slots_busy, d.overtook) == ("a2", 2, ("b1",))
    assert s.next() is None


def test_swap_affinity_keeps_a_near_tie_on_the_loaded_model():
    s, _ = make(Slots(2), serial(60, 10))
    s.enqueue("a1", P(0), "a")
    s.next()
    s.enqueue("b1", P(5), "b")
    s.enqueue("a2", P(0), "a")  # 0 + 10 beats 5
    d = s.next()
    assert (d.request_id, d.swap_affinity, d.reordered_by) == ("a2", True, frozenset({"swap_affinity"}))


def test_slots_per_model_apply_to_the_model_that_runs():
    s, clock = make(Slots(1, {"a": 3}))
    for rid, model in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("b1", "b"), ("b2", "b")]:
        s.enqueue(rid, P(0), model)
    assert granted(s) == ["a1", "a2", "a3"]  # a has 3 slots
    assert s.holdings()[0].slots_in_effect == 3
    for rid in ("a1", "a2", "a3"):
        s.release(rid)
    assert granted(s) == ["a4"]  # arrival order, and affinity keeps a loaded
    s.release("a4")
    d = s.next()
    assert (d.request_id, d.swap, s.holdings()[0].slots_in_effect) == ("b1", True, 1)
    assert s.next() is None  # b has the default: one slot
    assert s.holdings()[0].slots_in_effect == 1


def test_the_slots_of_a_failed_model_still_bound_what_runs_beside_it():
    s, _ = make(Slots(4, {"a": 2}))
    for rid, model in [("a1", "a"), ("a2", "a"), ("x", None), ("y", None)]:
        s.enqueue(rid, P(0), model)
    assert granted(s) == ["a1", "a2"]
    s.release("a1", model_loaded=False)  # a is not known to be loaded any more
    assert s.residents_on("gpu0") == frozenset()
    # a2 still runs on a: requests naming no model may use a's slots, not the default's 4.
    assert granted(s) == ["x"]
    assert s.holdings()[0].slots_in_effect == 2


# -- reserved slots ------------------------------------------------------------------------


def test_a_reserved_slot_goes_to_an_interactive_request_behind_a_held_back_batch_job():
    s, clock = make(Slots(2, reserved=1))
    s.enqueue("batch", P(-100), "a")
    assert s.next().request_id == "batch"
    s.enqueue("normal", P(0), "a")
    assert s.next() is None  # non-interactive work has used its one slot
    clock.advance(30)
    s.enqueue("chat", P(100), "a")
    clock.advance(1)
    d = s.next()
    assert (d.request_id, d.band, d.slots_busy, s.holdings()[0].slots_in_effect) == ("chat", Band.INTERACTIVE, 2, 2)
    assert d.reserved_slot is True  # the best request anyway, in the slot the batch job's share could not take
    s.release("chat")
    assert s.next() is None  # normal still waits for the batch job's slot
    s.release("batch")
    assert s.next().request_id == "normal"


def test_an_interactive_request_overtakes_a_better_scored_one_only_through_a_reserved_slot():
    # fifo with a model priority: a normal request can outrank an interactive one.
    s, clock = make(Slots(3, reserved=1), fifo({"a": 0, "vip": 0}))
    s.enqueue("n1", P(0), "a")
    s.enqueue("n2", P(0), "a")
    assert granted(s) == ["n1", "n2"]  # two non-interactive: their share of 3 - 1
    s.reconfigure(fifo({"a": 200}, slots=Slots(3, reserved=1)))
    s.enqueue("n3", P(0), "a")  # 200: the best
    s.enqueue("i1", P(100), None)  # 100: interactive, behind n3
    d = s.next()
    assert (d.request_id, d.reserved_slot, d.slots_busy, d.overtook) == ("i1", True, 3, ("n3",))
    assert s.next() is None  # all 3 busy
    s.release("n1")
    assert s.next().request_id == "n3"


def test_an_interactive_request_that_needs_a_swap_blocks_those_behind_it():
    s, _ = make(Slots(3, reserved=1), serial(0, 0))
    s.enqueue("n1", P(0), "a")
    s.enqueue("n2", P(0), "a")
    assert granted(s) == ["n1", "n2"]
    s.enqueue("n3", P(0), "a")  # held back: non-interactive share used
    s.enqueue("i-b", P(101), "b")  # the best interactive request needs another model
    s.enqueue("i-a", P(100), "a")  # a lower-scored interactive one could run now, but may not overtake it
    # The best overall (i-b, 101) needs a swap: nothing more starts.
    assert s.next() is None
    s.cancel("i-b")
    d = s.next()
    assert (d.request_id, d.reserved_slot) == ("i-a", True)  # now the best, in the slot kept for its band


def test_the_reserved_slot_rule_reads_the_order_without_the_non_interactive_requests():
    s, _ = make(Slots(2, reserved=1), fifo({"a": 300, "b": 300}))
    s.enqueue("n1", P(0), "a")
    assert s.next().request_id == "n1"
    s.enqueue("n2", P(0), "a")  # 300, held back
    s.enqueue("nb", P(0), "b")  # 300, needs a swap, but is non-interactive: it could not use the slot
    s.enqueue("i1", P(100), None)  # 100
    d = s.next()
    assert (d.request_id, d.reserved_slot, d.overtook) == ("i1", True, ("n2", "nb"))


def test_non_interactive_work_never_takes_the_reserved_slots():
    s, _ = make(Slots(4, reserved=2))
    for i in range(4):
        s.enqueue(f"n{i}", P(49), "a")  # 49: the top of the normal band, still not interactive
    assert granted(s) == ["n0", "n1"]
    s.enqueue("i0", P(50), "a")  # 50: the interactive band's floor
    s.enqueue("i1", P(50), "a")
    s.enqueue("i2", P(50), "a")
    assert granted(s) == ["i0", "i1"]
    assert s.slots_busy == 4
    s.release("i0")
    assert granted(s) == ["i2"]  # a freed slot, and non-interactive work has its share: interactive again
    s.release("n0")
    # n1, i1 and i2 run: one non-interactive grant, so n2 may have the free slot (the interactive
    # ones do not shrink the non-interactive share; they only never leave it bigger).
    assert granted(s) == ["n2"]
    assert s.next() is None


# -- the loaded model with several grants --------------------------------------------------


def _two_on_a_after_b(slots: int = 2) -> Scheduler:
    s, _ = make(Slots(slots))
    s.set_residents(frozenset({"b"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.enqueue("g1", P(0), "a")
    s.enqueue("g2", P(0), "a")
    assert granted(s) == ["g1", "g2"]
    assert s.residents_on("gpu0") == frozenset({"a"})
    return s


def test_a_load_no_grant_used_is_undone_when_the_last_of_its_grants_ends():
    s = _two_on_a_after_b()
    s.release("g1", reached_upstream=False)
    assert s.residents_on("gpu0") == frozenset({"a"})  # g2 may still load it
    s.release("g2", reached_upstream=False)
    assert s.residents_on("gpu0") == frozenset({"b"})  # neither reached the upstream: b is still loaded


@pytest.mark.parametrize("order", [("g1", "g2"), ("g2", "g1")])
def test_a_load_one_grant_used_stays(order):
    s = _two_on_a_after_b()
    first, second = order
    s.release(first)
    s.release(second, reached_upstream=False)
    assert s.residents_on("gpu0") == frozenset({"a"})


def test_a_failed_grant_makes_the_loaded_model_unknown_and_the_others_drain_before_a_load():
    s, _ = make(Slots(3))
    s.enqueue("a1", P(0), "a")
    s.enqueue("a2", P(0), "a")
    assert granted(s) == ["a1", "a2"]
    s.release("a1", model_loaded=False)
    assert s.residents_on("gpu0") == frozenset()
    s.enqueue("a3", P(0), "a")
    assert s.next() is None  # from unknown, a is a load: it waits for a2
    # a report while a2 runs is dropped
    assert not s.set_residents(frozenset({"a"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.release("a2")
    d = s.next()
    assert (d.request_id, d.load, d.slots_busy) == ("a3", True, 1)


def test_a_loaded_model_report_applies_only_when_nothing_runs():
    s, _ = make(Slots(2))
    s.enqueue("a1", P(0), "a")
    s.enqueue("a2", P(0), "a")
    granted(s)
    s.release("a1")
    assert not s.set_residents(frozenset({"b"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    s.release("a2")
    assert s.set_residents(frozenset({"b"}), as_of=s.dispatches_on("gpu0"), gpu="gpu0")
    assert s.residents_on("gpu0") == frozenset({"b"})


# -- release, snapshot, reconfigure --------------------------------------------------------


def test_release_ends_exactly_the_named_grant():
    s, _ = make(Slots(3))
    for rid in ("x", "y", "z", "w"):
        s.enqueue(rid, P(0), "a")
    granted(s)
    with pytest.raises(UnknownRequest):
        s.release("w")  # waiting, not running
    with pytest.raises(UnknownRequest):
        s.release("nobody")
    s.release("y")
    with pytest.raises(UnknownRequest):
        s.release("y")  # twice
    assert running(s) == ["x", "z"]
    assert s.is_running("x") and not s.is_running("y") and not s.is_running("w")
    with pytest.raises(SchedulerError):
        s.enqueue("z", P(0), "a")  # running: still known


def test_the_snapshot_lists_every_running_grant():
    s, clock = make(Slots(3))
    s.enqueue("first", P(100), "a")
    clock.advance(2)
    s.next()
    clock.advance(3)
    s.enqueue("second", P(0), None)
    s.next()
    s.enqueue("waiting", P(0), "b")
    clock.advance(4)
    snap = s.snapshot()
    assert [(g.request_id, g.running_s, g.queue_wait_s, g.model_load) for g in snap.grants] == [
        ("first", 7.0, 2.0, True), ("second", 4.0, 0.0, False)]
    assert snap.running == snap.grants[0]
    assert (snap.gpus[0].slots, snap.slots_busy) == (3, 2)
    assert [w.request_id for w in snap.waiting] == ["waiting"]
    s.release("first")
    s.release("second")
    snap = s.snapshot()
    assert (snap.grants, snap.running, snap.slots_busy) == ((), None, 0)


def test_fewer_slots_by_reconfiguration_keep_the_running_grants():
    s, _ = make(Slots(4))
    for i in range(6):
        s.enqueue(f"a{i}", P(0), "a")
    assert granted(s) == ["a0", "a1", "a2", "a3"]
    s.reconfigure(serial(60, 10, slots=Slots(2)))
    assert s.next() is None and s.slots_busy == 4  # nothing taken back, nothing new
    s.release("a0")
    s.release("a1")
    assert s.next() is None  # 2 still run: the new limit
    s.release("a2")
    assert granted(s) == ["a4"]


def test_reserving_slots_by_reconfiguration_applies_to_those_already_waiting():
    s, _ = make(Slots(2))
    s.enqueue("n1", P(0), "a")
    s.next()
    s.enqueue("n2", P(0), "a")
    s.enqueue("i1", P(100), "a")
    s.enqueue("i2", P(90), "a")
    s.reconfigure(serial(60, 10, slots=Slots(3, reserved=2)))
    assert granted(s) == ["i1", "i2"]  # n2 may not take a reserved slot
    assert s.next() is None


# -- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "model", "count", "reserved"), [
    (lambda: Slots(2, reserved=2), None, 2, 2),
    (lambda: Slots(4, {"small": 1}, reserved=1), "small", 1, 1),
    (lambda: Slots(0), None, 0, 0),
    (lambda: Slots(2, {"m": 0}), "m", 0, 0),
    (lambda: Slots(2, reserved=-1), None, 2, -1),
    (lambda: Slots(True), None, True, 0),
    (lambda: Slots(2.5), None, 2.5, 0),  # type: ignore[arg-type]
])
def test_slot_settings_that_cannot_work_are_refused(slots, model, count, reserved):
    with pytest.raises(InvalidSlots) as info:
        slots()
    assert (info.value.model, info.value.slots, info.value.reserved) == (model, count, reserved)
    assert isinstance(info.value, SchedulerError)


def test_the_refusal_says_what_is_wrong():
    with pytest.raises(InvalidSlots, match=r"2 reserved slots leave model 'small' \(2 slots\) none for "
                                           "non-interactive requests: reserve fewer than its slots"):
        Slots(4, {"small": 2}, reserved=2)


def test_slot_settings_answer_per_model():
    slots = Slots(2, {"big": 8}, reserved=1)
    assert (slots.of("big"), slots.of("other"), slots.of(None)) == (8, 2, 2)
    assert not slots.single and Slots().single and Slots(1, {"a": 1}).single and not Slots(1, {"a": 2}).single
    per_model = {"big": 8}
    copied = Slots(2, per_model)
    per_model["big"] = 1
    assert copied.of("big") == 8  # the settings are a picture, not the caller's dict
    assert Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10).gpus == (GpuPolicy("gpu0", Slots()),)
    assert Policy.fifo(model_priorities={}).gpus == (GpuPolicy("gpu0", Slots(1, {}, 0)),)


def test_learnt_slots_lower_the_reservation_to_fit():
    assert Slots.fitted(4, {"a": 2}, 3) == Slots(4, {"a": 2}, 1)
    assert Slots.fitted(1, {}, 1) == Slots(1, {}, 0)
    assert Slots.fitted(4, {}, 1) == Slots(4, {}, 1)


# -- cost ----------------------------------------------------------------------------------


def _lines_per_dispatch(waiting: int, slots: Slots, dispatches: int = 20) -> float:
    """Python lines the core runs per next()+release() with every slot busy (see test_scheduler)."""
    s, _ = make(slots)
    for i in range(waiting):
        s.enqueue(f"r{i}", P([-100, 0, 100][i % 3]), "a")
    granted(s)

    def dispatch() -> None:
        for _ in range(dispatches):
            s.release(next(s.running_ids(), None))
            assert granted(s)

    count = core_lines(dispatch)
    return count / dispatches


@pytest.mark.parametrize("slots", [Slots(4), Slots(4, reserved=2)])
def test_dispatch_cost_with_slots_does_not_grow_with_the_queue(slots):
    small = _lines_per_dispatch(1_000, slots)
    large = _lines_per_dispatch(10_000, slots)
    assert small > 0
    assert large <= 2 * small + 20


def test_the_load_under_way_is_held_until_its_grant_is_released() -> None:
    s, clock = make(Slots(3))
    s.enqueue("a1", P(0), "a")
    loader = s.next()
    assert loader is not None and loader.model_load and loader.ready_at == ("a", loader.granted_ns)
    assert s.holdings()[0].loading == ("a", loader.granted_ns)
    clock.advance(1)
    s.enqueue("a2", P(0), "a")
    beside = s.next()
    assert beside is not None and not beside.model_load and beside.ready_at == ("a", loader.granted_ns)
    s.release("a1")  # the load is over with its grant, whatever a2 still runs
    assert s.holdings()[0].loading is None
    s.enqueue("a3", P(0), "a")
    after = s.next()
    assert after is not None and after.ready_at is None
