"""The resident models of one GPU: whether a model has room there, which resident models go
when it has none, and which one the best waiting request holds back while every model that
could go is busy.

Pure: it reads what a GPU holds (`holding.GpuHolding`, its `residency.Residency`) and how much
the queue needs each model (``need``: higher is needed more: the best waiting score for it), and
changes nothing. With ``max_loaded`` 1 (the default) a GPU has room for one model: a load there
evicts the one idle resident model, once the work on it has drained.

Invariants, enforced by the rule that asks these (`dispatch.turn`, `dispatch.choose`, the grant):
- a model is evicted only if nothing runs on it, it does not load, and it is not pinned;
- after a grant the resident models fit: at most ``max_loaded``, and (with ``memory_bytes``)
  their sizes sum to at most the budget;
- a model that can never fit beside the pinned ones is never served there
  (`Residency.never_fits`, read by `GpuHolding.may_serve`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from llamaswap.core.holding import GpuHolding

# How much the queue needs a model: higher is needed more. The scheduler: the best waiting request
# for it, by its index key then arrival; the estimates' walk: how early its first request stands
# in the dispatch order (the same order). NOT_WAITED_FOR: nothing waits for it.
Need = Callable[[str], tuple[float, float]]
NOT_WAITED_FOR = (-math.inf, -math.inf)


class EvictReason(str, enum.Enum):
    """Why a resident model was the one to go (a metric label, and the activity log's reason)."""

    NOT_WAITED_FOR = "not_waited_for"  # nothing waiting needs it (and every other one is waited for)
    LEAST_NEEDED = "least_needed"  # requests wait for it, behind those for the others in the order
    LEAST_RECENTLY_USED = "least_recently_used"  # nothing waits for it nor for another: used longer ago
    IDLE = "idle"  # no grant made room by it: it sat idle its idle time (`idle.py`: models.<id>.ttl)

    def __str__(self) -> str:
        return self.value


class Eviction(NamedTuple):
    """A resident model a grant unloads before its load, and why it was chosen."""

    model: str
    reason: EvictReason


def no_need(model: str) -> tuple[float, float]:
    """A need that knows nothing: every model alike, none waited for (then the least recently
    used goes)."""
    return NOT_WAITED_FOR


def busy_of(gpu: GpuHolding, model: str | None) -> tuple[int, int]:
    """The slots ``model``'s running work holds on a GPU, and how many of those hold work below
    the interactive band. (Work of no model shares the slots of whatever runs.)"""
    running = gpu.running
    per_model = running.models
    if per_model is None:
        if model is None or running.model is None or running.model == model:
            return running.busy, running.non_interactive
        return 0, 0
    if model is None:
        return running.busy, running.non_interactive
    return per_model.get(model, (0, 0))


def evictable(gpu: GpuHolding, held: Collection[str | None] = ()) -> list[str]:
    """The resident models that may go now: nothing runs on them, none loads, none is pinned,
    no settle waits for one of their generations, and none is ``held`` back by the best waiting
    request for its own load (asked for another request)."""
    pinned = gpu.residency.pinned
    return [model for model in gpu.residents
            if model not in pinned and model != gpu.settling_model and model not in held
            and busy_of(gpu, model)[0] == 0]


def placed_models(gpu: GpuHolding) -> frozenset[str]:
    """The models a GPU holds: those resident, and any that its running work names beside them
    (a model the upstream said it no longer had, while its requests still run there)."""
    residents = gpu.residents
    running = gpu.running
    if running.models is None:
        model = running.model
        return residents if model is None or model in residents else residents | {model}
    return residents if residents.issuperset(running.models) else residents | running.models.keys()


def places_taken(gpu: GpuHolding, placed: Collection[str]) -> int:
    """The places of a GPU taken: its ``placed`` models; with none known, work that names no model
    holds the one it runs on (the upstream's, unknown here), so nothing loads beside it where
    there is room for one model only."""
    return len(placed) or (1 if gpu.running.busy else 0)


def has_room(gpu: GpuHolding, model: str) -> bool:
    """``model`` can load beside the models placed there without evicting any."""
    placed = placed_models(gpu)
    return places_taken(gpu, placed) < gpu.residency.max_loaded and gpu.residency.fits(placed | {model})


def _least_needed_first(gpu: GpuHolding, models: Collection[str], need: Need) -> list[str]:
    """Least needed by the queue first, then least recently used."""
    if len(models) < 2:
        return list(models)  # (nothing to rank: the queue's needs are not read)
    last_used = gpu.last_used
    return sorted(models, key=lambda name: (need(name), last_used.get(name, 0), name))


def victims(gpu: GpuHolding, model: str, need: Need, held: Collection[str | None] = ()) -> tuple[Eviction, ...] | None:
    """The resident models to evict so that ``model`` loads now: none with room; else the fewest
    idle ones (not ``held`` back for the best waiting request), the queue's least needed first
    (each with why); None if evicting every idle one is not enough."""
    if gpu.residency.fits(gpu.residents | {model}):
        return ()
    ranked = _least_needed_first(gpu, evictable(gpu, held), need)
    going = _fewest_to_go(gpu, ranked, model)
    if going is None:
        return None
    return tuple(Eviction(victim, _reason(need, victim, ranked[position + 1:]))
                 for position, victim in enumerate(ranked) if victim in going)


def _reason(need: Need, victim: str, kept: Collection[str]) -> EvictReason:
    if need(victim) != NOT_WAITED_FOR:
        return EvictReason.LEAST_NEEDED
    if any(need(other) == NOT_WAITED_FOR for other in kept):
        return EvictReason.LEAST_RECENTLY_USED  # the recency broke the tie
    return EvictReason.NOT_WAITED_FOR


def can_evict_for(gpu: GpuHolding, model: str, kept: Collection[str | None] = ()) -> bool:
    """Evicting idle residents (not those ``kept``: held back for the best waiting request)
    would make room for ``model`` now (`victims` is not None), without ranking them."""
    placed = placed_models(gpu)
    # (None placed: nothing to evict.)
    return bool(placed) and gpu.residency.fits((placed - set(evictable(gpu, kept))) | {model})


def to_hold_back(gpu: GpuHolding, model: str, need: Need, keep: Collection[str | None] = ()) -> tuple[str, ...] | None:
    """No room for ``model`` and the idle models are not enough: the models the best waiting
    request for it holds back until they drain and go (no new grants for them), busy ones
    first. ``keep``, those it held back last time, as they were, while their leaving still
    makes room (a hold that moved whenever the queue's needs changed would let every model
    take new work in turn, and the best wait for ever); else the idle ones (they cost no wait),
    then the busy ones, the queue's least needed first: the fewest whose leaving makes room
    (with a memory budget a load may need several to go, idle ones too: each is held, or lower
    work would take it back). None if none would do (then ``model`` never fits there beside
    what is pinned)."""
    residency = gpu.residency
    idle = evictable(gpu)
    busy = [name for name in gpu.residents if name not in idle and name not in residency.pinned]  # (a settling one too)
    kept = [name for name in keep if name in idle or name in busy]
    if kept and len(kept) == len(keep) and residency.fits((gpu.residents - set(kept)) | {model}):
        return tuple(name for name in kept if name is not None)  # the same hold, while it still makes room
    going = _fewest_to_go(gpu, [*_least_needed_first(gpu, idle, need), *_least_needed_first(gpu, busy, need)], model)
    if going is None:
        return None
    return tuple(sorted(going, key=lambda name: name in idle))  # (busy first: the one it waits for)


def _fewest_to_go(gpu: GpuHolding, ranked: Sequence[str], model: str) -> list[str] | None:
    """The resident models to go so that ``model`` fits, taken in the order ``ranked`` until it
    does; then those a later one made needless (a large one after small ones) stay, the last
    taken before it first. None if all of ``ranked`` going is not enough."""
    residency = gpu.residency
    left = set(gpu.residents)
    chosen: list[str] = []
    for name in ranked:
        left.discard(name)
        chosen.append(name)
        if residency.fits(left | {model}):
            break
    else:
        return None
    for name in reversed(chosen[:-1]):
        if residency.fits(left | {name, model}):
            left.add(name)
            chosen.remove(name)
    return chosen


def after_load(gpu: GpuHolding, model: str, evicted: Collection[str]) -> frozenset[str]:
    """The resident models once ``model`` has loaded there, ``evicted`` (`victims`) gone: with
    room for one model, the one that was there is the one victim."""
    return (gpu.residents - frozenset(evicted)) | {model}
