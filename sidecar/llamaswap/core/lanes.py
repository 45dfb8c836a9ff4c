"""Per upstream: what runs on it and what is resident there, as the scheduler records it.

A node's upstreams share one queue (`scheduler.py`) but each keeps its own record: its grants
(at most its slots, one model), its loaded model and the load a grant began there that no
release has confirmed yet. With one upstream this is the record the scheduler always kept.
"""

from __future__ import annotations

import dataclasses

from llamaswap.core.decisions import Decision
from llamaswap.core.holding import IDLE, NO_RESIDENTS, GpuHolding, Running
from llamaswap.core.index import Entry
from llamaswap.core.policy import LanePolicy


@dataclasses.dataclass(slots=True)
class PendingLoad:
    """A model load begun by a grant (a load or a swap) that no release has confirmed yet: which
    load it is (the scheduler counts them), the model loaded before it, and whether a grant on it
    reached the upstream and got an answer that said nothing about the model (then, unconfirmed,
    the load may or may not have happened)."""

    number: int
    previous: frozenset[str]  # the residents before it
    unsure: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """A running grant: the request, why it won, and the number of the pending load it ran on
    (None: none was pending; the grants that carry a load's number are its users)."""

    entry: Entry
    decision: Decision
    load: int | None


class LaneState:
    """One upstream's record: its grants (earliest first), what it holds (`holding`: its resident
    models and what runs, as the dispatch rule reads it), its pending load, and its grants so
    far."""

    __slots__ = ("policy", "grants", "holding", "load", "dispatches")

    def __init__(self, policy: LanePolicy) -> None:
        self.grants: dict[str, Grant] = {}
        self.holding = GpuHolding(policy.name, policy.slots, policy.models)
        # The load the resident model came from while none of its grants has reached the upstream
        # (None once one has, or when the model was reported rather than loaded by a grant).
        self.load: PendingLoad | None = None
        self.dispatches = 0  # grants on it so far: the generation a loaded-model report was asked at
        self.apply(policy)

    def apply(self, policy: LanePolicy) -> None:
        self.policy = policy
        held = self.holding
        self.holding = GpuHolding(policy.name, policy.slots, policy.models, held.residents, held.running)

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def running(self) -> Running:
        return self.holding.running

    @property
    def residents(self) -> frozenset[str]:
        return self.holding.residents

    def set_residents(self, residents: frozenset[str]) -> None:
        held = self.holding
        if residents != held.residents:
            self.holding = GpuHolding(held.name, held.slots, held.models, residents, held.running)

    def renew(self) -> None:
        """Renew what runs from the grants: on every grant and release."""
        held = self.holding
        if not self.grants:
            running = IDLE
        else:
            model = None
            alone = False
            non_interactive = 0
            for grant in self.grants.values():
                entry = grant.entry
                if entry.model is not None:
                    model = entry.model  # they name at most one
                alone = alone or entry.alone
                non_interactive += not entry.interactive
            running = Running(len(self.grants), non_interactive, model, alone)
        self.holding = GpuHolding(held.name, held.slots, held.models, held.residents, running)

    def released(self, grant: Grant, *, model_loaded: bool | None, reached_upstream: bool) -> None:
        """What a released grant says about the loaded model (`Scheduler.release`)."""
        model = grant.entry.model
        pending = self.load
        on_pending = pending is not None and grant.load == pending.number  # a user of the pending load
        if not reached_upstream or model_loaded is None:
            if on_pending:
                assert pending is not None
                pending.unsure = pending.unsure or reached_upstream
                if all(other.load != pending.number for other in self.grants.values()):
                    # Its last user, and none confirmed the load: none reached the upstream (what
                    # was resident before still is), or those that did were not told (not known).
                    self.set_residents(NO_RESIDENTS if pending.unsure else pending.previous)
                    self.load = None
        elif not model_loaded and model is not None and model in self.residents:
            self.set_residents(self.residents - {model})
            self.load = None
        elif on_pending:
            self.load = None  # it reached the upstream: the load happened
