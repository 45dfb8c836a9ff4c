"""Several models resident on one GPU (issue 37): the rule, exactly (`dispatch.turn`'s ROOM and
EVICT, `node.claim_on`'s held-back model, the grant's evictions), and the estimates' walk that
must say the same."""

from __future__ import annotations

import pytest

from llamaswap.core import (
    Estimator,
    EvictReason,
    ManualClock,
    Priority,
    PrioritySource,
    Residency,
    Scheduler,
    Slots,
)
from llamaswap.core.estimate_node import starts_of_node
from llamaswap.core.policy import GpuPolicy
from policies import serial


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def gpu(name: str = "gpu0", *, max_loaded: int = 3, slots: int = 1, per_model: dict[str, int] | None = None,
        pinned: tuple[str, ...] = (), memory: int | None = None, sizes: dict[str, int] | None = None,
        reserved: int = 0) -> GpuPolicy:
    return GpuPolicy(name, Slots(slots, per_model or {}, reserved), None,
                     Residency(max_loaded, frozenset(pinned), memory, sizes or {}))


def node(*gpus: GpuPolicy, bonus: int = 0) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    return Scheduler(serial(aging_divisor_s=0.0, swap_affinity_bonus=bonus).with_gpus(tuple(gpus)), clock), clock


def grant_all(scheduler: Scheduler) -> list[str]:
    made = []
    while (decision := scheduler.next()) is not None:
        made.append(decision.request_id)
    return made


def test_a_second_model_loads_beside_the_first_while_it_runs() -> None:
    scheduler, _ = node(gpu(max_loaded=3))
    scheduler.enqueue("chat", prio(10), "A")
    scheduler.enqueue("embed", prio(5), "B")
    first, second = scheduler.next(), scheduler.next()
    assert first is not None and second is not None
    assert (first.request_id, first.load, first.swap) == ("chat", True, False)
    # B loads at once beside A's work: no drain, nothing evicted.
    assert (second.request_id, second.load, second.swap, second.evicts) == ("embed", True, False, ())
    assert scheduler.residents_on("gpu0") == frozenset({"A", "B"})
    assert scheduler.slots_busy == 2


def test_with_one_model_resident_at_a_time_the_second_waits_for_the_drain() -> None:
    scheduler, _ = node(gpu(max_loaded=1))
    scheduler.enqueue("chat", prio(10), "A")
    scheduler.enqueue("embed", prio(5), "B")
    assert grant_all(scheduler) == ["chat"]
    scheduler.release("chat")
    decision = scheduler.next()
    assert decision is not None and decision.swap and decision.evicts == ()
    assert scheduler.residents_on("gpu0") == frozenset({"B"})


def test_a_resident_model_starts_in_its_own_free_slot_beside_another_models_work() -> None:
    scheduler, _ = node(gpu(max_loaded=2, per_model={"A": 2, "B": 1}))
    for request_id, model in (("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B"), ("a3", "A")):
        scheduler.enqueue(request_id, prio(0), model)
    # A has two slots, B one: a1, b1 and a2 run together; b2 and a3 wait for their own model's slot.
    assert grant_all(scheduler) == ["a1", "b1", "a2"]
    scheduler.release("b1")
    assert grant_all(scheduler) == ["b2"]  # B's slot, not A's
    scheduler.release("a1")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "a3" and not decision.model_load


def test_no_room_evicts_the_idle_model_the_queue_needs_least() -> None:
    scheduler, clock = node(gpu(max_loaded=3))
    for request_id, model in (("a", "A"), ("b", "B"), ("c", "C")):
        scheduler.enqueue(request_id, prio(0), model)
    assert grant_all(scheduler) == ["a", "b", "c"]
    scheduler.release("b")
    scheduler.release("c")
    clock.advance(1.0)
    scheduler.enqueue("b-later", prio(1), "B")  # something waits for B: C is needed least
    scheduler.enqueue("a-more", prio(0), "A")
    scheduler.enqueue("d", prio(50), "D")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "d"
    assert decision.evicts == ((("C", EvictReason.NOT_WAITED_FOR)),)
    assert decision.swap and not decision.load
    assert scheduler.residents_on("gpu0") == frozenset({"A", "B", "D"})


