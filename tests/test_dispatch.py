"""The dispatch rule on its own (`core/dispatch.turn`): the grant and the estimates both run it,
so its cases are pinned once here, over plain pictures of what runs."""

from __future__ import annotations

import dataclasses

import pytest

from llamaswap.core import ManualClock, Policy, Priority, PrioritySource, Scheduler, Slots
from llamaswap.core.dispatch import NO_TIMES, Choice, Step, Turn, choose, in_reserved_slot, turn
from llamaswap.core.holding import IDLE, GpuHolding, Running


@dataclasses.dataclass(frozen=True)
class Waiting:
    model: str | None
    interactive: bool = False
    alone: bool = False


def holding(running: Running, slots: Slots | None = None, resident: str | None = "a") -> GpuHolding:
    """One GPU running ``running``, ``resident`` resident (None: nothing)."""
    return GpuHolding("gpu0", slots if slots is not None else SLOTS, None,
                      frozenset() if resident is None else frozenset((resident,)), running)


def on_one_gpu(running: Running, candidate: Waiting, interactive_only: frozenset[int] = frozenset()) -> Choice:
    """The node rule over a node of one upstream, ``a`` loaded: one GPU's answer."""
    return choose([holding(running)], candidate, set(), interactive_only, NO_TIMES, {})


SLOTS = Slots(3, {}, reserved=1)


STARTS = {Turn.IDLE, Turn.FREE}  # the answers under which the best request starts


@pytest.mark.parametrize(("running", "best", "expected"), [
    (IDLE, Waiting("b"), Turn.IDLE),  # nothing runs: a load or a swap goes
    (IDLE, Waiting("a", alone=True), Turn.IDLE),
    (Running(1, 1, "a"), Waiting("a"), Turn.FREE),  # a free slot of the loaded model
    (Running(1, 1, "a"), Waiting(None), Turn.FREE),  # no model: beside anything
    (Running(1, 1, "a"), Waiting("b"), Turn.OTHER_MODEL),  # a swap waits for the drain
    (Running(1, 1, "a"), Waiting("a", alone=True), Turn.OTHER_MODEL),  # runs alone: waits for the drain
    (Running(1, 0, "a", alone=True), Waiting("a"), Turn.CLOSED),  # nothing beside one that runs alone
    (Running(3, 1, "a"), Waiting("a", interactive=True), Turn.CLOSED),  # every slot taken
    (Running(2, 2, "a"), Waiting("a", interactive=True), Turn.FREE),  # an interactive one takes the reserved
])
def test_the_rule(running: Running, best: Waiting, expected: Turn) -> None:
    assert turn(holding(running), best) is expected
    # On a node of one: the best starts exactly where the rule lets it.
    assert (on_one_gpu(running, best)[0] is Step.START) == (expected in STARTS)


def test_a_non_interactive_request_past_its_share_leaves_the_slot_to_an_interactive_one() -> None:
    share_used = Running(2, 2, "a")
    assert turn(holding(share_used), Waiting("a")) is Turn.SHARE_USED
    # The best waits for its share: the upstream's reserved slots stay open to interactive requests.
    assert on_one_gpu(share_used, Waiting("a")) == (Step.INTERACTIVE_ONLY, 0)
    assert on_one_gpu(share_used, Waiting("a"), frozenset({0}))[0] is not Step.START
    interactive = Waiting("a", interactive=True)
    assert on_one_gpu(share_used, interactive, frozenset({0})) == (Step.START, 0)
    of_none = Waiting(None, interactive=True)
    assert on_one_gpu(share_used, of_none, frozenset({0})) == (Step.START, 0)
    # An interactive swap waits for the drain like any swap.
    assert on_one_gpu(share_used, Waiting("b", interactive=True), frozenset({0}))[0] is not Step.START
    # The grant's ``reserved_slot``: an interactive start while the share is used, nothing else.
    assert in_reserved_slot(holding(share_used), interactive)
    assert not in_reserved_slot(holding(share_used), Waiting("a"))
    assert not in_reserved_slot(holding(Running(1, 1, "a")), interactive)
    assert not in_reserved_slot(holding(IDLE), interactive)


def test_the_slots_in_effect_are_the_running_models_else_the_loaded_ones() -> None:
    slots = Slots(1, {"a": 2})
    assert turn(holding(Running(1, 0, "a"), slots, None), Waiting(None)) is Turn.FREE  # a's 2 slots
    assert turn(holding(Running(1, 0, None), slots, None), Waiting(None)) is Turn.CLOSED  # the default's 1


def test_the_scheduler_keeps_one_picture_of_what_runs() -> None:
    clock = ManualClock()
    scheduler = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10, slots=SLOTS), clock)
    assert scheduler.holdings()[0].running == IDLE
    scheduler.enqueue("n", Priority(0, PrioritySource.ABSENT), "a")
    scheduler.enqueue("i", Priority(100, PrioritySource.NUMBER), "a")
    assert scheduler.next() is not None and scheduler.next() is not None
    assert scheduler.holdings()[0].running == Running(2, 1, "a")
    scheduler.release("n")
    assert scheduler.holdings()[0].running == Running(1, 0, "a")
    scheduler.release("i")
    assert scheduler.holdings()[0].running == IDLE


def test_what_the_node_holds_follows_each_change_though_kept_between_them() -> None:
    """`Scheduler.holdings` is kept between changes (and the idle picture while residents stay):
    a release that leaves nothing running but changes what is resident, a loaded-model report and
    a swap each show at once."""
    clock = ManualClock()
    scheduler = Scheduler(Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10), clock)
    assert scheduler.set_residents(frozenset({"a"}), as_of=0, gpu="gpu0")
    assert scheduler.holdings()[0].residents == {"a"}
    scheduler.enqueue("r1", Priority(0, PrioritySource.NUMBER), "a")
    assert scheduler.next() is not None
    assert scheduler.next() is None  # full: one slot
    assert scheduler.holdings()[0].running == Running(1, 1, "a")
    scheduler.release("r1")
    assert scheduler.holdings()[0] == GpuHolding("gpu0", Slots(), None, frozenset({"a"}), IDLE)._replace(
        name=scheduler.gpus[0], last_used={"a": 0},  # (r1's grant, at 0: room for one model records it too)
        idle_since={"a": 0})  # (and its end: idle since then, for idle unloads)
    scheduler.enqueue("r2", Priority(0, PrioritySource.NUMBER), "a")
    assert scheduler.next() is not None
    scheduler.release("r2", model_loaded=False)  # idle again, and "a" no longer known loaded
    assert scheduler.holdings()[0].residents == frozenset()
    assert scheduler.set_residents(frozenset({"b"}), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")
    assert scheduler.holdings()[0].residents == {"b"}
    scheduler.enqueue("r3", Priority(0, PrioritySource.NUMBER), "c")
    decision = scheduler.next()
    assert decision is not None and decision.swap
    assert scheduler.holdings()[0].residents == {"c"} and scheduler.holdings()[0].running.busy == 1
    scheduler.release("r3")
    assert scheduler.holdings()[0].residents == {"c"} and scheduler.holdings()[0].running == IDLE
