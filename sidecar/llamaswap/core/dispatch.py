"""The dispatch rule: whether the best waiting request starts now beside what runs on a GPU.

One rule function, written once (`turn`, one answer per GPU and request), for everything
that decides or predicts a start: the grant (`Scheduler.next`) and the estimated starts (the
estimates' walk, and so `llamaswap simulate`). Pure: it reads what a GPU holds
(`holding.GpuHolding`) and the waiting candidates it is handed, and changes nothing. It speaks
of one GPU; `choose` asks it once per GPU of a node (one GPU is a node of one).

- Nothing runs: the best request starts, whatever model it needs (a load or a swap).
- Something runs: the best request starts in a free slot if it needs a resident model or none,
  and does not run alone; if it needs another model (or runs alone), nothing more starts: what
  runs drains, then it goes (drain then swap; lower-scored work never overtakes it).
- Nothing starts beside a request that runs alone, nor past the slots of the running model.
- Reserved slots: a non-interactive request starts only while fewer than ``slots - reserved``
  non-interactive ones run. When the best is non-interactive and its share is used up, the
  first interactive request behind it that fits (`fits`) takes a free slot.
- Resident models (up to ``residency.max_loaded``): each has slots of its own, and a request of
  another model starts beside what runs if it has room there (`Turn.ROOM`: its load starts at
  once) or if idle resident models can go to make room (`Turn.EVICT`: `eviction.victims`); else
  it waits while one busy model drains (the best waiting request holds only that one back:
  `node.NodeWalk`). With room for one model that is drain then swap. A request that runs alone
  still runs alone on the GPU.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence, Set
from typing import Final, Protocol

from llamaswap.core.eviction import busy_of, can_evict_for, evictable, has_room, placed_models, places_taken
from llamaswap.core.holding import Candidate, GpuHolding
from llamaswap.core.residency import may_serve


class Turn(enum.Enum):
    """The rule's answer: what one GPU can do for one request now."""

    CLOSED = "closed"  # it takes nothing: full, held, or a request runs alone
    IDLE = "idle"  # nothing runs: it starts there, loading its model if another is resident
    FREE = "free"  # a free slot of a resident model is its to take
    SHARE_USED = "share_used"  # its model is resident, but only reserved slots are free and it is not interactive
    OTHER_MODEL = "other_model"  # a slot is free but another model runs (or it runs alone): a drain first
    # Several resident: its model is not resident, and
    ROOM = "room"  # it has room beside them: its load starts now, beside what runs
    EVICT = "evict"  # idle resident models go to make room: unloaded, then its load, beside what runs


# The members as module globals, for the rule's own reads (several for each request and GPU it
# asks): in Python 3.11 a member read through its class goes through the metaclass's
# ``__getattr__`` hook, 70 ns against 10 for a global.
_CLOSED, _IDLE, _FREE, _SHARE_USED = Turn.CLOSED, Turn.IDLE, Turn.FREE, Turn.SHARE_USED
_OTHER_MODEL, _ROOM, _EVICT = Turn.OTHER_MODEL, Turn.ROOM, Turn.EVICT


def fits(candidate: Candidate, gpu: GpuHolding) -> bool:
    """It may start beside running work: it needs a resident model or none, and runs with others."""
    return not candidate.alone and (candidate.model is None or candidate.model in gpu.residents)


def takes_nothing(gpu: GpuHolding) -> bool:
    """A GPU is closed or full, whoever asks: work the scheduler did not grant holds it
    (``blocked``), or it is `full`. The one measure of it, for the grant, the node walk, the
    estimates, the swap-affinity bonus and Retry-After."""
    return gpu.blocked or (gpu.running.busy > 0 and full(gpu))


