"""Per GPU (`GpuRecord`): what runs on it and what is resident there, as the scheduler records it.

A node's GPUs share one queue (`scheduler.py`) but each keeps its own record, one form
whatever ``maxLoaded``: its grants (at most each resident model's slots), its resident models
and when each was last used, what holds it besides its grants (a settle, adopted exchanges:
`blocked_by`, told by the runtime as each begins and ends), the load each model's grant began there
that no release has confirmed yet, and the `GpuHolding` built from all of that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from llamaswap.core.clock import Clock
from llamaswap.core.decisions import Decision
from llamaswap.core.dispatch import takes_nothing
from llamaswap.core.eviction import Eviction, after_load
from llamaswap.core.holding import IDLE, NO_RESIDENTS, GpuHolding, Running, resident_on, running_of
from llamaswap.core.index import Entry
from llamaswap.core.policy import GpuPolicy


@dataclasses.dataclass(slots=True)
class PendingLoad:
    """A model load begun by a grant (a load or a swap) that no release has confirmed yet: which
    load it is (the scheduler counts them), the resident models it evicted that the upstream
    replaces by itself when the load reaches it (`Residency.replaces_by_itself`: none where they
    are unloaded first), and whether a grant on it reached the upstream and got an answer that
    said nothing about the model (then, unconfirmed, the load may or may not have happened)."""

    number: int
    replaced: frozenset[str]
    unsure: bool = False


class Grant(NamedTuple):
    """A running grant: the request, why it won, and the number of the pending load it ran on
    (None: none was pending; the grants that carry a load's number are its users). (A named
    tuple: one is built per grant.)"""

    entry: Entry
    decision: Decision
    load: int | None


class GpuRecord:
    """One GPU's record: its grants (earliest first), its resident models, the work the
    scheduler did not grant that holds it (a settle, adopted exchanges: the runtime says), what
    it holds (`holding`: all of that as one value, as the dispatch rule reads it), its pending
    load, and its grants so far."""

    __slots__ = ("policy", "grants", "residents", "settling", "settling_model", "adopted", "_holding", "_idle",
                 "_blocked", "pending", "loaders", "dispatches", "last_used", "idle_since", "keep_alive",
                 "_clock")

    def __init__(self, policy: GpuPolicy, clock: Clock | None = None) -> None:
        """``clock``: the scheduler's, for when each model became idle (None: never marked)."""
        self.grants: dict[str, Grant] = {}
        self.residents: frozenset[str] = NO_RESIDENTS  # (`set_residents` changes it)
        self.settling = False  # (`blocked_by` changes these three)
        self.settling_model: str | None = None
        self.adopted = 0
        self._holding: GpuHolding | None = None  # built when read after a change (`holding`)
        self._idle: GpuHolding | None = None  # the same with nothing running, while residents and policy stay
        # By resident model, the load it came from while no release has confirmed it (none once
        # one has, or when the model was reported rather than loaded by a grant): a grant is a
        # user of its own model's load only.
        self.pending: dict[str, PendingLoad] = {}
        # The running grant whose load is under way, by model (`holding.load_under_way` of its
        # grants, kept as they are granted and released rather than searched for at every build).
        self.loaders: dict[str, Decision] = {}
        self.dispatches = 0  # grants on it so far: the generation a loaded-model report was asked at
        # When each model was last granted there (the least recently used goes first among
        # equally needed ones); the holdings read this map, never a copy.
        self.last_used: dict[str, int] = {}
        # When each model last became idle there (a release of it, or being counted resident
        # anew): with `last_used`, where its idle time counts from (idle unloads, `idle.py`).
        self.idle_since: dict[str, int] = {}
        # The keep_alive its last grant of each model asked, where it asked one (`IdleUnloading.keep_alive`).
        self.keep_alive: dict[str, float] = {}
        self._clock = clock
        self.apply(policy)

    def apply(self, policy: GpuPolicy) -> None:
        self.policy = policy
        self._blocked_anew()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def holding(self) -> GpuHolding:
        """What it holds, built once after each change of its grants, residents or policy (a
        grant and its release change it twice, and the next grant reads it once; with nothing
        running, the one built last time nothing ran, if residents and policy stayed)."""
        holding = self._holding
        if holding is not None:
            return holding
        policy = self.policy
        if not self.grants:
            holding = self._idle
            if holding is None:
                holding = self._idle = GpuHolding(policy.name, policy.slots, policy.models, self.residents, IDLE, None,
                                               self.settling, self.adopted, self._blocked, policy.residency,
                                               self.last_used, self.settling_model, self.idle_since,
                                               self.keep_alive)
        else:
            loading = None
            loaders = self.loaders
            if loaders:
                for model, loader in loaders.items():  # (the earliest)
                    loading = (model, loader.granted_ns)
                    break
            holding = GpuHolding(policy.name, policy.slots, policy.models, self.residents,
                              running_of([grant.entry for grant in self.grants.values()]), loading, self.settling,
                              self.adopted, self._blocked, policy.residency, self.last_used, self.settling_model,
                              self.idle_since, self.keep_alive)
        self._holding = holding
        return holding

    @property
    def running(self) -> Running:
        return self.holding.running

    def _blocked_anew(self) -> None:
        """What holds it besides its grants changed (`blocked_by`, the policy): ``blocked``, the one
        place it is derived (a settle of the whole GPU, its model not known, or adopted
        exchanges; a settle of a known model holds that model only: `GpuHolding.settling_model`),
        kept for every build and read by everyone (the rule, the estimates' walk, the views)."""
        self._blocked = (self.settling and self.settling_model is None) or self.adopted > 0
        self._holding = self._idle = None

    def set_residents(self, residents: frozenset[str]) -> None:
        if residents != self.residents:
            self._became_idle(residents - self.residents)  # (counted resident anew: idle from now)
            for model in self.residents - residents:
                self.keep_alive.pop(model, None)  # (gone: its next request says anew)
            self.residents = residents
            self._holding = self._idle = None

    def _became_idle(self, models: Iterable[str | None]) -> None:
        clock = self._clock
        if clock is not None:
            now = clock.now_ns()
            for model in models:
                if model is not None:
                    self.idle_since[model] = now

    def may_accept_report(self, residents: frozenset[str]) -> bool:
        """A report of the resident models made now may be applied: nothing runs; or no load is
        under way and it names every model that runs (then only the others can differ from what
        the scheduler believes: an unload that failed, a stop). Where the upstream replaces its
        model by itself (`Residency.replaces_by_itself`), what it holds is its word once nothing
        runs, and one that names more models than it has room for says nothing of which one
        serves (not known)."""
        residency = self.policy.residency
        if residency.replaces_by_itself:
            return not self.grants and residency.fits(residents)
        if not self.grants:
            return True
        return not self.loaders and all(
            grant.entry.model is None or grant.entry.model in residents for grant in self.grants.values())

    def accept_report(self, residents: frozenset[str]) -> None:
        """What the upstream reports resident, as it is (`may_accept_report`): no load is pending any more."""
        self.set_residents(residents)
        self.pending.clear()

    def blocked_by(self, *, settling: bool, adopted: int, settling_model: str | None = None) -> bool:
        """The work the scheduler did not grant that holds it now; True if that changed."""
        settling_model = settling_model if settling else None
        if settling == self.settling and adopted == self.adopted and settling_model == self.settling_model:
            return False
        self.settling, self.adopted, self.settling_model = settling, adopted, settling_model
        self._blocked_anew()
        return True

    def renew(self) -> None:
        """What runs changed (a grant, a release): the holding is built again when next read."""
        self._holding = None

    def granted(self, entry: Entry, decision: Decision, holding: GpuHolding, load_number: int | None,
                victims: Sequence[Eviction]) -> None:
        """A grant on it (``holding``: what it held as it was made): the load it begins (numbered
        ``load_number``; None: none), with the models it evicts (``victims``) gone and its own
        resident, when its model was last used, and what runs."""
        model = decision.model
        load = None
        if model is not None and not decision.alone:
            if load_number is not None:
                gone = frozenset(eviction.model for eviction in victims)
                unloaded = frozenset(eviction.model for eviction in decision.evicts)
                self.pending[model] = PendingLoad(load_number, gone - unloaded)
                self.set_residents(after_load(holding, model, gone))
                self.loaders[model] = decision  # its load is under way there until it is released
            own = self.pending.get(model)
            load = own.number if own is not None else None
            self.last_used[model] = decision.granted_ns
        self.grants[entry.request_id] = Grant(entry, decision, load)
        self.renew()

    def released(self, grant: Grant, now_ns: int, *, model_loaded: bool | None, reached_upstream: bool) -> None:
        """What a grant released at ``now_ns`` says about its model (`Scheduler.release`): only its own
        model's load is concerned. Answered after it reached the upstream, the load happened
        (or failed); a model not known loaded after a failure counts gone where the upstream
        replaces its model by itself, and stays counted elsewhere (`Residency.replaces_by_itself`:
        one too few would let a load make llama-server's router evict by itself). Its load's last
        user, none confirming it: if none reached the upstream, it never loaded (and what it was
        to replace is there still); if one did unanswered, it may have loaded: it stays counted,
        or where the upstream replaces its model by itself, neither it nor what it replaced is
        known. What the upstream says it holds corrects the count (`may_accept_report`)."""
        model = grant.entry.model
        if model is None:
            return
        self.idle_since[model] = now_ns  # (idle from ``now_ns``, unless another of its grants runs on)
        if self.loaders.get(model) is grant.decision:
            del self.loaders[model]  # its load is over, whatever it says
        forgets = self.policy.residency.replaces_by_itself
        pending = self.pending.get(model)
        on_pending = pending is not None and grant.load == pending.number  # a user of the pending load
        if reached_upstream and model_loaded is not None:
            if not model_loaded and forgets and model in self.residents:
                self.set_residents(self.residents - {model})
                self.pending.pop(model, None)
            elif on_pending:
                del self.pending[model]
            return
        if pending is None or not on_pending:
            return
        pending.unsure = pending.unsure or reached_upstream
        if any(other.load == pending.number for other in self.grants.values()):
            return
        del self.pending[model]  # its last user, and none confirmed the load
        if not pending.unsure:
            self.set_residents((self.residents - {model}) | pending.replaced)  # none reached the upstream
        elif forgets:
            self.set_residents(self.residents - {model})


