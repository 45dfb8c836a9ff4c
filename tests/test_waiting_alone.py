"""A request that waits alone: `Scheduler.next` takes it as the best and its grant as reordered by
nothing and overtaking nobody, without reading the heaps. Exact, over random states of every
shape (GPUs, slots, reserved slots, models resident, requests that run alone, aging and
affinity on or off, fifo): at every `next` with one request waiting, the full path's answers
(`order.pick` over each index, the aged top, the arrivals before it) are that request and
nobody, so the shortcut gives what the full path gave."""

from __future__ import annotations

import random

import pytest

from llamaswap.core import ManualClock, Policy, Priority, PrioritySource, Residency, Scheduler, Slots
from llamaswap.core.decisions import OVERTAKEN_LIMIT
from llamaswap.core.index import entry_of
from llamaswap.core.order import pick
from llamaswap.core.policy import GpuPolicy
from policies import fifo, serial

MODELS = ("a", "b", "c", None)


def _policy(rng: random.Random) -> Policy:
    reserved = rng.choice((0, 0, 1))
    slots = Slots(rng.choice((1, 2, 3)) + reserved, {"a": 1 + reserved} if rng.random() < 0.3 else {}, reserved)
    policy = (fifo({"a": 5}, slots=slots) if rng.random() < 0.25
              else serial(rng.choice((0.0, 60.0)), rng.choice((0, 10)), slots=slots))
    gpus = tuple(GpuPolicy(f"g{i}", slots, residency=Residency(max_loaded=rng.choice((1, 2))))
                 for i in range(rng.choice((1, 1, 2))))
    return policy.with_gpus(gpus)


def _full_path_agrees(scheduler: Scheduler) -> None:
    """What `next` and `_grant` read where more than one waits, for the one that waits."""
    only, = scheduler._waiting.values()
    warm = scheduler._holding.now()[2]
    bonus = scheduler._bonus
    indexes = [scheduler._aged, scheduler._plain]
    if scheduler._reserved is not None and only.interactive:
        indexes.extend(scheduler._reserved)
    for index in indexes:
        if index is not None:
            assert pick(index, warm, bonus) is only
    assert entry_of(scheduler._aged.top()) is only
    assert scheduler._arrivals.before(only, OVERTAKEN_LIMIT) == ()


@pytest.mark.parametrize("seed", range(200))
def test_a_request_waiting_alone_is_granted_as_the_full_path_grants_it(seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    scheduler = Scheduler(_policy(rng), clock)
    running: list[str] = []
    alone_seen = 0
    for step in range(80):
        clock.advance(rng.random() * 5)
        roll = rng.random()
        if roll < 0.45:
            priority = Priority(rng.choice((-100, 0, 60, 100)), PrioritySource.NUMBER)
            alone = rng.random() < 0.05
            scheduler.enqueue(f"r{step}", priority, rng.choice(MODELS), alone=alone)
        elif roll < 0.6 and running:
            scheduler.release(running.pop(rng.randrange(len(running))),
                              model_loaded=rng.choice((True, True, False, None)), reached_upstream=rng.random() < 0.9)
        elif roll < 0.65 and scheduler.depth:
            scheduler.cancel(rng.choice(list(scheduler._waiting)))
        while True:
            waited_alone = scheduler.depth == 1
            if waited_alone:
                _full_path_agrees(scheduler)
            decision = scheduler.next()
            if decision is None:
                break
            running.append(decision.request_id)
            if waited_alone:
                alone_seen += 1
                assert decision.reordered_by == frozenset() and decision.overtook == ()
                assert decision.queue_depth_after == 0
    assert alone_seen  # (every seed grants some request that waited alone)


def test_the_heaps_hold_nothing_once_nobody_waits() -> None:
    """A grant of the one waiting request leaves no item behind it (the shortcut reads no heap,
    so none would be pruned as it is met): one request at a time never lets dead items pile up."""
    clock = ManualClock()
    scheduler = Scheduler(serial(60.0, 10, slots=Slots(2, reserved=1)), clock)
    for step in range(50):
        clock.advance(1.0)
        scheduler.enqueue(f"r{step}", Priority(100 if step % 2 else 0, PrioritySource.NUMBER), "a")
        decision = scheduler.next()
        assert decision is not None and decision.queue_depth_after == 0
        scheduler.release(decision.request_id)
        indexes = (scheduler._aged, scheduler._plain, *(scheduler._reserved or ()))
        assert all(index is not None and not index.all and not index.by_model for index in indexes)
    scheduler.enqueue("left", Priority(0, PrioritySource.NUMBER), "b")
    assert scheduler.cancel("left") is not None and not scheduler._aged.all
