"""Kept places (routing.retryGraceSeconds) in the pure core, on a manual clock: a retry takes its
place over (arrival, aging, position, max wait), kept places count against maxQueued, end
exactly once, and a request that got the GPU never has one."""

from __future__ import annotations

import pytest

from llamaswap.core import NS_PER_S, ManualClock, Policy, QueueFull, Scheduler, parse_priority
from llamaswap.core.kept import KeptPlace, KeptPlaces

NORMAL = parse_priority("normal")
BATCH = parse_priority("batch")
GRACE_NS = 10 * NS_PER_S
KEY = b"same request"


def scheduler(*, max_queued: int = 0, max_wait_s: float = 0.0, fifo: bool = False) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    policy = (Policy.fifo(model_priorities={}, max_queued=max_queued, max_wait_s=max_wait_s) if fifo else
              Policy.serial(aging_divisor_s=60.0, swap_affinity_bonus=10, max_queued=max_queued,
                            max_wait_s=max_wait_s))
    return Scheduler(policy, clock), clock


def grant_order(s: Scheduler) -> list[str]:
    order = []
    while (decision := s.next()) is not None:
        order.append(decision.request_id)
        s.release(decision.request_id)
    return order


@pytest.mark.parametrize("fifo", [False, True])
def test_a_retry_takes_over_the_arrival_and_the_position(fifo: bool) -> None:
    s, clock = scheduler(fifo=fifo)
    s.enqueue("running", NORMAL, "m")
    assert s.next() is not None
    clock.advance(1)
    s.enqueue("first-try", NORMAL, "m")
    clock.advance(1)
    s.enqueue("earlier", NORMAL, "m")
    clock.advance(1)
    kept = s.keep("first-try", KEY, GRACE_NS)
    assert kept is not None
    removed, place = kept
    assert removed.request_id == "first-try" and place is not None and place.arrival_ns == 1 * NS_PER_S
    clock.advance(1)
    s.enqueue("later", NORMAL, "m")  # arrived while the client was away
    clock.advance(1)
    queued = s.enqueue("retry", NORMAL, "m", retry_key=KEY)
    assert queued.taken == place
    assert queued.arrival_ns == 1 * NS_PER_S  # the first try's, not now
    assert [w.request_id for w in s.snapshot().waiting] == ["retry", "earlier", "later"]
    s.release("running")
    clock.advance(1)
    first = s.next()
    assert first is not None and first.request_id == "retry"
    assert first.queue_wait_ns == 5 * NS_PER_S  # counted from the first try
    assert first.overtook == ()  # nothing waiting arrived before its first try
    s.release("retry")
    assert grant_order(s) == ["earlier", "later"]
    assert s.kept_count == 0


def test_a_taken_over_place_overtakes_the_later_arrivals_in_order() -> None:
    s, clock = scheduler()
    s.enqueue("running", NORMAL)
    s.next()
    for name in ("a", "b", "c", "d"):
        clock.advance(1)
        s.enqueue(name, NORMAL)
    s.keep("b", KEY, GRACE_NS)
    clock.advance(1)
    s.enqueue("e", NORMAL)
    s.enqueue("b2", NORMAL, retry_key=KEY)
    s.release("running")
    assert grant_order(s) == ["a", "b2", "c", "d", "e"]
    # Band bookkeeping followed the insertion: the oldest normal request is "a" throughout.
    assert s.band_stats()[NORMAL.band].depth == 0


def test_kept_places_count_against_max_queued_and_a_takeover_does_not_add_one() -> None:
    s, clock = scheduler(max_queued=2)
    s.enqueue("a", NORMAL)
    s.enqueue("b", NORMAL)
    s.keep("b", KEY, GRACE_NS)
    with pytest.raises(QueueFull) as full:
        s.enqueue("c", NORMAL)
    assert full.value.depth == 2
    s.enqueue("b-retry", NORMAL, retry_key=KEY)  # takes its own place: still two
    assert s.depth == 2 and s.kept_count == 0
    with pytest.raises(QueueFull):
        s.enqueue("d", NORMAL)