def test_equally_needed_idle_models_go_least_recently_used_first() -> None:
    scheduler, clock = node(gpu(max_loaded=3))
    # Granted a second apart, C first (so its name, after B's, cannot be what decides).
    for request_id, model in (("c", "C"), ("b", "B"), ("a", "A")):
        scheduler.enqueue(request_id, prio(0), model)
        assert grant_all(scheduler) == [request_id]
        clock.advance(1.0)
    for request_id in ("b", "c"):
        scheduler.release(request_id)
    scheduler.enqueue("d", prio(9), "D")
    decision = scheduler.next()
    assert decision is not None
    # Neither B nor C is waited for; C was granted first (used longer ago): C goes.
    assert decision.evicts == (("C", EvictReason.LEAST_RECENTLY_USED),)


def test_a_model_waited_for_at_a_lower_score_goes_before_one_waited_for_higher() -> None:
    scheduler, _ = node(gpu(max_loaded=3))
    for request_id, model in (("b", "B"), ("c", "C"), ("a", "A")):
        scheduler.enqueue(request_id, prio(0), model)
    grant_all(scheduler)
    scheduler.release("b")
    scheduler.release("c")
    scheduler.enqueue("d", prio(90), "D")
    scheduler.enqueue("for-b", prio(5), "B")
    scheduler.enqueue("for-c", prio(7), "C")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "d"
    assert decision.evicts == (("B", EvictReason.LEAST_NEEDED),)


def test_a_pinned_model_is_never_evicted() -> None:
    scheduler, _ = node(gpu(max_loaded=2, pinned=("E",)))
    scheduler.enqueue("e", prio(0), "E")
    scheduler.enqueue("b", prio(0), "B")
    grant_all(scheduler)
    scheduler.release("e")
    scheduler.release("b")
    scheduler.enqueue("for-b", prio(80), "B")  # B is needed more than E, yet E stays
    scheduler.enqueue("c", prio(90), "C")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "c"
    assert [eviction.model for eviction in decision.evicts] == ["B"]
    assert scheduler.residents_on("gpu0") == frozenset({"E", "C"})


def test_a_model_that_can_never_fit_beside_the_pinned_ones_is_not_served_there() -> None:
    scheduler, _ = node(gpu("gpu0", max_loaded=2, pinned=("E", "F")), gpu("gpu1", max_loaded=2))
    scheduler.enqueue("c", prio(0), "C")
    decision = scheduler.next()
    assert decision is not None and decision.gpu == "gpu1"


def test_every_candidate_busy_the_best_holds_back_only_the_model_chosen_to_go() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    scheduler.enqueue("b1", prio(0), "B")
    scheduler.enqueue("a-more", prio(0), "A")
    assert grant_all(scheduler) == ["a1", "b1", "a-more"]  # A full (two slots), B has one free
    scheduler.enqueue("c", prio(90), "C")  # no room, A and B both busy
    scheduler.enqueue("b2", prio(5), "B")
    scheduler.enqueue("a2", prio(10), "A")
    # The queue needs B least (its best waits at 5, A's at 10): B is held back for C, and its
    # free slot is not given to b2.
    assert grant_all(scheduler) == []
    assert scheduler.held_back == {"gpu0": "B"}
    assert scheduler.snapshot().gpus[0].held_back == "B"
    scheduler.release("a1")
    assert grant_all(scheduler) == ["a2"]  # A serves on
    scheduler.release("b1")  # B drained: it goes, C loads
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "c"
    assert decision.evicts == (("B", EvictReason.LEAST_NEEDED),)
    assert scheduler.residents_on("gpu0") == frozenset({"A", "C"})
    assert scheduler.held_back == {}


def test_only_the_best_holds_a_model_back() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    scheduler.enqueue("b1", prio(0), "B")
    grant_all(scheduler)
    scheduler.enqueue("c", prio(90), "C")  # holds back B: a2 stands before b2 in the order
    scheduler.enqueue("d", prio(80), "D")  # needs room too, holds nothing back
    scheduler.enqueue("a2", prio(1), "A")
    scheduler.enqueue("b2", prio(1), "B")
    # A serves on, B does not; once A has nothing waiting, the hold stays on B all the same
    # (a hold that moved would let both take new work in turn, and C wait for ever).
    assert grant_all(scheduler) == ["a2"]
    assert scheduler.held_back == {"gpu0": "B"}


