"""The dispatch rule on its own (`core/dispatch.turn`): the grant and the estimates both run it,
so its cases are pinned once here, over plain pictures of what runs."""

from __future__ import annotations

import dataclasses

import pytest

from llamaswap.core import ManualClock, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.dispatch import IDLE, Running, Turn, turn


@dataclasses.dataclass(frozen=True)
class Waiting:
    model: str | None
    interactive: bool = False
    alone: bool = False


def nobody() -> Waiting | None:
    return None


SLOTS = Slots(3, {}, reserved=1)


@pytest.mark.parametrize(("running", "best", "expected"), [
    (IDLE, Waiting("b"), Turn.BEST),  # nothing runs: a load or a swap goes
    (IDLE, Waiting("a", alone=True), Turn.BEST),
    (Running(1, 1, "a"), Waiting("a"), Turn.BEST),  # a free slot of the loaded model
    (Running(1, 1, "a"), Waiting(None), Turn.BEST),  # no model: beside anything
    (Running(1, 1, "a"), Waiting("b"), Turn.WAIT),  # a swap waits for the drain
    (Running(1, 1, "a"), Waiting("a", alone=True), Turn.WAIT),  # runs alone: waits for the drain
    (Running(1, 0, "a", alone=True), Waiting("a"), Turn.WAIT),  # nothing beside one that runs alone
    (Running(3, 1, "a"), Waiting("a", interactive=True), Turn.WAIT),  # every slot taken
    (Running(2, 2, "a"), Waiting("a", interactive=True), Turn.BEST),  # an interactive one takes the reserved
])
def test_the_rule(running: Running, best: Waiting, expected: Turn) -> None:
    assert turn(SLOTS, "a", running, best, nobody) is expected


def test_a_non_interactive_request_past_its_share_leaves_the_slot_to_an_interactive_one() -> None:
    share_used = Running(2, 2, "a")
    assert turn(SLOTS, "a", share_used, Waiting("a"), nobody) is Turn.WAIT
    assert turn(SLOTS, "a", share_used, Waiting("a"), lambda: Waiting("a", interactive=True)) is Turn.RESERVED
    assert turn(SLOTS, "a", share_used, Waiting("a"), lambda: Waiting(None, interactive=True)) is Turn.RESERVED
    # An interactive swap waits for the drain like any swap.
    assert turn(SLOTS, "a", share_used, Waiting("a"), lambda: Waiting("b", interactive=True)) is Turn.WAIT


def test_the_slots_in_effect_are_the_running_models_else_the_loaded_ones() -> None:
    slots = Slots(1, {"a": 2})
    assert turn(slots, None, Running(1, 0, "a"), Waiting(None), nobody) is Turn.BEST  # a's 2 slots
    assert turn(slots, None, Running(1, 0, None), Waiting(None), nobody) is Turn.WAIT  # the default's 1


def test_the_scheduler_keeps_one_picture_of_what_runs() -> None:
    clock = ManualClock()
    scheduler = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=SLOTS), clock)
    assert scheduler.what_runs_on() == IDLE
    scheduler.enqueue("n", Priority(0, PrioritySource.ABSENT), "a")
    scheduler.enqueue("i", Priority(100, PrioritySource.NUMBER), "a")
    assert scheduler.next() is not None and scheduler.next() is not None
    assert scheduler.what_runs_on() == Running(2, 1, "a")
    scheduler.release("n")
    assert scheduler.what_runs_on() == Running(1, 0, "a")
    scheduler.release("i")
    assert scheduler.what_runs_on() == IDLE
