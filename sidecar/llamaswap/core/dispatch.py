"""The dispatch rule: whether the best waiting request starts now beside what runs on the upstream.

One rule function, written once (`turn`, one answer per upstream and request), for everything
that decides or predicts a start: the grant (`Scheduler.next`) and the estimated starts (the
estimates' walk, and so `llamaswap simulate`). Pure: it reads a picture of what runs
(`Running`) and the waiting candidates it is handed, and changes nothing. It speaks of one
upstream; `choose` asks it once per upstream of a node (one GPU is a node of one).

- Nothing runs: the best request starts, whatever model it needs (a load or a swap).
- Something runs: the best request starts in a free slot if it needs the loaded model or none,
  and does not run alone; if it needs another model (or runs alone), nothing more starts: what
  runs drains, then it goes (drain then swap; lower-scored work never overtakes it).
- Nothing starts beside a request that runs alone, nor past the slots of the running model.
- Reserved slots: a non-interactive request starts only while fewer than ``slots - reserved``
  non-interactive ones run. When the best is non-interactive and its share is used up, the
  first interactive request behind it that fits (`fits`) takes a free slot.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Protocol

from llamaswap.core.slots import Slots


class Candidate(Protocol):
    """A waiting request as the rule sees it."""

    @property
    def model(self) -> str | None: ...  # what it is scheduled on; None: no model

    @property
    def alone(self) -> bool: ...  # runs with nothing beside it (an unload)

    @property
    def interactive(self) -> bool: ...  # `Band.interactive`: it may take a reserved slot


@dataclasses.dataclass(frozen=True, slots=True)
class Running:
    """What runs on the upstream, as the rule needs it: the one record's answer (`Scheduler`'s
    grants; in an estimate, plus work the scheduler did not grant, a settle or an adopted
    exchange, which holds the upstream like a request that runs alone)."""

    busy: int = 0  # slots held
    non_interactive: int = 0  # of those, held by work below the interactive band
    model: str | None = None  # the model the running work names (at most one); None: none named
    alone: bool = False  # a request that runs alone holds the upstream


IDLE = Running()


class Turn(enum.Enum):
    """The rule's answer: what one upstream can do for one request now."""

    CLOSED = "closed"  # it takes nothing: full, or a request runs alone
    IDLE = "idle"  # nothing runs: it starts there, loading its model if another is loaded
    FREE = "free"  # a free slot of the loaded model is its to take
    SHARE_USED = "share_used"  # its model is loaded, but only reserved slots are free and it is not interactive
    OTHER_MODEL = "other_model"  # a slot is free but another model runs (or it runs alone): a drain first


def fits(candidate: Candidate, loaded: str | None) -> bool:
    """It may start beside running work: it needs the loaded model or none, and runs with others."""
    return not candidate.alone and (candidate.model is None or candidate.model == loaded)


def slots_in_effect(slots: Slots, running: Running, loaded: str | None) -> int:
    """The slots the rule fills up to: those of the running model, else of the loaded one."""
    return slots.of(running.model if running.model is not None else loaded)


def takes_nothing(slots: Slots, loaded: str | None, running: Running, blocked: bool = False) -> bool:
    """An upstream is closed or full, whoever asks: ``blocked`` (work the scheduler did not grant
    holds it), a request runs alone there, or every slot in effect is held. The one measure of
    it, for the grant, the node walk, the estimates and the swap-affinity bonus."""
    if blocked:
        return True
    busy = running.busy
    return busy > 0 and (running.alone or busy >= slots_in_effect(slots, running, loaded))


def share_used(slots: Slots, loaded: str | None, running: Running) -> bool:
    """The reserved-slot test: work below the interactive band holds its whole share
    (``slots - reserved``), so only slots kept for the interactive band are free."""
    return running.non_interactive >= slots_in_effect(slots, running, loaded) - slots.reserved


def in_reserved_slot(slots: Slots, loaded: str | None, running: Running, candidate: Candidate) -> bool:
    """A grant of ``candidate`` now, beside what runs, takes a slot kept for its band (the
    grant's ``reserved_slot``)."""
    return candidate.interactive and running.busy > 0 and share_used(slots, loaded, running)


def turn(slots: Slots, loaded: str | None, running: Running, candidate: Candidate) -> Turn:
    """The dispatch rule: what an upstream (its ``slots``, ``loaded`` model and what runs there)
    can do for ``candidate`` now. The one rule function: the grant, the estimates and the
    simulator ask it, for one upstream and for each upstream of a node."""
    if not running.busy:
        return Turn.IDLE
    if takes_nothing(slots, loaded, running):
        return Turn.CLOSED
    if not fits(candidate, loaded):
        return Turn.OTHER_MODEL
    if not candidate.interactive and share_used(slots, loaded, running):
        return Turn.SHARE_USED
    return Turn.FREE


