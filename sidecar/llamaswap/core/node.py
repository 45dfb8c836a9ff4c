"""The node rule walked down the order: which waiting request starts next, and on which GPU.

`dispatch.choose` says it for one request; this walks the scheduler's order with it. The best
request starts on a GPU or claims one, which then takes nothing else until it can start
there; each request after it starts where the rule lets it, or waits (only the best claims: one
GPU drains for the one best request, and lower ones never hold a GPU back). Once no
open GPU is idle, only a request of a model loaded on one (or of none) can start, and the
first such in the order is the best of those models' tops (`_warm_pick`, ranked as `order.pick`
ranks; a request that runs alone at a model's top is passed over, as it cannot start beside
running work): the walk never reads the whole queue for it. Requests it asks are suspended
(marked not alive, so the indexes skip them) and put back (`find`'s ``resume``) whatever
happens. `find` asks the best first and builds the walk (`NodeWalk`) only when the best waits:
this runs on every grant.

Where several models are resident on the GPU the best waits for, its claim holds back models
there, not the GPU (`claim_on`): its own model, when it waits for a slot of it; else those
chosen to go for its load (`eviction.to_hold_back`: one busy model, the queue's least needed,
and with a memory budget any more that must go with it). The other models keep serving, and
the walk goes on over every GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from llamaswap.core.decisions import Claim
from llamaswap.core.dispatch import (
    CLAIM, START, Choice, GpuTimes, HeldBack, Step, choose, open_to_loads, takes_nothing,
)
from llamaswap.core.eviction import Need, to_hold_back
from llamaswap.core.holding import Candidate, GpuHolding
from llamaswap.core.index import Entry, Index, Item
from llamaswap.core.order import pick, rank, warm_models


_NONE: frozenset[int] = frozenset()  # no GPU claimed yet


def claim_on(gpus: Sequence[GpuHolding], index: int, candidate: Candidate, need: Need,
             keep: Collection[str | None] = ()) -> int | tuple[HeldBack, ...]:
    """What the best request's claim on GPU ``index`` holds back: the whole GPU, or
    where several models are resident there, models of it (its own, whose slot it waits for;
    else those chosen to go for its load, `eviction.to_hold_back`, ``keep`` where they still
    may; the whole GPU if none may)."""
    gpu = gpus[index]
    model = candidate.model
    if candidate.alone or gpu.running.alone:
        return index
    if model is None or model in gpu.residents:
        return ((index, model),)
    going = to_hold_back(gpu, model, need, keep)
    return index if going is None else tuple((index, name) for name in going)


class HeldBackModels:
    """The models the best waiting request holds back, by GPU name (several resident; the
    busy one it waits for first), and which request that is: kept from one claim to the next, so
    that the hold stays on the same models while the same request stays best
    (`eviction.to_hold_back`'s ``keep``). The scheduler keeps one across `find`s; the
    estimates' walk keeps its own across its instants."""

    __slots__ = ("models", "holder")

    def __init__(self) -> None:
        self.models: dict[str, tuple[str | None, ...]] = {}
        self.holder: object = None  # the best request that holds them (None: none)

    def copy(self) -> HeldBackModels:
        twin = HeldBackModels()
        twin.models = dict(self.models)
        twin.holder = self.holder
        return twin

    def clear(self) -> None:
        if self.holder is not None:
            self.models.clear()
            self.holder = None

    def hold(self, holder: object, name: str, models: tuple[str | None, ...]) -> None:
        """``holder`` now holds back ``models`` on GPU ``name`` (and nothing elsewhere)."""
        self.models.clear()
        self.holder = holder
        if models:
            self.models[name] = models

    def claim(self, gpus: Sequence[GpuHolding], index: int, candidate: Candidate, holder: object,
              need: Need) -> int | tuple[HeldBack, ...]:
        """`claim_on` for the best request ``holder`` on GPU ``index``, keeping what it held
        back there last time where that still may be, and remembering what it holds now."""
        name = gpus[index].name
        keep = self.models.get(name, ()) if holder == self.holder else ()
        claim = claim_on(gpus, index, candidate, need, keep)
        self.hold(holder, name, tuple(model for _, model in claim) if isinstance(claim, tuple) else ())
        return claim

    def claim_in_force(self) -> Claim | None:
        """The models held back and whose claim it is (None: no models held)."""
        for name, models in self.models.items():
            return Claim(str(self.holder), name, models)
        return None

    def shown(self) -> dict[str, str | None]:
        """The model shown held back on each GPU: the busy one the best waits for."""
        return {name: models[0] for name, models in self.models.items()}


def find(gpus: Sequence[GpuHolding], first: Entry, aged: Index, reserved: Index | None, warm: Collection[str],
         bonus: int, wanted: Mapping[str | None, int], times: GpuTimes,
         resume: Callable[[list[Entry]], None], need: Need,
         held_back: HeldBackModels) -> tuple[int, Entry, Entry] | None:
    """The GPU and the request that starts next, and the best request (``first``, the first
    asked: `order.pick`'s winner; the same one, unless the best waits); None if nothing starts
    now. (Asked with a request waiting and a GPU that takes work: where none does, nothing
    starts and the best claims nothing.)
    The best first: it starts (then nothing more is built), or it may hold one GPU back, or
    one model of it (only the best does), and the walk goes on behind it; ``resume`` gets the
    requests the walk suspended, whatever happens. ``held_back`` is set to the models the best
    holds back (`HeldBackModels.claim`), or emptied."""
    step, gpu, claim = _best_claims(gpus, first, times, wanted, need, held_back)
    if step is START:
        assert gpu is not None
        return gpu, first, first
    walk = NodeWalk(gpus, aged, reserved, warm, bonus, wanted, times)
    try:
        return walk.behind(first, step, claim)
    finally:
        resume(walk.suspended)


def would_hold(gpus: Sequence[GpuHolding], first: Entry, times: GpuTimes, wanted: Mapping[str | None, int],
               need: Need, held_back: HeldBackModels) -> HeldBackModels:
    """What the best request ``first`` would hold back if it claimed now, from ``held_back`` (the
    claim in force), on a copy: where no GPU takes work it claims nothing (`find` is not asked),
    and the picture shows this instead, worked out at each read and never kept, so the grants
    never depend on who read it."""
    would = held_back.copy()
    _best_claims(gpus, first, times, wanted, need, would)
    return would


def _best_claims(gpus: Sequence[GpuHolding], first: Entry, times: GpuTimes, wanted: Mapping[str | None, int],
                 need: Need, held_back: HeldBackModels) -> tuple[Step, int | None, int | tuple[HeldBack, ...] | None]:
    """The best request asked (`choose`) and its claim made in ``held_back``: none where it starts or
    may run nowhere (emptied), else what it holds back on the GPU it waits for."""
    step, gpu = choose(gpus, first, _NONE, _NONE, times, wanted)
    if step is START or gpu is None:
        held_back.clear()
        return step, gpu, None
    return step, gpu, held_back.claim(gpus, gpu, first, first.request_id, need)


class NodeWalk:
    """The walk behind a best request that waits (`find`)."""

    __slots__ = ("_gpus", "_aged", "_reserved", "_warm", "_bonus", "_wanted", "_times", "_closed",
                 "_interactive_only", "_held_back", "suspended")

    def __init__(self, gpus: Sequence[GpuHolding], aged: Index, reserved: Index | None, warm: Collection[str],
                 bonus: int, wanted: Mapping[str | None, int], times: GpuTimes) -> None:
        self._gpus = gpus
        self._aged = aged
        self._reserved = reserved  # the interactive requests alone (reserved slots), or None
        self._warm = warm  # the models that earn the bonus (`order.pick`)
        self._bonus = bonus
        self._wanted = wanted
        self._times = times
        self._closed: set[int] = set()  # claimed by the best request
        # The best waits for its share: reserved slots stay open (a GPU, or one model of it).
        self._interactive_only: set[int | HeldBack] = set()
        self._held_back: set[HeldBack] = set()  # models of a GPU held back by the best
        self.suspended: list[Entry] = []

    def _choose(self, candidate: Entry) -> Choice:
        return choose(self._gpus, candidate, self._closed, self._interactive_only, self._times, self._wanted,
                      self._held_back)

    def behind(self, first: Entry, step: Step,
               claim: int | tuple[HeldBack, ...] | None) -> tuple[int, Entry, Entry] | None:
        """`find` after the best, ``first``, did not start (the rule said ``step``, on the GPU
        or the models of one that ``claim`` names)."""
        if claim is not None:
            if step is not CLAIM:
                if isinstance(claim, tuple):
                    self._interactive_only.update(claim)
                else:
                    self._interactive_only.add(claim)
            elif isinstance(claim, tuple):
                self._held_back.update(claim)
            else:
                self._closed.add(claim)
        self._suspend(first)
        gpus = self._gpus
        # GPUs that take nothing now: held by a settle, full, or running a request alone.
        full = {i for i, holding in enumerate(gpus) if takes_nothing(holding)}
        while len(self._closed | full) < len(gpus) and self._aged.top() is not None:
            open_gpus = [gpu for i, gpu in enumerate(gpus) if i not in self._closed]
            candidate: Entry | None
            if any(not gpu.running.busy for gpu in open_gpus):
                # An idle GPU: the next in the order most likely starts.
                candidate = pick(self._aged, self._warm, self._bonus)
            else:
                # Every open GPU is busy: only the tops of the models it may start stand a
                # chance (any model's, where several resident leave room or an idle model to go).
                candidate = self._warm_pick(any(open_to_loads(gpu) for gpu in open_gpus))
                if candidate is None:
                    return None
            step, gpu = self._choose(candidate)
            if step is START:
                assert gpu is not None
                return gpu, candidate, first
            self._suspend(candidate)
        return None

    def _suspend(self, entry: Entry) -> None:
        """Asked, and it does not start: out of the indexes until the caller puts it back."""
        entry.alive = False
        self.suspended.append(entry)

    def _warm_pick(self, any_model: bool) -> Entry | None:
        """With every open GPU busy: the first request in the order that the rule starts,
        among the tops of the models loaded on them and of no model, or with ``any_model`` (some
        GPU may load one beside its work) of every model waiting (by the reserved slots' index
        too, where only interactive requests can take a slot). Within a model, every request
        gets the top's answer (one that runs alone, never started beside running work, is
        passed over): the walk reads the tops, never the whole queue."""
        scale = self._aged.scale
        indexes = [self._aged] if self._reserved is None else [self._aged, self._reserved]
        warm: set[str | None] = {None}
        for i, gpu in enumerate(self._gpus):
            if i not in self._closed and not gpu.blocked:
                warm.update(gpu.residents)
        models: Collection[str | None] = warm
        if any_model:
            models = {model for index in indexes for model in index.by_model}
        # The bonus as `order.pick` gives it: a model resident on a GPU that takes work now (one
        # resident only on a full GPU earns none, whether or not the best claimed that GPU).
        bonused = warm_models(self._gpus) if self._bonus else frozenset()
        items: list[tuple[tuple[int, int], Entry]] = []
        for index in indexes:
            for model in models:
                item = self._top_beside(index, model)
                if item is not None:
                    bonus = self._bonus if model is not None and model in bonused else 0
                    items.append((rank(item, bonus, scale), item[2]))
        for _, entry in sorted(items, key=lambda item: item[0], reverse=True):
            if self._choose(entry)[0] is START:
                return entry
        return None

    def _top_beside(self, index: Index, model: str | None) -> Item | None:
        """The first request of ``model`` in ``index`` that may start beside running work: one
        that runs alone (an unload) never does, so it is passed over (suspended), and the
        requests of its model behind it are asked."""
        item = index.top_of(model)
        while item is not None and item[2].alone:
            self._suspend(item[2])
            item = index.top_of(model)
        return item