def full(gpu: GpuHolding) -> bool:
    """What runs on a GPU leaves no place for another request, whatever holds it apart from its
    grants: a request runs alone there, or every model placed there (`eviction.placed_models`) has
    every slot of its own taken and there is no place for another model (as many placed as
    ``max_loaded``; each of them busy, so none may go). With room for one model: its slots."""
    running = gpu.running
    if running.alone:
        return True
    if not running.busy:
        return False
    residents = gpu.residents
    model = running.model
    # (`placed_models` inline where what runs names resident models only: this runs per GPU and change.)
    placed = residents if running.models is None and (model is None or model in residents) else placed_models(gpu)
    if (len(placed) or 1) < gpu.residency.max_loaded:  # (`places_taken`: something runs here)
        return False
    if not placed:  # work of no model alone: the slots in effect (the default)
        return running.busy >= gpu.slots_in_effect
    if len(placed) == 1:  # (the one placed model, without a generator: this runs per GPU and change)
        if running.models is None and model is not None:  # (what runs is all of it: `busy_of`, inline)
            return running.busy >= gpu.slots.of(model)
        for model in placed:
            return busy_of(gpu, model)[0] >= gpu.slots.of(model)
    return all(busy_of(gpu, model)[0] >= gpu.slots.of(model) for model in placed)


def open_to_loads(gpu: GpuHolding) -> bool:
    """A request of any model may start there now, loading it: nothing runs, or a place is free
    or an idle model may go. (Beside a request that runs alone: none.)"""
    running = gpu.running
    if not running.busy:
        return True
    if running.alone:
        return False
    return places_taken(gpu, placed_models(gpu)) < gpu.residency.max_loaded or bool(evictable(gpu))


def share_used(gpu: GpuHolding) -> bool:
    """The reserved-slot test for what runs on a GPU as a whole: work below the interactive band
    holds its whole share (``slots - reserved``) of the slots in effect."""
    return gpu.running.non_interactive >= gpu.slots_in_effect - gpu.slots.reserved


def in_reserved_slot(gpu: GpuHolding, candidate: Candidate) -> bool:
    """A grant of ``candidate`` now, beside what runs, takes a slot kept for its band (the
    grant's ``reserved_slot``)."""
    if not (gpu.running.busy > 0 and candidate.interactive):
        return False
    busy, share = _model_share(gpu, candidate.model)
    return busy > 0 and share


def _model_share(gpu: GpuHolding, model: str | None) -> tuple[int, bool]:
    """The slots ``model``'s work holds, and whether work below the interactive band holds its
    whole share of them (``slots - reserved``). A request of no model shares the slots of
    whatever runs: the slots in effect."""
    busy, non_interactive = busy_of(gpu, model)
    slots = gpu.slots_in_effect if model is None else gpu.slots.of(model)
    return busy, non_interactive >= slots - gpu.slots.reserved


def turn(gpu: GpuHolding, candidate: Candidate) -> Turn:
    """The dispatch rule: what a GPU (what it holds) can do for ``candidate`` now, whatever holds
    it apart from its grants aside (``blocked`` is `choose`'s to read). The one rule function:
    the grant, the estimates and the simulator ask it, for each GPU of the node. Each resident
    model has slots of its own; a model that is not resident loads beside what runs where it
    has room, or where idle models may go for it; with room for one model, that is only once
    the other model's work has drained."""
    model = candidate.model
    if gpu.settling_model is not None and (candidate.alone or model == gpu.settling_model):
        return _CLOSED  # a settle holds its model, and nothing runs alone beside it
    running = gpu.running
    if not running.busy:
        if gpu.settling_model is None or model is None or model in gpu.residents or has_room(gpu, model) \
                or can_evict_for(gpu, model):
            return _IDLE
        return _CLOSED  # its load needs the settle's model gone: it waits for the settle
    if candidate.alone or running.alone:
        return _CLOSED if full(gpu) else _OTHER_MODEL  # it waits for the GPU to drain
    if model is None or model in gpu.residents:
        busy, share = _model_share(gpu, model)
        if busy >= (gpu.slots_in_effect if model is None else gpu.slots.of(model)):
            return _CLOSED  # full for its model
        return _SHARE_USED if share and not candidate.interactive else _FREE
    # (A model its running work names that the record no longer counts resident is not known
    # loaded: its load waits for that work to drain.)
    if model not in placed_models(gpu):
        if has_room(gpu, model):
            return _ROOM
        if can_evict_for(gpu, model):
            return _EVICT
    return _CLOSED if full(gpu) else _OTHER_MODEL


