"""Stopping Batch API lines for a higher band (issue 46, `core/preemption.py`): which running
grants the best waiting request has stopped, exactly, on an injected clock."""

from __future__ import annotations

import dataclasses

from llamaswap.core import ManualClock, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.preemption import Stop
from llamaswap.core.priority import Band
from policies import serial

BATCH, NORMAL, PERSON = -100, 0, 100
NS = 1_000_000_000


def prio(value: int) -> Priority:
    return Priority(value, PrioritySource.NUMBER)


def gpu(name: str = "gpu0", *, max_loaded: int = 1, slots: int = 1) -> GpuPolicy:
    return GpuPolicy(name, Slots(slots), None, Residency(max_loaded))


def node(*gpus: GpuPolicy, min_run_s: float = 0.0) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    policy = dataclasses.replace(serial(aging_divisor_s=0.0, swap_affinity_bonus=0).with_gpus(tuple(gpus)),
                                 stop_min_run_s=min_run_s)
    return Scheduler(policy, clock), clock


def granted(scheduler: Scheduler) -> list[str]:
    made = []
    while (decision := scheduler.next()) is not None:
        made.append(decision.request_id)
    return made


def stopped(scheduler: Scheduler) -> list[str]:
    return [stop.request_id for stop in scheduler.stops()]


def test_a_person_stops_the_batch_line_that_holds_the_one_slot_and_takes_it_once_it_has_let_go() -> None:
    scheduler, clock = node(gpu())
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    assert granted(scheduler) == ["line"]
    clock.advance(3.0)
    scheduler.enqueue("person", prio(PERSON), "A")
    assert granted(scheduler) == []
    assert scheduler.stops() == [Stop("line", "gpu0", Band.BATCH, "person", Band.INTERACTIVE)]
    assert granted(scheduler) == [] and scheduler.stops() == []  # ordered once, not again
    scheduler.release("line", keep_as=b"line-1", grace_ns=60 * NS)
    assert granted(scheduler) == ["person"]


def test_a_stopped_line_comes_back_to_its_first_arrival_and_order() -> None:
    scheduler, clock = node(gpu())
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    first_arrival = clock.now_ns()
    granted(scheduler)
    clock.advance(1.0)
    scheduler.enqueue("later-line", prio(BATCH), "A", stoppable=True)
    scheduler.enqueue("person", prio(PERSON), "A")
    granted(scheduler)
    assert stopped(scheduler) == ["line"]
    scheduler.release("line", keep_as=b"line-1", grace_ns=60 * NS)
    assert granted(scheduler) == ["person"]
    clock.advance(1.0)
    queued = scheduler.enqueue("line-resumed", prio(BATCH), "A", retry_key=b"line-1", stoppable=True)
    assert queued.arrival_ns == first_arrival and queued.taken is not None
    scheduler.release("person")
    assert granted(scheduler) == ["line-resumed"]  # ahead of the line that arrived after it first


