"""Per GPU (`GpuRecord`): what runs on it and what is resident there, as the scheduler records it.

A node's upstreams share one queue (`scheduler.py`) but each keeps its own record: its grants
(at most its slots, one model), its resident models, what holds it besides its grants (a
settle, adopted exchanges: `held_by`), the load a grant began there that no release has
confirmed yet, and the `GpuHolding` built from all of that. With one upstream this is the
record the scheduler always kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from llamaswap.core.decisions import Decision
from llamaswap.core.dispatch import takes_nothing
from llamaswap.core.eviction import after_load
from llamaswap.core.holding import IDLE, NO_RESIDENTS, GpuHolding, Running, resident_on, running_of
from llamaswap.core.index import Entry
from llamaswap.core.policy import GpuPolicy


@dataclasses.dataclass(slots=True)
class PendingLoad:
    """A model load begun by a grant (a load or a swap) that no release has confirmed yet: which
    load it is (the scheduler counts them), the model loaded before it, and whether a grant on it
    reached the upstream and got an answer that said nothing about the model (then, unconfirmed,
    the load may or may not have happened)."""

    number: int
    previous: frozenset[str]  # the residents before it
    unsure: bool = False


class Grant(NamedTuple):
    """A running grant: the request, why it won, and the number of the pending load it ran on
    (None: none was pending; the grants that carry a load's number are its users). (A named
    tuple: one is built per grant.)"""

    entry: Entry
    decision: Decision
    load: int | None


class GpuRecord:
    """One upstream's record: its grants (earliest first), its resident models, the work the
    scheduler did not grant that holds it (a settle, adopted exchanges: the runtime says), what
    it holds (`holding`: all of that as one value, as the dispatch rule reads it), its pending
    load, and its grants so far."""

    __slots__ = ("policy", "grants", "residents", "settling", "settling_model", "adopted", "_holding", "_idle",
                 "_blocked", "_settle_model", "load", "pending",
                 "loaders", "dispatches", "last_used")

    def __init__(self, policy: GpuPolicy) -> None:
        self.grants: dict[str, Grant] = {}
        self.residents: frozenset[str] = NO_RESIDENTS  # (`set_residents` changes it)
        self.settling = False  # (`held_by` changes these three)
        self.settling_model: str | None = None
        self.adopted = 0
        self._holding: GpuHolding | None = None  # built when read after a change (`holding`)
        self._idle: GpuHolding | None = None  # the same with nothing running, while residents and policy stay
        # The load the resident model came from while none of its grants has reached the upstream
        # (None once one has, or when the model was reported rather than loaded by a grant). Several
        # resident: each model's, in ``pending`` (a grant is a user of its own model's load only).
        self.load: PendingLoad | None = None
        self.pending: dict[str, PendingLoad] = {}
        # The running grant whose load is under way, by model (`holding.load_under_way` of its
        # grants, kept as they are granted and released rather than searched for at every build;
        # one model resident: at most one).
        self.loaders: dict[str, Decision] = {}
        self.dispatches = 0  # grants on it so far: the generation a loaded-model report was asked at
        # When each model was last granted there (several resident: the least recently used goes
        # first among equally needed ones); the holdings read this map, never a copy.
        self.last_used: dict[str, int] = {}
        self.apply(policy)

    def apply(self, policy: GpuPolicy) -> None:
        self.policy = policy
        self._held_anew()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def holding(self) -> GpuHolding:
        """What it holds, built once after each change of its grants, residents or policy (a
        grant and its release change it twice, and the next grant reads it once; with nothing
        running, the one built last time nothing ran, if residents and policy stayed)."""
        held = self._holding
        if held is not None:
            return held
        policy = self.policy
        if not self.grants:
            held = self._idle
            if held is None:
                held = self._idle = GpuHolding(policy.name, policy.slots, policy.models, self.residents, IDLE, None,
                                               self.settling, self.adopted, self._blocked, policy.residency,
                                               self.last_used, self._settle_model)
        else:
            loading = None
            loaders = self.loaders
            if loaders:
                for model, loader in loaders.items():  # (the earliest: one model resident, the one)
                    loading = (model, loader.granted_ns)
                    break
            held = GpuHolding(policy.name, policy.slots, policy.models, self.residents,
                              running_of([grant.entry for grant in self.grants.values()]), loading, self.settling,
                              self.adopted, self._blocked, policy.residency, self.last_used, self._settle_model)
        self._holding = held
        return held

    @property
    def running(self) -> Running:
        return self.holding.running

    def _held_anew(self) -> None:
        """What holds it besides its grants changed (`held_by`, the policy): the holding's
        ``settling_model`` (the one model a settle holds: several resident, its model known) and
        ``blocked`` (a settle of the whole GPU, or adopted exchanges), kept for every build."""
        one = self.settling and self.settling_model is not None and self.policy.residency.max_loaded > 1
        self._settle_model = self.settling_model if one else None
        self._blocked = (self.settling and not one) or self.adopted > 0
        self._holding = self._idle = None

    def set_residents(self, residents: frozenset[str]) -> None:
        if residents != self.residents:
            self.residents = residents
            self._holding = self._idle = None

    def may_adopt(self, residents: frozenset[str]) -> bool:
        """A report of the resident models made now may be applied. One model resident: nothing
        runs, and it names at most one (an upstream that keeps several loaded says nothing of
        which one serves: not known, as before several could be resident). Several: nothing
        runs; or no load is under way and it names every model that runs (then only the others
        can differ from what the scheduler believes: an unload that failed, a stop)."""
        if self.policy.residency.max_loaded == 1:
            return not self.grants and len(residents) <= 1
        if not self.grants:
            return True
        return not self.loaders and all(
            grant.entry.model is None or grant.entry.model in residents for grant in self.grants.values())

    def adopt(self, residents: frozenset[str]) -> None:
        """What the upstream reports resident, as it is (`may_adopt`): no load is pending any more."""
        self.set_residents(residents)
        self.load = None
        self.pending.clear()

    def held_by(self, *, settling: bool, adopted: int, settling_model: str | None = None) -> bool:
        """The work the scheduler did not grant that holds it now; True if that changed."""
        settling_model = settling_model if settling else None
        if settling == self.settling and adopted == self.adopted and settling_model == self.settling_model:
            return False
        self.settling, self.adopted, self.settling_model = settling, adopted, settling_model
        self._held_anew()
        return True

    def renew(self) -> None:
        """What runs changed (a grant, a release): the holding is built again when next read."""
        self._holding = None

    def granted(self, entry: Entry, decision: Decision, held: GpuHolding, load_number: int | None) -> None:
        """A grant on it (``held``: what it held as it was made): the load it begins (numbered
        ``load_number``; None: none), with the models it evicts gone and its own resident, when
        its model was last used, and what runs."""
        model = decision.model
        load = None
        if model is not None and not decision.alone:
            several = held.residency.max_loaded > 1
            if load_number is not None:
                # One model resident: only with nothing running there, and it replaces what was.
                gone = frozenset(eviction.model for eviction in decision.evicts)
                pending = PendingLoad(load_number, held.residents - gone)
                if several:
                    self.pending[model] = pending
                else:
                    self.load = pending
                self.set_residents(after_load(held, model, gone))
                self.loaders[model] = decision  # its load is under way there until it is released
            if several:
                own = self.pending.get(model)
                load = own.number if own is not None else None
                self.last_used[model] = decision.granted_ns
            else:
                load = self.load.number if self.load is not None else None
        self.grants[entry.request_id] = Grant(entry, decision, load)
        self.renew()

    def released(self, grant: Grant, *, model_loaded: bool | None, reached_upstream: bool) -> None:
        """What a released grant says about the loaded model (`Scheduler.release`)."""
        model = grant.entry.model
        if model is not None and self.loaders.get(model) is grant.decision:
            del self.loaders[model]  # its load is over, whatever it says
        if self.policy.residency.max_loaded > 1:
            self._released_beside(grant, model, model_loaded=model_loaded, reached_upstream=reached_upstream)
            return
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

    def _released_beside(self, grant: Grant, model: str | None, *, model_loaded: bool | None,
                         reached_upstream: bool) -> None:
        """`released` where several models are resident: only the grant's own model's load is
        concerned, and the resident set never counts fewer models than the upstream may hold
        (fewer would let a load make llama-server's router evict by itself). A model stays
        counted after a failed answer (a 5xx of a loaded model) or a load no user confirmed that
        one reached the upstream unanswered; it goes only where its load reached the upstream
        with none of its users. What the upstream says it holds corrects the count
        (`may_adopt`)."""
        if model is None:
            return
        pending = self.pending.get(model)
        if pending is None or grant.load != pending.number:
            return
        if reached_upstream and model_loaded is not None:
            del self.pending[model]  # it reached the upstream and was answered: the load happened (or failed)
            return
        pending.unsure = pending.unsure or reached_upstream
        if all(other.load != pending.number or other.entry.model != model for other in self.grants.values()):
            del self.pending[model]  # its last user, and none confirmed the load
            if not pending.unsure:
                self.set_residents(self.residents - {model})  # none reached the upstream: never loaded


# What a node holds now: every upstream's holding (in the configured order), those that take
# work now (``blocked`` aside), and the models resident on those (`holding.resident_on`).
Held = tuple[tuple[GpuHolding, ...], list[GpuHolding], frozenset[str]]


class NodeHolding:
    """`Held` for the scheduler's upstreams, built once after each change (a `next` that finds
    every slot taken reads one value), and kept for when nothing runs while no upstream's
    residents change (a release that leaves the node idle builds nothing)."""

    __slots__ = ("_gpus", "_now", "_idle")

    def __init__(self, gpus: Sequence[GpuRecord]) -> None:
        self._gpus = gpus
        self._now: Held | None = None
        self._idle: Held | None = None  # what it holds with nothing running

    def now(self) -> Held:
        held = self._now
        if held is None:
            holdings: list[GpuHolding] = []
            open_gpus: list[GpuHolding] = []
            idle = True
            for gpu in self._gpus:
                holding = gpu.holding
                holdings.append(holding)
                idle = idle and not gpu.grants
                if not takes_nothing(holding):
                    open_gpus.append(holding)
            held = self._now = tuple(holdings), open_gpus, resident_on(open_gpus)
            if idle:
                self._idle = held
        return held

    def changed(self, residents: bool) -> None:
        """What runs changed (a grant), and with ``residents`` what is resident somewhere too."""
        self._now = None
        if residents:
            self._idle = None

    def released(self, idle: bool, residents: bool) -> None:
        """A release: the node is ``idle`` now; ``residents``: what is resident changed too."""
        if residents:
            self._idle = None
        self._now = self._idle if idle else None