# -- a node: one GPU or several ------------------------------------------------------------
#
# One queue over the GPUs (one GPU is a node of one), each with what it holds: its slots, its
# resident model and what runs on it. The best waiting request takes, in this order: a free
# slot on a GPU that has its model resident (`Turn.FREE`); else an idle GPU, loading its model
# there, unless a GPU that has it is expected to free a slot sooner than the load would take;
# else it waits, and one GPU (the one that has its model and frees a slot first, else the one
# expected to drain first) takes no new work until it can start there: drain then swap, per
# GPU. The next request in the order is then asked the same over the GPUs still open, so the
# others keep serving. `choose` is that rule for one request; `Scheduler.next` and the
# estimates' walk run it over the order, so both say the same.


class GpuTimes(Protocol):
    """What the node rule may know of time (learnt run times and swap costs); `NO_TIMES` knows
    nothing, and then an idle GPU always takes the best request it may serve."""

    def slot_free_in_s(self, gpu: str) -> float: ...  # until its first running slot frees

    def drained_in_s(self, gpu: str) -> float: ...  # until all it runs has ended

    def swap_s(self, model: str | None, gpu: str) -> float: ...  # loading that model there


class _NoTimes:
    def slot_free_in_s(self, gpu: str) -> float:
        return math.inf

    def drained_in_s(self, gpu: str) -> float:
        return math.inf

    def swap_s(self, model: str | None, gpu: str) -> float:
        return 0.0


NO_TIMES: GpuTimes = _NoTimes()


class Step(enum.Enum):
    START = "start"  # it starts on `gpu`
    CLAIM = "claim"  # it waits for `gpu`, which takes no new work meanwhile
    INTERACTIVE_ONLY = "interactive_only"  # it waits for `gpu`'s share; its reserved slots stay open
    SKIP = "skip"  # every GPU that may serve it is closed already


# As module globals (why: `_IDLE`'s note), for the rule and the node walk.
START: Final = Step.START
CLAIM: Final = Step.CLAIM


# The rule's answer for one request over the node: the step, and the GPU it names (None
# with `Step.SKIP`). A plain tuple: one is built per request asked.
Choice = tuple[Step, int | None]


# A claim on a GPU where several models are resident: the GPU's index and the one model the best
# waiting request holds back there (no new grants for it), rather than the whole GPU.
HeldBack = tuple[int, str | None]
_NOTHING_HELD: frozenset[HeldBack] = frozenset()


