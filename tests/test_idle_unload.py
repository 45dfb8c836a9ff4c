"""Idle unloads (issue 48, `core/idle.py`): which resident models fall due, when, and what keeps
one from it, on an injected clock, through the scheduler's record."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llamaswap.core import ManualClock, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.clock import NS_PER_S
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import IdleUnload
from policies import serial


def prio(value: int = 0) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def gpu(name: str = "gpu0", *, max_loaded: int = 3, ttl_s: float = 60.0, per_model: dict[str, float] | None = None,
        pinned: tuple[str, ...] = ()) -> GpuPolicy:
    return GpuPolicy(name, Slots(1, {}, 0), None,
                     Residency(max_loaded, frozenset(pinned), idle=IdleUnload(ttl_s, per_model or {})))


def node(*gpus: GpuPolicy) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    return Scheduler(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus(tuple(gpus)), clock), clock


def serve(scheduler: Scheduler, clock: ManualClock, request_id: str, model: str, run_s: float = 1.0) -> None:
    """One request of ``model`` granted now, run ``run_s``, released."""
    scheduler.enqueue(request_id, prio(), model)
    decision = scheduler.next()
    assert decision is not None and decision.request_id == request_id
    clock.advance(run_s)
    scheduler.release(request_id)


def due_models(scheduler: Scheduler) -> list[tuple[str, str]]:
    return [(idle.gpu, idle.model) for idle in scheduler.idle_unloads().due]


def test_the_idle_time_counts_from_the_last_requests_end() -> None:
    scheduler, clock = node(gpu(ttl_s=60.0))
    serve(scheduler, clock, "r1", "A", run_s=5.0)  # granted at 0, ended at 5
    found = scheduler.idle_unloads()
    assert [(idle.model, idle.since_ns, idle.due_ns) for idle in found.idle] == [("A", 5 * NS_PER_S, 65 * NS_PER_S)]
    assert found.next_ns == 65 * NS_PER_S and found.due == ()
    clock.set_ns(65 * NS_PER_S - 1)
    assert due_models(scheduler) == []
    clock.set_ns(65 * NS_PER_S)
    assert due_models(scheduler) == [("gpu0", "A")]


def test_a_running_request_keeps_its_model_and_its_end_starts_the_count_again() -> None:
    scheduler, clock = node(gpu(ttl_s=10.0))
    serve(scheduler, clock, "r1", "A")
    clock.advance(9.0)
    scheduler.enqueue("r2", prio(), "A")
    assert scheduler.next() is not None
    clock.advance(30.0)  # it runs past the idle time: a running model is not idle
    assert scheduler.idle_unloads().idle == ()
    assert due_models(scheduler) == []
    scheduler.release("r2")
    assert scheduler.idle_unloads().next_ns == clock.now_ns() + 10 * NS_PER_S


def test_a_request_arriving_just_before_due_keeps_the_model_while_it_waits() -> None:
    scheduler, clock = node(gpu(max_loaded=1, ttl_s=10.0))
    serve(scheduler, clock, "a1", "A")  # ends at 1: due at 11
    scheduler.enqueue("b1", prio(), "B")
    assert scheduler.next() is not None  # B replaces A (room for one)
    clock.set_ns(5 * NS_PER_S)
    scheduler.release("b1")  # B idle from 5: due at 15
    clock.set_ns(15 * NS_PER_S - 1)
    scheduler.enqueue("b2", prio(), "B")  # waits (nothing granted yet)
    clock.set_ns(20 * NS_PER_S)
    found = scheduler.idle_unloads()
    assert found.due == () and found.idle == () and found.next_ns is None  # waited for: neither idle nor due
    scheduler.cancel("b2")
    assert due_models(scheduler) == [("gpu0", "B")]


def test_a_waiting_request_of_no_model_or_a_kept_place_holds_every_idle_unload() -> None:
    scheduler, clock = node(gpu(ttl_s=1.0))
    serve(scheduler, clock, "a1", "A")
    clock.advance(2.0)
    assert due_models(scheduler) == [("gpu0", "A")]
    scheduler.enqueue("anything", prio(), None)
    # (With nothing running, it would start at once: here it only waits to be asked.)
    assert due_models(scheduler) == []
    scheduler.cancel("anything")
    scheduler.enqueue("a2", prio(), "A")
    assert scheduler.keep("a2", b"retry", 30 * NS_PER_S) is not None
    assert due_models(scheduler) == []  # its retry is expected
    assert [place.request_id for place in scheduler.expire_kept()] == []
    clock.advance(31.0)
    assert [place.request_id for place in scheduler.expire_kept()] == ["a2"]
    assert due_models(scheduler) == [("gpu0", "A")]


def test_a_pinned_model_and_a_zero_ttl_are_never_due() -> None:
    scheduler, clock = node(gpu(max_loaded=4, ttl_s=5.0, per_model={"B": 0.0, "C": 2.0}, pinned=("P",)))
    for request_id, model in (("a", "A"), ("b", "B"), ("c", "C"), ("p", "P")):
        serve(scheduler, clock, request_id, model, run_s=0.0)
    clock.advance(1000.0)
    found = scheduler.idle_unloads()
    assert {idle.model: idle.due_ns for idle in found.idle} == {
        "A": 5 * NS_PER_S, "B": None, "C": 2 * NS_PER_S, "P": None}
    assert sorted(model for _, model in due_models(scheduler)) == ["A", "C"]


def test_no_ttl_means_never() -> None:
    scheduler, clock = node(gpu(ttl_s=0.0))
    serve(scheduler, clock, "a", "A")
    clock.advance(10**6)
    found = scheduler.idle_unloads()
    assert [idle.due_ns for idle in found.idle] == [None] and found.due == () and found.next_ns is None


def test_a_reported_model_counts_from_its_report_and_an_unload_counts_it_gone() -> None:
    scheduler, clock = node(gpu(ttl_s=10.0))
    clock.set_ns(100 * NS_PER_S)
    assert scheduler.set_residents(frozenset({"A"}), as_of=0, gpu="gpu0")
    assert scheduler.idle_unloads().next_ns == 110 * NS_PER_S
    clock.set_ns(110 * NS_PER_S)
    assert due_models(scheduler) == [("gpu0", "A")]
    scheduler.unload_idle("gpu0", frozenset({"A"}))
    assert scheduler.residents_on("gpu0") == frozenset()
    assert scheduler.idle_unloads() == ((), (), None)
    # Its next request is a load again.
    scheduler.enqueue("a", prio(), "A")
    decision = scheduler.next()
    assert decision is not None and decision.load


def test_an_unload_that_failed_is_tried_again_a_whole_idle_time_later() -> None:
    scheduler, clock = node(gpu(ttl_s=10.0))
    serve(scheduler, clock, "a", "A")
    clock.advance(10.0)
    assert due_models(scheduler) == [("gpu0", "A")]
    scheduler.unload_idle("gpu0", frozenset({"A"}))
    clock.advance(3.0)
    scheduler.not_unloaded("gpu0", frozenset({"A"}))
    found = scheduler.idle_unloads()
    assert found.due == () and found.next_ns == clock.now_ns() + 10 * NS_PER_S


def test_a_gpu_whose_upstream_cannot_unload_shows_its_idle_models_never_due() -> None:
    scheduler, clock = node(gpu("gpu0", ttl_s=1.0), gpu("gpu1", ttl_s=1.0))
    scheduler.set_residents(frozenset({"A"}), as_of=0, gpu="gpu0")
    scheduler.set_residents(frozenset({"B"}), as_of=0, gpu="gpu1")
    clock.advance(5.0)
    found = scheduler.idle_unloads(gpus={"gpu1"})
    assert [(idle.gpu, idle.due_ns) for idle in found.idle] == [("gpu0", None), ("gpu1", NS_PER_S)]
    assert [(idle.gpu, idle.model) for idle in found.due] == [("gpu1", "B")]


def test_a_settle_or_an_adopted_exchange_holds_the_idle_unload() -> None:
    scheduler, clock = node(gpu(ttl_s=1.0))
    serve(scheduler, clock, "a", "A")
    clock.advance(5.0)
    scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model="A")
    assert due_models(scheduler) == []
    scheduler.blocked_by("gpu0", settling=False, adopted=1)
    assert due_models(scheduler) == []
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    assert due_models(scheduler) == [("gpu0", "A")]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("AB"), st.integers(0, 30), st.integers(0, 5)), min_size=1, max_size=12),
       st.integers(1, 20))
def test_no_request_is_delayed_by_an_idle_unload_beyond_its_load(
        arrivals: list[tuple[str, int, int]], ttl_s: int) -> None:
    """Whatever the traffic: an idle unload only ever takes a model that nothing runs on, nothing
    waits for and that sat idle its whole ttl; a request that arrives later is granted at once
    (a load, as after any unload: the unload's own time is all it can cost)."""
    scheduler, clock = node(gpu(max_loaded=2, ttl_s=float(ttl_s)))
    now = 0
    for number, (model, gap_s, run_s) in enumerate(arrivals):
        now += gap_s
        # The idle unloads that fall due before this arrival happen, each at its due time.
        while True:
            found = scheduler.idle_unloads()
            for idle in found.due:
                assert idle.due_ns is not None and clock.now_ns() - idle.since_ns >= ttl_s * NS_PER_S
                assert scheduler.holding_of(idle.gpu).running.busy == 0 and scheduler.depth == 0
                scheduler.unload_idle(idle.gpu, frozenset({idle.model}))
            if found.next_ns is None or found.next_ns > now * NS_PER_S:
                break
            clock.set_ns(found.next_ns)
        clock.set_ns(now * NS_PER_S)
        request_id = f"r{number}"
        scheduler.enqueue(request_id, prio(), model)
        decision = scheduler.next()
        assert decision is not None and decision.request_id == request_id  # nothing ever delays it
        assert ("gpu0", model) not in due_models(scheduler)  # its model runs: never due meanwhile
        clock.advance(run_s)
        now = clock.now_ns() // NS_PER_S
        scheduler.release(request_id)