def test_only_grants_marked_stoppable_and_of_a_lower_band_are_stopped() -> None:
    scheduler, _ = node(gpu(slots=2))
    scheduler.enqueue("client-batch", prio(BATCH), "A")  # a client's own request: never stopped
    scheduler.enqueue("normal-line", prio(NORMAL), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("normal-request", prio(NORMAL), "A")  # the same band as the line
    assert granted(scheduler) == [] and scheduler.stops() == []
    scheduler.enqueue("person", prio(PERSON), "A")
    granted(scheduler)
    assert stopped(scheduler) == ["normal-line"]


def test_a_resumed_line_runs_its_minimum_before_it_is_stopped_again_and_a_first_part_at_once() -> None:
    scheduler, clock = node(gpu(), min_run_s=5.0)
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("person-1", prio(PERSON), "A")
    granted(scheduler)
    assert stopped(scheduler) == ["line"]  # its first part: at once
    scheduler.release("line", keep_as=b"line-1", grace_ns=60 * NS)
    assert granted(scheduler) == ["person-1"]
    scheduler.enqueue("line-resumed", prio(BATCH), "A", retry_key=b"line-1", stoppable=True)
    scheduler.release("person-1")
    assert granted(scheduler) == ["line-resumed"]
    clock.advance(4.0)
    scheduler.enqueue("person-2", prio(PERSON), "A")
    assert granted(scheduler) == [] and scheduler.stops() == []  # resumed 4 s ago: not yet
    clock.advance(1.0)
    assert granted(scheduler) == []
    assert stopped(scheduler) == ["line-resumed"]


def test_of_a_model_s_lines_the_one_that_ran_least_is_stopped() -> None:
    scheduler, clock = node(gpu(slots=2))
    scheduler.enqueue("old-line", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    clock.advance(10.0)
    scheduler.enqueue("new-line", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    clock.advance(1.0)
    scheduler.enqueue("person", prio(PERSON), "A")
    granted(scheduler)
    assert stopped(scheduler) == ["new-line"]


def test_a_load_for_a_person_stops_every_line_of_the_model_that_must_go() -> None:
    scheduler, _ = node(gpu(slots=2))
    for name in ("line-1", "line-2"):
        scheduler.enqueue(name, prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("person", prio(PERSON), "B")
    granted(scheduler)
    assert sorted(stopped(scheduler)) == ["line-1", "line-2"]
    scheduler.release("line-1")
    assert granted(scheduler) == []  # B waits for A's last line
    scheduler.release("line-2")
    decision = scheduler.next()
    assert decision is not None and (decision.request_id, decision.swap) == ("person", True)


def test_a_model_a_client_s_request_runs_on_is_never_drained_by_stops() -> None:
    scheduler, _ = node(gpu(slots=2))
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    scheduler.enqueue("client", prio(BATCH), "A")
    granted(scheduler)
    scheduler.enqueue("person", prio(PERSON), "B")
    assert granted(scheduler) == [] and scheduler.stops() == []


def test_where_several_models_are_resident_the_fewest_lines_go() -> None:
    scheduler, _ = node(gpu(max_loaded=2, slots=1))
    scheduler.enqueue("line-a", prio(BATCH), "A", stoppable=True)
    scheduler.enqueue("client-c", prio(NORMAL), "C")
    granted(scheduler)
    assert scheduler.residents_on("gpu0") == frozenset({"A", "C"})
    scheduler.enqueue("person", prio(PERSON), "B")
    granted(scheduler)
    assert stopped(scheduler) == ["line-a"]  # A drains (C cannot: a client's request runs on it)
    scheduler.release("line-a")
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "person"
    assert [eviction.model for eviction in decision.evicts] == ["A"]


def test_over_two_gpus_the_gpu_where_fewer_lines_stop_is_chosen() -> None:
    scheduler, _ = node(gpu("gpu0", slots=2), gpu("gpu1", slots=1))
    for name, model in (("line-0a", "A"), ("line-0b", "A"), ("line-1", "B")):
        scheduler.enqueue(name, prio(BATCH), model, stoppable=True)
        granted(scheduler)
    assert {scheduler.gpu_of(name) for name in ("line-0a", "line-0b")} == {"gpu0"}
    assert scheduler.gpu_of("line-1") == "gpu1"
    scheduler.enqueue("person", prio(PERSON), "C")
    granted(scheduler)
    assert scheduler.stops() == [Stop("line-1", "gpu1", Band.BATCH, "person", Band.INTERACTIVE)]


def test_a_line_that_ends_before_its_stop_ends_once() -> None:
    scheduler, _ = node(gpu())
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("person", prio(PERSON), "A")
    granted(scheduler)
    assert stopped(scheduler) == ["line"]
    scheduler.release("line")  # it ended on its own first: no place kept
    assert scheduler.kept_count == 0
    assert granted(scheduler) == ["person"]
    assert scheduler.stops() == []


def test_nothing_is_stopped_where_the_person_can_start_or_no_line_runs() -> None:
    scheduler, _ = node(gpu(slots=2))
    scheduler.enqueue("line", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("person", prio(PERSON), "A")
    assert granted(scheduler) == ["person"]  # a free slot: nothing to stop
    assert scheduler.stops() == []
    other, _ = node(gpu())
    other.enqueue("client", prio(BATCH), "A")
    granted(other)
    other.enqueue("person", prio(PERSON), "A")
    assert granted(other) == [] and other.stops() == []


def test_while_the_gpu_a_stop_let_go_on_settles_no_line_elsewhere_is_stopped() -> None:
    # Seen end to end (e2e/test_preempt_gpus.py): the stopped line's release begins a settle of
    # its GPU (an abandoned generation), and the person, asking again before it ended, stopped
    # the other GPU's line too.
    scheduler, _ = node(gpu("gpu0"), gpu("gpu1"))
    for name in ("line-0", "line-1"):
        scheduler.enqueue(name, prio(BATCH), "A", stoppable=True)
        granted(scheduler)
    scheduler.enqueue("person", prio(PERSON), "A")
    granted(scheduler)
    [stop] = scheduler.stops()
    scheduler.release(stop.request_id, keep_as=b"line", grace_ns=60 * NS)
    scheduler.blocked_by(stop.gpu, settling=True, adopted=0)  # (as the runtime does, before it grants again)
    assert granted(scheduler) == [] and scheduler.stops() == []
    scheduler.blocked_by(stop.gpu, settling=False, adopted=0)
    assert granted(scheduler) == ["person"] and scheduler.gpu_of("person") == stop.gpu
    # Once granted there, a settle of that GPU later is no stop's: a person who can start nowhere
    # stops a line again.
    other = "line-1" if stop.request_id == "line-0" else "line-0"
    scheduler.release("person")
    scheduler.enqueue("line-back", prio(BATCH), "A", stoppable=True)
    granted(scheduler)
    scheduler.enqueue("person-2", prio(PERSON), "A")
    scheduler.release("line-back")
    scheduler.blocked_by(stop.gpu, settling=True, adopted=0)
    assert granted(scheduler) == [] and stopped(scheduler) == [other]


def test_while_a_drained_model_settles_the_other_resident_model_is_not_drained_too() -> None:
    # Seen end to end (e2e/test_preempt_residents.py): the settle of the drained model's line held
    # that model, and the person's load then drained the other resident model as well.
    scheduler, clock = node(gpu(max_loaded=2))
    for name, model in (("line-a", "A"), ("line-b", "B")):
        scheduler.enqueue(name, prio(BATCH), model, stoppable=True)
        granted(scheduler)
        clock.advance(1.0)
    scheduler.enqueue("person", prio(PERSON), "C")
    granted(scheduler)
    assert stopped(scheduler) == ["line-b"]  # one line either way: the one that ran least
    scheduler.release("line-b", keep_as=b"line-b", grace_ns=60 * NS)
    scheduler.blocked_by("gpu0", settling=True, adopted=0, settling_model="B")
    assert granted(scheduler) == [] and scheduler.stops() == []
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    decision = scheduler.next()
    assert decision is not None and decision.request_id == "person"
    assert [eviction.model for eviction in decision.evicts] == ["B"]


def test_while_the_first_of_a_drain_s_lines_settles_no_line_of_another_gpu_is_stopped() -> None:
    scheduler, _ = node(gpu("gpu0", slots=2), gpu("gpu1", slots=3))
    for name, model in (("a-0", "A"), ("a-1", "A"), ("b-0", "B"), ("b-1", "B"), ("b-2", "B")):
        scheduler.enqueue(name, prio(BATCH), model, stoppable=True)
        granted(scheduler)
    assert {scheduler.gpu_of(name) for name in ("a-0", "a-1")} == {"gpu0"}
    scheduler.enqueue("person", prio(PERSON), "C")
    granted(scheduler)
    assert sorted(stopped(scheduler)) == ["a-0", "a-1"]  # two stops on gpu0 rather than three on gpu1
    scheduler.release("a-0", keep_as=b"a-0", grace_ns=60 * NS)
    scheduler.blocked_by("gpu0", settling=True, adopted=0)
    assert granted(scheduler) == [] and scheduler.stops() == []
    scheduler.release("a-1", keep_as=b"a-1", grace_ns=60 * NS)
    assert granted(scheduler) == [] and scheduler.stops() == []  # (still settling)
    scheduler.blocked_by("gpu0", settling=False, adopted=0)
    assert granted(scheduler) == ["person"] and scheduler.gpu_of("person") == "gpu0"