# What a node holds now: every GPU's holding (in the configured order), those that take
# work now (``blocked`` aside), and the models resident on those (`holding.resident_on`).
NodeHoldings = tuple[tuple[GpuHolding, ...], list[GpuHolding], frozenset[str]]


class NodeHolding:
    """`NodeHoldings` for the scheduler's GPUs, built once after each change (a `next` that finds
    every slot taken reads one value), and kept for when nothing runs while no GPU's
    residents change (a release that leaves the node idle builds nothing)."""

    __slots__ = ("_gpus", "_now", "_idle")

    def __init__(self, gpus: Sequence[GpuRecord]) -> None:
        self._gpus = gpus
        self._now: NodeHoldings | None = None
        self._idle: NodeHoldings | None = None  # what it holds with nothing running

    def now(self) -> NodeHoldings:
        now = self._now
        if now is None:
            holdings: list[GpuHolding] = []
            open_gpus: list[GpuHolding] = []
            idle = True
            for gpu in self._gpus:
                holding = gpu.holding
                holdings.append(holding)
                idle = idle and not gpu.grants
                if not takes_nothing(holding):
                    open_gpus.append(holding)
            now = self._now = tuple(holdings), open_gpus, resident_on(open_gpus)
            if idle:
                self._idle = now
        return now

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