def test_a_request_waiting_for_its_own_models_slot_holds_back_only_that_model() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=1))
    scheduler.enqueue("a1", prio(0), "A")
    scheduler.enqueue("b1", prio(0), "B")
    grant_all(scheduler)
    scheduler.release("b1")
    scheduler.enqueue("a-best", prio(50), "A")  # A is full: it waits for A's slot
    scheduler.enqueue("b2", prio(1), "B")
    assert grant_all(scheduler) == ["b2"]  # B serves on
    assert scheduler.held_back == {"gpu0": "A"}


def test_a_memory_budget_evicts_as_many_idle_models_as_the_load_needs() -> None:
    sizes = {"A": 4, "B": 3, "C": 3, "D": 6}
    scheduler, _ = node(gpu(max_loaded=4, memory=10, sizes=sizes))
    for request_id, model in (("a", "A"), ("b", "B"), ("c", "C")):
        scheduler.enqueue(request_id, prio(0), model)
    assert grant_all(scheduler) == ["a", "b", "c"]  # 10 of 10
    scheduler.release("b")
    scheduler.release("c")
    scheduler.enqueue("d", prio(9), "D")  # 6: B and C must both go
    decision = scheduler.next()
    assert decision is not None
    assert sorted(eviction.model for eviction in decision.evicts) == ["B", "C"]
    assert scheduler.residents_on("gpu0") == frozenset({"A", "D"})


def test_a_request_that_runs_alone_waits_for_every_model_to_drain() -> None:
    scheduler, _ = node(gpu(max_loaded=2))
    scheduler.enqueue("a", prio(0), "A")
    grant_all(scheduler)
    scheduler.enqueue("unload-b", prio(50), "B", alone=True)
    scheduler.enqueue("b", prio(0), "B")
    assert grant_all(scheduler) == []  # the unload is best: the GPU drains for it
    scheduler.release("a")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "unload-b" and decision.alone
    assert scheduler.next() is None  # nothing beside it


