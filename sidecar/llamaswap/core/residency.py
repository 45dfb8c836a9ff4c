"""How many models a GPU keeps resident at once (`maxLoaded`, `memory`, pinned models): the
setting, and which sets of models fit it. What to evict under it is `eviction.py`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Set

from llamaswap.core.clock import NS_PER_S
from llamaswap.core.keep_alive import IGNORED, KeepAlive


@dataclasses.dataclass(frozen=True, slots=True)
class IdleUnload:
    """How long a resident model may sit idle on a GPU before it is unloaded (`core/idle.py`):
    ``default_s`` (``upstream.idleUnloadSeconds``, llama-swap's ``globalTTL``) unless the model
    has its own (``per_model_s``: ``models.<id>.ttl``). 0: never. ``keep_alive``: what a
    request's Ollama keep_alive may change of it (`routing.keepAlive`; by default, nothing)."""

    default_s: float = 0.0
    per_model_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    keep_alive: KeepAlive = IGNORED

    def after_ns(self, model: str) -> int:
        """How long ``model`` may sit idle, in nanoseconds; 0: for ever."""
        return round(self.per_model_s.get(model, self.default_s) * NS_PER_S)

    def idle_for_ns(self, model: str, requested_s: float | None) -> int | None:
        """How long ``model`` may sit idle after its last request, which asked ``requested_s`` by
        its keep_alive (None: it did not), in nanoseconds; 0: at once; None: for ever."""
        if requested_s is not None and self.keep_alive.honour:
            return self.keep_alive.after_ns(requested_s)
        after_ns = self.after_ns(model)
        return after_ns if after_ns > 0 else None

    @property
    def ever(self) -> bool:
        """Some model may be unloaded for idleness here (a request's keep_alive may ask it, where honoured)."""
        return (self.default_s > 0 or any(seconds > 0 for seconds in self.per_model_s.values())
                or self.keep_alive.honour)


NEVER_IDLE = IdleUnload()

@dataclasses.dataclass(frozen=True, slots=True)
class Residency:
    """How many models a GPU keeps resident at once, and what they may weigh.

    ``max_loaded``: models resident at once (1: room for one model, so a load evicts the idle
    resident one). ``pinned``: models that are never evicted. ``memory_bytes``: a budget the
    resident models' sizes (``model_bytes``; a model not listed counts 0: the configuration
    makes sure every model has one where a budget is set) must fit in; None: count only. With
    room for one model neither applies (the configuration warns): nothing can stay beside a
    load, so a pin or a budget would only keep every other model out, and they are dropped.
    """

    max_loaded: int = 1
    pinned: frozenset[str] = frozenset()
    memory_bytes: int | None = None
    model_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # How long each model may sit idle before it is unloaded (`core/idle.py`; default: for ever).
    idle: IdleUnload = NEVER_IDLE
    # ``replaces_by_itself``, set from ``max_loaded`` (a field: read at every grant and release).
    # What the upstream behind such a GPU does, not a rule of the scheduler's: with room for one model
    # (llama-swap, a single-model llama-server, a router at ``--models-max 1``) it replaces its model
    # by itself when a request for another reaches it. So a grant's evictions are not unloaded first
    # (`Decision.evicts` names none), a model it replaces is there still if no request of the load
    # reached it, and a model not known loaded (a failure, an answer that said nothing of a load)
    # counts gone: counting it gone loses nothing, and what the upstream has is whatever it says once
    # nothing runs. With room for more, llama-server's router would evict by itself (its least
    # recently used, by count) a model llamaswap keeps: the evictions are unloaded first, and a model
    # it may hold stays counted until it says otherwise (one too few would let a load make it evict).
    replaces_by_itself: bool = dataclasses.field(init=False, repr=False, compare=False, hash=False)
    # `never_fits` by model, worked out once: the rule asks it of every GPU at every grant.
    _never_fits: dict[str, bool] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                     compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_loaded, int) or isinstance(self.max_loaded, bool) or self.max_loaded < 1:
            raise ValueError(f"max_loaded must be an integer >= 1, not {self.max_loaded!r}")
        object.__setattr__(self, "model_bytes", dict(self.model_bytes))  # a picture, not the caller's dict
        object.__setattr__(self, "replaces_by_itself", self.max_loaded == 1)
        if self.max_loaded == 1:
            object.__setattr__(self, "pinned", frozenset())
            object.__setattr__(self, "memory_bytes", None)


    def bytes_of(self, model: str) -> int:
        """A model's size; one of unknown size counts as the whole budget (it is never loaded
        beside others on a guess: the configuration gives every model it knows a size)."""
        size = self.model_bytes.get(model)
        return size if size is not None else self.memory_bytes or 0

    def bytes_together(self, models: Collection[str]) -> int:
        """What these models weigh together (`bytes_of` each): the one sum the rule and the
        configuration's checks of pinned models read."""
        return sum(self.bytes_of(model) for model in models)

    def fits(self, models: Collection[str]) -> bool:
        """These models may be resident together."""
        if len(models) > self.max_loaded:
            return False
        budget = self.memory_bytes
        return budget is None or self.bytes_together(models) <= budget

    def never_fits(self, model: str) -> bool:
        """``model`` can never be resident here beside the pinned models (too large for the
        budget, or the pinned ones fill every place)."""
        known = self._never_fits.get(model)
        if known is None:
            known = self._never_fits[model] = model not in self.pinned and not self.fits(self.pinned | {model})
        return known


ONE_MODEL = Residency()


def listed(models: Set[str] | None, model: str) -> bool:
    """``model`` is in a GPU's list of the models it may serve (``models``; None: any). The
    configuration reads it alone (`GpuEntry.lists`: which models need a size, which are
    pinned where); the scheduler through `may_serve`."""
    return models is None or model in models


def may_serve(models: Set[str] | None, residency: Residency, model: str | None) -> bool:
    """A GPU that may serve ``models`` (None: any) and keeps them resident by ``residency`` may
    serve ``model``: it is listed, and can ever be resident there beside the pinned models. A
    request of no model: any GPU. The one test of it, for the rule (`GpuHolding.may_serve`)
    and for refusing a model that no GPU can ever run (`Gpus.serves`, through `GpuPolicy.may_serve`)."""
    if model is None:
        return True
    # (`listed`, inline: the rule asks this of every GPU at every grant.)
    return (models is None or model in models) and not residency.never_fits(model)