def test_an_untaken_place_expires_on_time_exactly_once() -> None:
    s, clock = scheduler()
    s.enqueue("a", NORMAL)
    clock.advance(2)
    s.keep("a", KEY, GRACE_NS)
    assert s.next_deadline_ns() == 12 * NS_PER_S
    clock.set_ns(12 * NS_PER_S - 1)
    assert s.expire_kept() == []
    clock.set_ns(12 * NS_PER_S)
    # Due, though nobody has asked yet: a retry now does not take it over, and it ends once.
    assert s.enqueue("too-late", NORMAL, retry_key=KEY).taken is None
    assert s.cancel("too-late") is not None
    [place] = s.expire_kept()
    assert place.request_id == "a" and place.left_ns == 2 * NS_PER_S
    assert s.expire_kept() == [] and s.kept_count == 0 and s.next_deadline_ns() is None
    queued = s.enqueue("late-retry", NORMAL, retry_key=KEY)
    assert queued.taken is None and queued.arrival_ns == 12 * NS_PER_S  # a new arrival


def test_a_kept_place_keeps_the_max_wait_clock() -> None:
    s, clock = scheduler(max_wait_s=5)
    s.enqueue("a", NORMAL)
    clock.advance(1)
    s.keep("a", KEY, GRACE_NS)
    assert s.next_deadline_ns() == 5 * NS_PER_S  # before the grace period's end
    clock.advance(4)
    [place] = s.expire_kept()
    assert place.request_id == "a"
    # Taken over, the retry expires when the first try would have.
    s.enqueue("b", NORMAL)
    clock.advance(1)
    s.keep("b", KEY, GRACE_NS)
    clock.advance(1)
    s.enqueue("b-retry", NORMAL, retry_key=KEY)
    assert s.next_deadline_ns() == 10 * NS_PER_S
    clock.set_ns(10 * NS_PER_S)
    assert [removed.request_id for removed in s.expire_overdue()] == ["b-retry"]


def test_another_priority_or_model_does_not_take_the_place() -> None:
    s, clock = scheduler()
    s.enqueue("a", NORMAL, "m")
    s.keep("a", KEY, GRACE_NS)
    clock.advance(1)
    assert s.enqueue("batch", BATCH, "m", retry_key=KEY).taken is None
    assert s.enqueue("other-model", NORMAL, "n", retry_key=KEY).taken is None
    assert s.kept_count == 1
    assert s.enqueue("same", NORMAL, "m", retry_key=KEY).taken is not None


def test_a_request_that_got_the_gpu_never_has_a_place_kept() -> None:
    s, _ = scheduler()
    s.enqueue("a", NORMAL)
    assert s.next() is not None
    assert s.keep("a", KEY, GRACE_NS) is None
    assert s.kept_count == 0


def test_one_place_per_key_and_drain_ends_them() -> None:
    s, clock = scheduler()
    s.enqueue("a", NORMAL)
    s.enqueue("b", NORMAL)
    assert s.keep("a", KEY, GRACE_NS) is not None
    kept = s.keep("b", KEY, GRACE_NS)
    assert kept is not None and kept[1] is None  # b left the queue, but a's place is the one kept
    assert s.depth == 0 and s.kept_count == 1
    assert [place.request_id for place in s.drain_kept()] == ["a"]
    assert s.kept_count == 0 and s.expire_kept() == []


def test_a_place_kept_again_after_a_takeover_has_one_deadline() -> None:
    places = KeptPlaces()
    place = KeptPlace(KEY, "a", NORMAL, None, None, 0, 1, 1, 11)
    other = KeptPlace(b"other", "o", NORMAL, None, None, 0, 2, 1, 15)
    assert places.add(place) and places.add(other)
    assert places.take(KEY) == place
    again = KeptPlace(KEY, "a2", NORMAL, None, None, 0, 1, 20, 30)  # the same seq: a taken-over place
    assert places.add(again)
    assert places.next_deadline_ns(0) == 15
    assert places.due(15, 0) == [other]
    assert places.due(29, 0) == [] and places.due(30, 0) == [again]