def test_a_failed_answer_keeps_its_model_counted_until_the_upstream_says() -> None:
    scheduler, _ = node(gpu(max_loaded=3))
    scheduler.enqueue("a", prio(0), "A")
    scheduler.enqueue("b", prio(0), "B")
    grant_all(scheduler)
    # A 5xx of B says nothing sure of what the router holds: counting B keeps a later load from
    # making the router evict by itself (one model too many would).
    scheduler.release("b", model_loaded=False)
    assert scheduler.residents_on("gpu0") == frozenset({"A", "B"})
    scheduler.release("a")
    assert scheduler.set_residents(frozenset({"A"}), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")
    assert scheduler.residents_on("gpu0") == frozenset({"A"})


def test_a_load_keeps_its_own_models_users_only() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    grant_all(scheduler)
    scheduler.release("a1")  # A confirmed
    scheduler.enqueue("a2", prio(0), "A")
    scheduler.enqueue("c1", prio(0), "C")
    scheduler.enqueue("a3", prio(0), "A")
    assert grant_all(scheduler) == ["a2", "c1", "a3"]
    # c1 loaded C; a3, granted beside that load, is no user of it: neither c1 nor a3 reaching
    # the upstream must not drop A.
    scheduler.release("c1", reached_upstream=False)
    scheduler.release("a3", reached_upstream=False)
    assert scheduler.residents_on("gpu0") == frozenset({"A"})


def test_a_grant_of_a_model_whose_load_is_under_way_is_granted_beside_that_load() -> None:
    scheduler, _ = node(gpu(max_loaded=3, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    scheduler.enqueue("b1", prio(0), "B")
    scheduler.enqueue("c1", prio(0), "C")
    scheduler.enqueue("b2", prio(0), "B")
    made = []
    while (decision := scheduler.next()) is not None:
        made.append(decision)
    b1, b2 = made[1], made[3]
    assert b2.request_id == "b2" and not b2.model_load
    # Its run begins once B's load ends, whatever loads began on the GPU after B's.
    assert b2.ready_at == ("B", b1.granted_ns)


@pytest.mark.parametrize(("reached", "expected"), [(False, {"A"}), (True, {"A", "B"})])
def test_an_unconfirmed_load_stays_counted_where_it_reached_the_upstream(reached: bool, expected: set[str]) -> None:
    scheduler, _ = node(gpu(max_loaded=3))
    scheduler.enqueue("a", prio(0), "A")
    scheduler.enqueue("b", prio(0), "B")
    grant_all(scheduler)
    scheduler.release("a")
    scheduler.release("b", model_loaded=None, reached_upstream=reached)
    assert scheduler.residents_on("gpu0") == frozenset(expected)


def test_several_gpus_prefer_the_resident_model_then_room_then_an_eviction() -> None:
    scheduler, _ = node(gpu("gpu0", max_loaded=2, slots=2), gpu("gpu1", max_loaded=2, slots=2))
    for request_id, model in (("a", "A"), ("b", "B"), ("c", "C")):
        scheduler.enqueue(request_id, prio(10 - len(request_id)), model)
    made = []
    while (decision := scheduler.next()) is not None:
        made.append((decision.request_id, decision.gpu, decision.evicts))
    # a on gpu0 (both idle: the first); b loads where it has room beside nothing (gpu1 is idle);
    # c has room beside a on gpu0 (the less busy of the two with room).
    assert [upstream for _, upstream, _ in made] == ["gpu0", "gpu1", "gpu0"]
    assert all(evicts == () for *_, evicts in made)
    scheduler.enqueue("a2", prio(0), "A")
    decision = scheduler.next()
    assert decision is not None and decision.gpu == "gpu0" and not decision.model_load


def test_a_gpu_with_room_goes_before_a_less_busy_one_where_a_model_must_go() -> None:
    scheduler, _ = node(gpu("gpu0", max_loaded=2, slots=2), gpu("gpu1", max_loaded=2, slots=2))
    assert scheduler.set_residents(frozenset({"X", "Y"}), as_of=0, gpu="gpu1")
    scheduler.enqueue("a", prio(0), "A")
    first = scheduler.next()
    assert first is not None and first.gpu == "gpu0"  # nothing to evict there
    scheduler.enqueue("b", prio(0), "B")
    decision = scheduler.next()
    # gpu0 runs a but has room for B; gpu1 is idle, but X or Y would have to go: room first.
    assert decision is not None and (decision.gpu, decision.evicts) == ("gpu0", ())
    assert scheduler.residents_on("gpu1") == frozenset({"X", "Y"})


def test_the_estimates_start_a_load_beside_running_work_now() -> None:
    scheduler, _ = node(gpu(max_loaded=2))
    scheduler.enqueue("a", prio(10), "A")
    grant_all(scheduler)
    scheduler.enqueue("b", prio(5), "B")
    scheduler.enqueue("a2", prio(1), "A")
    estimator = Estimator(default_run_s=10.0, default_swap_s=2.0, samples=3)
    holdings = scheduler.holdings()
    starts = starts_of_node(estimator, scheduler.snapshot(), holdings)
    # b loads beside a at once; a2 waits for a's one slot (a's load, 2 s, and its run, 10 s).
    assert starts[0] == (0.0, "gpu0")
    assert starts[1][0] == pytest.approx(12.0)


def test_the_estimates_and_the_grants_agree_on_an_eviction() -> None:
    scheduler, clock = node(gpu(max_loaded=2))
    scheduler.enqueue("a", prio(10), "A")
    scheduler.enqueue("b", prio(5), "B")
    grant_all(scheduler)
    scheduler.enqueue("c", prio(50), "C")
    estimator = Estimator(default_run_s=10.0, default_swap_s=2.0, samples=3)
    starts = starts_of_node(estimator, scheduler.snapshot(), scheduler.holdings())
    # Both busy: C waits for one to drain (each its load, 2 s, and its run, 10 s), then loads.
    assert starts[0][0] == pytest.approx(12.0)
    clock.advance(12.0)
    scheduler.release("a")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "c"
    assert decision.evicts[0].model == scheduler.held_back.get("gpu0", "A")


def test_a_report_beside_running_work_is_accepted_if_it_names_what_runs() -> None:
    scheduler, _ = node(gpu(max_loaded=3))
    scheduler.enqueue("a", prio(0), "A")
    scheduler.enqueue("b", prio(0), "B")
    grant_all(scheduler)
    as_of = scheduler.dispatches_on("gpu0")
    # Loads under way (a and b loaded their models, unconfirmed): no report applies yet.
    assert not scheduler.set_residents(frozenset({"A", "B", "X"}), as_of=as_of, gpu="gpu0")
    scheduler.release("b")
    scheduler.release("a")
    scheduler.enqueue("a2", prio(0), "A")
    grant_all(scheduler)  # runs on A, loads nothing
    as_of = scheduler.dispatches_on("gpu0")
    assert not scheduler.set_residents(frozenset({"B"}), as_of=as_of, gpu="gpu0")  # A runs: not gone
    assert scheduler.set_residents(frozenset({"A", "C"}), as_of=as_of, gpu="gpu0")
    assert scheduler.residents_on("gpu0") == frozenset({"A", "C"})


def test_one_model_at_a_time_drops_every_report_made_while_a_request_runs() -> None:
    scheduler, _ = node(gpu(max_loaded=1))
    scheduler.enqueue("a", prio(0), "A")
    grant_all(scheduler)
    scheduler.release("a")
    scheduler.enqueue("a2", prio(0), "A")
    grant_all(scheduler)
    assert not scheduler.set_residents(frozenset({"A"}), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")


def test_a_full_gpu_still_says_which_model_the_best_holds_back() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=1))
    scheduler.enqueue("a", prio(0), "A")
    scheduler.enqueue("b", prio(0), "B")
    grant_all(scheduler)  # both models' one slot taken: the GPU takes nothing
    scheduler.enqueue("for-a", prio(1), "A")
    scheduler.enqueue("c", prio(50), "C")
    assert scheduler.next() is None
    assert scheduler.held_back == {"gpu0": "B"}  # nothing waits for B
    assert scheduler.snapshot().gpus[0].held_back == "B"


def test_a_load_that_needs_two_models_gone_holds_both_back() -> None:
    sizes = {"A": 40, "B": 40, "M": 70}
    scheduler, _ = node(gpu(max_loaded=3, memory=100, sizes=sizes))
    scheduler.enqueue("a0", prio(0), "A")
    scheduler.enqueue("b0", prio(0), "B")
    grant_all(scheduler)
    scheduler.enqueue("m", prio(50), "M")  # 70: both A and B must go
    for number in (1, 2):
        scheduler.enqueue(f"a{number}", prio(0), "A")
        scheduler.enqueue(f"b{number}", prio(0), "B")
    scheduler.release("a0")
    # A is idle but counted on to go: lower work must not take it back (it would, turn by turn
    # with B, for ever).
    assert grant_all(scheduler) == []
    scheduler.release("b0")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "m"
    assert sorted(eviction.model for eviction in decision.evicts) == ["A", "B"]


def test_an_eviction_keeps_the_models_the_load_turns_out_not_to_need_gone() -> None:
    sizes = {"S": 10, "L": 60, "M": 50}
    scheduler, clock = node(gpu(max_loaded=3, memory=100, sizes=sizes))
    # Granted a second apart, so S is the least recently used (not by its name: L's comes first).
    for request_id, model in (("s", "S"), ("l", "L")):
        scheduler.enqueue(request_id, prio(0), model)
        assert grant_all(scheduler) == [request_id]
        clock.advance(1.0)
    scheduler.release("s")
    scheduler.release("l")
    scheduler.enqueue("m", prio(0), "M")  # S goes first (used longer ago), but L alone is enough
    decision = scheduler.next()
    assert decision is not None and [eviction.model for eviction in decision.evicts] == ["L"]
    assert scheduler.residents_on("gpu0") == frozenset({"S", "M"})


def test_a_settle_of_one_model_holds_that_model_only() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    scheduler.enqueue("b1", prio(0), "B")
    grant_all(scheduler)
    scheduler.release("a1")
    scheduler.release("b1")
    scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model="A")  # A's abandoned generation
    scheduler.enqueue("a2", prio(9), "A")
    scheduler.enqueue("b2", prio(0), "B")
    scheduler.enqueue("c1", prio(0), "C")
    # A waits for its settle; B serves on; C may not evict A (its generation still computes) and
    # B runs: C waits.
    assert grant_all(scheduler) == ["b2"]
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    assert grant_all(scheduler) == ["a2"]


def test_a_settle_of_an_unknown_model_holds_the_whole_gpu() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    grant_all(scheduler)
    scheduler.release("a1")
    scheduler.blocked_by("gpu0", settling=True, adopted=0)
    scheduler.enqueue("b1", prio(0), "B")
    scheduler.enqueue("a2", prio(0), "A")
    scheduler.enqueue("n1", prio(0), None)
    assert grant_all(scheduler) == []


def test_with_room_for_one_model_a_settle_of_it_holds_it_as_with_room_for_more() -> None:
    """One rule (issue 45): a settle of a known model holds that model, whatever the room. With
    room for one, no other model may load (the settling one cannot go), and a request of no
    model starts beside it, as where there is room for more (the old one-model form held the
    whole GPU). The runtime tells a settle of the whole GPU where the upstream replaces its one
    model by itself (`Residency.replaces_by_itself`): tests/test_coordinator.py's
    test_no_grant_until_the_upstream_is_idle."""
    scheduler, _ = node(gpu(max_loaded=1, slots=2))
    scheduler.enqueue("a1", prio(0), "A")
    grant_all(scheduler)
    scheduler.release("a1")
    scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model="A")
    scheduler.enqueue("n1", prio(9), None)
    scheduler.enqueue("b1", prio(0), "B")
    assert grant_all(scheduler) == ["n1"]  # (b1 waits: A cannot go)
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    assert grant_all(scheduler) == []  # n1 runs on A's slot: A is busy, b1 waits for the drain
    scheduler.release("n1")
    assert grant_all(scheduler) == ["b1"]


