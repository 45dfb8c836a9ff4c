"""Per upstream: what runs on it and what it has loaded, as the scheduler records it.

A node's upstreams share one queue (`scheduler.py`) but each keeps its own record: its grants
(at most its slots, one model), its loaded model and the load a grant began there that no
release has confirmed yet. With one upstream this is the record the scheduler always kept.
"""

from __future__ import annotations

import dataclasses

from llamaswap.core.decisions import Decision
from llamaswap.core.dispatch import IDLE, Lane, Running
from llamaswap.core.index import Entry
from llamaswap.core.policy import LanePolicy


@dataclasses.dataclass(slots=True)
class PendingLoad:
    """A model load begun by a grant (a load or a swap) that no release has confirmed yet: which
    load it is (the scheduler counts them), the model loaded before it, and whether a grant on it
    reached the upstream and got an answer that said nothing about the model (then, unconfirmed,
    the load may or may not have happened)."""

    number: int
    previous: str | None
    unsure: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """A running grant: the request, why it won, and the number of the pending load it ran on
    (None: none was pending; the grants that carry a load's number are its users)."""

    entry: Entry
    decision: Decision
    load: int | None


class LaneState:
    """One upstream's record: its grants (earliest first), what they hold as the dispatch rule
    reads it, its loaded model and pending load, and its grants so far."""

    __slots__ = ("policy", "grants", "running", "loaded", "load", "dispatches")

    def __init__(self, policy: LanePolicy) -> None:
        self.grants: dict[str, Grant] = {}
        self.running = IDLE
        self.loaded: str | None = None
        # The load the loaded model came from while none of its grants has reached the upstream
        # (None once one has, or when the model was reported rather than loaded by a grant).
        self.load: PendingLoad | None = None
        self.dispatches = 0  # grants on it so far: the generation a loaded-model report was asked at
        self.apply(policy)

    def apply(self, policy: LanePolicy) -> None:
        self.policy = policy

    @property
    def name(self) -> str:
        return self.policy.name

    def lane(self, blocked: bool = False) -> Lane:
        """This upstream as the node rule reads it."""
        return Lane(self.policy.name, self.policy.slots, self.policy.models, self.loaded, self.running, blocked)

    def renew(self) -> None:
        """Renew `running` from the grants: on every grant and release."""
        if not self.grants:
            self.running = IDLE
            return
        model = None
        alone = False
        non_interactive = 0
        for grant in self.grants.values():
            entry = grant.entry
            if entry.model is not None:
                model = entry.model  # they name at most one
            alone = alone or entry.alone
            non_interactive += not entry.interactive
        self.running = Running(len(self.grants), non_interactive, model, alone)

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
                    # was loaded before still is), or those that did were not told (not known).
                    self.loaded = None if pending.unsure else pending.previous
                    self.load = None
        elif not model_loaded and model is not None and self.loaded == model:
            self.loaded = None
            self.load = None
        elif on_pending:
            self.load = None  # it reached the upstream: the load happened
