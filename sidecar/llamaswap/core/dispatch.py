"""The dispatch rule: whether the best waiting request starts now beside what runs on the upstream.

One rule, written once, for everything that decides or predicts a start: the grant
(`Scheduler.next`) and the estimated starts (`Estimator`'s walk, and so `llamaswap simulate`).
Pure: it reads a picture of what runs (`Running`) and the waiting candidates it is handed,
and changes nothing. It speaks of one upstream; a node of several asks it once per upstream.

- Nothing runs: the best request starts, whatever model it needs (a load or a swap).
- Something runs: the best request starts in a free slot if it needs the loaded model or none,
  and does not run alone; if it needs another model (or runs alone), nothing more starts: what
  runs drains, then it goes (drain then swap; lower-scored work never overtakes it).
- Nothing starts beside a request that runs alone, nor past the slots of the running model.
- Reserved slots: a non-interactive request starts only while fewer than ``slots - reserved``
  non-interactive ones run. When the best is non-interactive and its share is used up, the
  best interactive request takes a free slot if it fits (`fits`), else nothing starts.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
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
    """The rule's answer."""

    WAIT = "wait"  # nothing starts now
    BEST = "best"  # the best waiting request starts
    RESERVED = "reserved"  # the best interactive request starts in a slot kept for its band


def fits(candidate: Candidate, loaded: str | None) -> bool:
    """It may start beside running work: it needs the loaded model or none, and runs with others."""
    return not candidate.alone and (candidate.model is None or candidate.model == loaded)


def slots_in_effect(slots: Slots, running: Running, loaded: str | None) -> int:
    """The slots the rule fills up to: those of the running model, else of the loaded one."""
    return slots.of(running.model if running.model is not None else loaded)


def turn(slots: Slots, loaded: str | None, running: Running, best: Candidate,
         best_interactive: Callable[[], Candidate | None]) -> Turn:
    """Whether ``best`` (the first in the order) starts now, or the best interactive request
    (asked for only when a reserved slot is the one left), or nothing."""
    if not running.busy:
        return Turn.BEST
    total = slots_in_effect(slots, running, loaded)
    if running.busy >= total or running.alone or not fits(best, loaded):
        return Turn.WAIT
    if best.interactive or running.non_interactive < total - slots.reserved:
        return Turn.BEST
    candidate = best_interactive()  # only reserved slots are free: reserved > 0
    return Turn.RESERVED if candidate is not None and fits(candidate, loaded) else Turn.WAIT