# -- a node: one upstream or several -------------------------------------------------------
#
# One queue over the upstreams (GPUs; one GPU is a node of one), each with its own slots, its loaded model and what
# runs on it. The best waiting request takes, in this order: a free slot on an upstream that
# has its model loaded (`Turn.FREE`); else an idle upstream, loading its model there, unless
# an upstream that has it is expected to free a slot sooner than the load would take; else it
# waits, and one upstream (the one that has its model and frees a slot first, else the one
# expected to drain first) takes no new work until it can start there: drain then swap, per
# upstream. The next request in the order is then asked the same over the upstreams still
# open, so the others keep serving. `choose` is that rule for one request; `Scheduler.next` and
# the estimates' node walk run it over the order, so both say the same.


@dataclasses.dataclass(frozen=True, slots=True)
class Lane:
    """One upstream as the node rule reads it."""

    name: str
    slots: Slots
    models: frozenset[str] | None  # the models it may serve; None: any
    loaded: str | None
    running: Running = IDLE
    blocked: bool = False  # work the scheduler did not grant holds it (a settle, an adopted exchange)

    def may_serve(self, candidate: Candidate) -> bool:
        return self.models is None or candidate.model is None or candidate.model in self.models


class LaneTimes(Protocol):
    """What the node rule may know of time (learnt run times and swap costs); `NO_TIMES` knows
    nothing, and then an idle upstream always takes the best request it may serve."""

    def slot_free_in_s(self, lane: str) -> float: ...  # until its first running slot frees

    def drained_in_s(self, lane: str) -> float: ...  # until all it runs has ended

    def swap_s(self, model: str | None, lane: str) -> float: ...  # loading that model there


class _NoTimes:
    def slot_free_in_s(self, lane: str) -> float:
        return math.inf

    def drained_in_s(self, lane: str) -> float:
        return math.inf

    def swap_s(self, model: str | None, lane: str) -> float:
        return 0.0


NO_TIMES: LaneTimes = _NoTimes()


class Step(enum.Enum):
    START = "start"  # it starts on `lane`
    CLAIM = "claim"  # it waits for `lane`, which takes no new work meanwhile
    INTERACTIVE_ONLY = "interactive_only"  # it waits for `lane`'s share; its reserved slots stay open
    SKIP = "skip"  # every upstream that may serve it is closed already


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    step: Step
    lane: int | None = None


def choose(lanes: Sequence[Lane], candidate: Candidate, closed: Set[int], interactive_only: Set[int],
           times: LaneTimes, wanted: Callable[[str | None], int]) -> Choice:
    """The node rule for one waiting request, every request ahead of it in the order having been
    asked already (their claims are ``closed``, or ``interactive_only`` for an upstream whose
    non-interactive share they wait for). ``wanted(model)``: how many waiting requests name it."""
    model = candidate.model
    mine = [index for index, lane in enumerate(lanes)
            if index not in closed and not lane.blocked and lane.may_serve(candidate)]
    if candidate.alone and model is not None and any(lanes[index].loaded == model for index in mine):
        mine = [index for index in mine if lanes[index].loaded == model]  # an unload: where its model is
    verdicts: dict[int, Turn] = {}
    for index in mine:
        lane = lanes[index]
        verdict = turn(lane.slots, lane.loaded, lane.running, candidate)
        if verdict is Turn.FREE and index in interactive_only and not candidate.interactive:
            verdict = Turn.SHARE_USED
        verdicts[index] = verdict
    free = [index for index in mine if verdicts[index] is Turn.FREE]
    if free:  # the least busy first (the fewest running: each runs faster), then the configured order
        return Choice(Step.START, min(free, key=lambda i: lanes[i].running.busy))
    # Upstreams that have its model loaded and run something, but have no slot for it now.
    holding = [index for index in mine if model is not None and lanes[index].loaded == model
               and lanes[index].running.busy]
    soonest = min(holding, key=lambda i: times.slot_free_in_s(lanes[i].name), default=None)
    idle = [index for index in mine if verdicts[index] is Turn.IDLE]
    if idle:
        warm = [index for index in idle if model is not None and lanes[index].loaded == model]
        if warm:
            return Choice(Step.START, warm[0])
        # Nothing loaded first, then the model the queue wants least.
        target = min(idle, key=lambda i: (lanes[i].loaded is not None, wanted(lanes[i].loaded)))
        if soonest is None or times.slot_free_in_s(lanes[soonest].name) >= times.swap_s(model, lanes[target].name):
            return Choice(Step.START, target)
        return _wait_for(soonest, verdicts)
    if soonest is not None:
        return _wait_for(soonest, verdicts)
    # Another model everywhere it may run: the one expected to drain first drains for it, a full
    # one too (a GPU with a free slot keeps serving meanwhile).
    busy = [index for index in mine if lanes[index].running.busy]
    if not busy:
        return Choice(Step.SKIP)
    draining = min(busy, key=lambda i: (times.drained_in_s(lanes[i].name), lanes[i].running.busy))
    return _wait_for(draining, verdicts)


def _wait_for(index: int, verdicts: Mapping[int, Turn]) -> Choice:
    """It waits for an upstream: only its share used there leaves the reserved slots open to
    interactive requests (as with one GPU, whatever model it names); else the upstream takes
    nothing else."""
    return Choice(Step.INTERACTIVE_ONLY if verdicts[index] is Turn.SHARE_USED else Step.CLAIM, index)