def test_a_load_that_needs_the_settling_model_gone_waits_though_nothing_runs() -> None:
    """Found by the one rule (issue 45): with nothing running, a load that needs the settling model
    gone (the pinned one cannot go either) waits for the settle; the rule said IDLE and the grant
    failed its own check that a load has room or idle models to evict."""
    scheduler, _ = node(gpu(max_loaded=2, slots=1, pinned=("B",)))
    assert scheduler.set_residents(frozenset({"A", "B"}), as_of=0, gpu="gpu0")
    scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model="A")
    scheduler.enqueue("c1", prio(0), "C")
    assert grant_all(scheduler) == []
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    assert grant_all(scheduler) == ["c1"]


def test_the_order_counts_a_load_past_busy_models_as_evicting_once_they_drain() -> None:
    """One rule (issue 45): the dispatch order (snapshot) follows a load with the residents after
    it. Where every resident model is busy, the victims are those once they drain (by recency
    here), as with room for one model, where the load replaces the busy one; the several-model
    form counted the loaded model beside all of them, past maxLoaded, so a request of the model
    that goes still got the swap-affinity bonus."""
    scheduler, clock = node(gpu(max_loaded=2, slots=1), bonus=10)
    scheduler.enqueue("a1", prio(0), "A")
    assert grant_all(scheduler) == ["a1"]
    clock.advance(1.0)
    scheduler.enqueue("b1", prio(0), "B")
    assert grant_all(scheduler) == ["b1"]  # beside A: room for two
    scheduler.enqueue("c1", prio(100), "C")
    scheduler.enqueue("a2", prio(0), "A")
    scheduler.enqueue("b2", prio(0), "B")
    waiting = scheduler.snapshot().waiting
    assert [(view.request_id, view.swap_affinity) for view in waiting] == [
        ("c1", False), ("b2", True), ("a2", False)]  # A, used longer ago, goes for C
