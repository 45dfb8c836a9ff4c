"""What the scheduler answers and shows: a grant's `Decision`, the other events of a request's
way (`Queued`, `Removed`, `Released`) and the read-only picture of the queue (`QueueSnapshot`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar, cast

from llamaswap.core.clock import NS_PER_S
from llamaswap.core.eviction import Eviction
from llamaswap.core.index import Entry
from llamaswap.core.kept import KeptPlace
from llamaswap.core.policy import IMPLICIT_GPU, PolicyName
from llamaswap.core.priority import Band

# A decision names at most this many of the requests its winner overtook.
OVERTAKEN_LIMIT: Final = 16


class ReorderCause(str, enum.Enum):
    """A term of the score that changed which request went next."""

    AGING = "aging"
    SWAP_AFFINITY = "swap_affinity"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Why a request got the grant; one per dispatch."""

    request_id: str
    priority: int
    band: Band
    score: float
    arrival_ns: int
    granted_ns: int
    model: str | None
    swap_affinity: bool
    aging: float
    # The upstream has to load this model first: `load` from nothing known loaded, `swap` from
    # a different model.
    load: bool
    swap: bool
    residents_before: frozenset[str]  # the models resident there as it was granted (a load replaces them)
    reordered_by: frozenset[ReorderCause]
    overtook: tuple[str, ...]  # earlier arrivals it went ahead of (at most OVERTAKEN_LIMIT)
    queue_depth_after: int
    # Grants running once this one began, itself included (1 with one slot): the activity
    # record's serial_slots_busy. (The slots it was counted against: its GPU's, `GpuHolding.slots_in_effect`.)
    slots_busy: int = 1
    # It took a slot kept for the interactive band: non-interactive work held its whole share of
    # the slots (``slots - reserved``) as it was granted (`dispatch.in_reserved_slot`).
    reserved_slot: bool = False
    # It runs alone (`Scheduler.enqueue`): nothing ran when it was granted, nothing is granted
    # beside it. It loads nothing (neither `load` nor `swap`).
    alone: bool = False
    gpu: str = IMPLICIT_GPU  # the GPU it runs on
    # Its ready time, set once at the grant: the load its run waits for, that model and when the
    # load began (its own load: this grant's; granted beside a load under way there: that load's),
    # so that it is ready when that load ends; None: ready at once. Every expected end reads it
    # (`estimate.grant_end_s`), also after the grant that loads has ended.
    ready_at: tuple[str, int] | None = None
    max_tokens: int | None = None  # output tokens it asked for (None: not said): sizes its expected run
    # The resident models llamaswap unloads there before this grant's load, each with why it was
    # chosen (several resident, `eviction.victims`: idle ones, the queue's least needed first);
    # the runtime unloads them and waits before the request goes. Empty with one model resident
    # at a time: a swap replaces it by itself.
    evicts: tuple[Eviction, ...] = ()

    @property
    def queue_wait_ns(self) -> int:
        return self.granted_ns - self.arrival_ns

    @property
    def model_load(self) -> bool:
        """The grant began by loading its model: a swap, or a load from nothing known loaded."""
        return self.load or self.swap


@dataclasses.dataclass(frozen=True, slots=True)
class Queued:
    """A request joined the queue: how many it found waiting, and when (the scheduler's clock)."""

    depth: int
    arrival_ns: int
    taken: KeptPlace | None = None  # the kept place it took over (its arrival is the place's)


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    """A waiting request that left without a grant (cancelled, expired or drained)."""

    request_id: str
    priority: int
    band: Band
    model: str | None
    arrival_ns: int
    removed_ns: int

    @classmethod
    def of(cls, entry: Entry, now_ns: int) -> Removed:
        """A waiting request as it leaves at ``now_ns``."""
        return cls(entry.request_id, entry.priority.value, entry.priority.band, entry.model, entry.arrival_ns, now_ns)

    @property
    def queue_wait_ns(self) -> int:
        return self.removed_ns - self.arrival_ns


@dataclasses.dataclass(frozen=True, slots=True)
class Released:
    """The end of a grant."""

    request_id: str
    model: str | None
    granted_ns: int
    released_ns: int

    @property
    def run_ns(self) -> int:
        return self.released_ns - self.granted_ns