def choose(gpus: Sequence[GpuHolding], candidate: Candidate, closed: Set[int],
           interactive_only: Set[int] | Set[int | HeldBack], times: GpuTimes, wanted: Mapping[str | None, int],
           held_back: Set[HeldBack] = _NOTHING_HELD) -> Choice:
    """The node rule for one waiting request, every request ahead of it in the order having been
    asked already (their claims are ``closed``, or ``interactive_only`` for a GPU whose
    non-interactive share they wait for; where several models are resident, ``held_back`` for
    one model of a GPU, which then takes no new request of it). ``wanted[model]``: how many
    waiting requests name it (none where absent)."""
    model = candidate.model
    free = -1  # the least busy with a free slot for it (the fewest running: each runs faster), first in order
    idle: list[int] = []
    # The GPUs it may use that run something and have no slot for it now, each with the rule's
    # answer there; of those, the ones that have its model resident (`holding`).
    waits: dict[int, Turn] = {}
    holding: list[int] = []
    for index, gpu in enumerate(gpus):
        # (`GpuHolding.may_serve`, without its frame: this runs for every GPU and request asked.)
        if gpu.blocked or index in closed or not may_serve(gpu.models, gpu.residency, model):
            continue
        if held_back and ((index, model) in held_back or (model is None and _all_held(gpu, index, held_back))):
            continue
        verdict = turn(gpu, candidate)
        if verdict is _EVICT and held_back and not _may_evict(gpu, index, candidate, held_back):
            verdict = _OTHER_MODEL  # only models the best holds back for its own load could go
        if verdict is _IDLE or verdict is _ROOM or verdict is _EVICT:
            idle.append(index)  # it may start there now, loading its model
            continue
        if verdict is _FREE:
            if candidate.interactive or (index not in interactive_only
                                         and (not interactive_only or (index, model) not in interactive_only)):
                if free < 0 or gpu.running.busy < gpus[free].running.busy:
                    free = index
                continue
            verdict = _SHARE_USED  # the best waits for this GPU's share: its reserved slots only
        if model is not None and model in gpu.residents:
            holding.append(index)
        waits[index] = verdict
    if free >= 0:  # (never for a request that runs alone: it fits nowhere)
        return START, free
    if idle and model is not None:
        for index in idle:
            if model in gpus[index].residents:  # (`GpuHolding.has`, inline: this runs for most grants)
                return START, index
    busy: Collection[int] = waits.keys()
    if candidate.alone and any(gpus[index].has(model) for index in busy):
        # An unload is for a GPU that has its model, where one of those it may use has (it
        # never fits beside running work: no free slot is its; an idle one that has it took it
        # above).
        busy = [index for index in busy if gpus[index].has(model)]
        idle = []
    # (One candidate needs no time: the key of a min over one is read all the same, and reading
    # times builds them.)
    soonest = (None if not holding else holding[0] if len(holding) == 1
               else min(holding, key=lambda i: times.slot_free_in_s(gpus[i].name)))
    if idle:
        # Nothing to evict first, then the evictions the queue wants least (one idle GPU: that one).
        target = idle[0] if len(idle) == 1 else min(idle, key=lambda i: _load_cost(gpus[i], model, wanted))
        if soonest is None or times.slot_free_in_s(gpus[soonest].name) >= times.swap_s(model, gpus[target].name):
            return START, target
        return _wait_for(soonest, waits)
    if soonest is not None:
        return _wait_for(soonest, waits)
    # Another model everywhere it may run: the one expected to drain first drains for it, a full
    # one too (a GPU with a free slot keeps serving meanwhile).
    if not busy:
        return Step.SKIP, None
    draining = next(iter(busy)) if len(busy) == 1 else min(
        busy, key=lambda i: (times.drained_in_s(gpus[i].name), gpus[i].running.busy))
    return _wait_for(draining, waits)


def _load_cost(gpu: GpuHolding, model: str | None, wanted: Mapping[str | None, int]) -> tuple[bool, int, int]:
    """What loading ``model`` on a GPU where it may start costs, least first: whether a resident
    model must go for it, how many waiting requests want those that may go, and how busy it is.
    A request of no model loads nothing: it goes where the resident models are wanted least (it
    takes a slot they could use), nothing resident first."""
    if model is None:
        residents = gpu.residents
        return bool(residents), sum(wanted.get(name, 0) for name in residents), gpu.running.busy
    if has_room(gpu, model):
        return False, 0, gpu.running.busy
    return True, sum(wanted.get(name, 0) for name in evictable(gpu)), gpu.running.busy


def _may_evict(gpu: GpuHolding, index: int, candidate: Candidate, held_back: Set[HeldBack]) -> bool:
    """Idle models that the best waiting request does not hold back may go for ``candidate``'s
    load on GPU ``index`` (the ones it holds back go for its own load only)."""
    assert candidate.model is not None
    return can_evict_for(gpu, candidate.model, held_on(index, held_back))


def held_on(index: int, held_back: Set[HeldBack]) -> list[str | None]:
    """The models held back on GPU ``index``."""
    return [name for at, name in held_back if at == index]


def _all_held(gpu: GpuHolding, index: int, held_back: Set[HeldBack]) -> bool:
    """Every model resident on GPU ``index`` is held back: a request of no model waits too, as
    its slot would keep them from draining (with room for one model: the drain before a swap)."""
    return bool(gpu.residents) and all((index, name) in held_back for name in gpu.residents)


def _wait_for(index: int, verdicts: Mapping[int, Turn]) -> Choice:
    """It waits for a GPU: only its share used there leaves the reserved slots open to
    interactive requests (as with one GPU, whatever model it names); else the GPU takes
    nothing else."""
    return Step.INTERACTIVE_ONLY if verdicts[index] is _SHARE_USED else CLAIM, index