@dataclasses.dataclass(frozen=True, slots=True)
class WaitingView:
    request_id: str
    position: int
    priority: int
    band: Band
    # The score it will have when its turn comes in this order: the affinity bonus counts the
    # model loaded by then, not the one loaded now.
    score: float
    swap_affinity: bool
    waited_s: float
    model: str | None
    aging: float = 0.0  # the score's aging term (waited / agingDivisor; 0: none)
    max_tokens: int | None = None  # output tokens it asks for (None: not said)


@dataclasses.dataclass(frozen=True, slots=True)
class RunningView:
    request_id: str
    priority: int
    band: Band
    score: float
    model: str | None
    model_load: bool  # the grant began by loading its model (from nothing, or a swap)
    queue_wait_s: float
    running_s: float
    alone: bool = False  # it runs alone (an unload): nothing starts beside it
    gpu: str = IMPLICIT_GPU  # the GPU it runs on
    # Its ready time (`Decision.ready_at`): the load it waits for, and how long ago that load began.
    ready_at: tuple[str, float] | None = None
    max_tokens: int | None = None  # output tokens it asked for (None: not said)

    @classmethod
    def of(cls, decision: Decision, now_ns: int) -> RunningView:
        """A running grant as it stands at `now_ns`."""
        load = decision.ready_at
        return cls(decision.request_id, decision.priority, decision.band, decision.score, decision.model,
                   decision.model_load, decision.queue_wait_ns / NS_PER_S, (now_ns - decision.granted_ns) / NS_PER_S,
                   decision.alone, decision.gpu,
                   None if load is None else (load[0], (now_ns - load[1]) / NS_PER_S), decision.max_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class BandStats:
    depth: int
    oldest_wait_s: float
    oldest_arrival_ns: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU of the node: its resident models (sorted; empty: none known), its slots, busy
    and in effect, and the resident model the best waiting request holds back there (no new
    grants for it until it drains and goes; None: none)."""

    name: str
    resident_models: tuple[str, ...]
    slots_busy: int
    slots: int
    held_back: str | None = None
    holding_back: tuple[str, ...] = ()  # every model held back there (``held_back`` is the busy one it waits for)


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """The models the best waiting request's last claim holds back on one GPU, and whose claim it
    is: what the rule keeps while that request stays the best (`node.HeldBackModels`). Where no
    GPU takes work the picture (`GpuView.holding_back`) shows the claim it would make instead."""

    holder: str  # the request that claimed
    gpu: str
    models: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class QueueSnapshot:
    policy: PolicyName
    waiting: tuple[WaitingView, ...]  # dispatch order, if nothing changed from now on
    bands: Mapping[Band, BandStats]
    grants: tuple[RunningView, ...]  # every running grant, earliest first
    gpus: tuple[GpuView, ...] = ()  # every GPU, in the configured order (its residents and slots)
    claim: Claim | None = None  # the claim in force (the estimates' walk goes on from it)
    at_ns: int = 0  # the instant it pictures (the scheduler's clock): the waits and running times are as of it


    @property
    def running(self) -> RunningView | None:
        """The earliest of ``grants`` (with one slot, the grant)."""
        return self.grants[0] if self.grants else None

    @property
    def slots_busy(self) -> int:
        return len(self.grants)


_Frozen = TypeVar("_Frozen")


def built_by_assignment(cls: type[_Frozen]) -> Callable[..., _Frozen]:
    """``cls(*fields)``, every field given in order, for a frozen slotted dataclass built on every
    Check, access-log entry, grant or release, at the cost of an unfrozen one: a frozen class's ``__init__`` sets
    each field through ``object.__setattr__`` (a `Decision`: 2.3 us against 0.3). An unfrozen
    twin with the same slots in the same order fills them by plain assignment, then the value
    becomes a ``cls`` (the same layout, so CPython lets its class change): the same value, frozen
    from then on, equal to and hashed as one built by ``cls``. The twin's own ``__post_init__``
    changes the class, so the twin is the builder: no wrapper's frame and argument tuple
    (a `Decision` 0.33 us against 0.45 through a wrapper)."""

    def become_frozen(made: Any) -> None:
        made.__class__ = cls

    twin: Any = dataclasses.make_dataclass(
        f"_{cls.__name__}Fields", [(field.name, field.type) for field in dataclasses.fields(cast(Any, cls))],
        slots=True, eq=False, repr=False, namespace={"__post_init__": become_frozen})
    return cast(Callable[..., _Frozen], twin)


new_decision: Final = built_by_assignment(Decision)
new_queued: Final = built_by_assignment(Queued)
new_released: Final = built_by_assignment(Released)
