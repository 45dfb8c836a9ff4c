"""The serial and fifo schedulers: up to ``slots`` grants of the loaded model, best score first.

score = priority + swap affinity + aging, where aging = waited_seconds / agingDivisor.

Why heaps work although scores change with time: with one divisor for everyone, every
waiting request gains aging at the same rate, so

    score_i(t) * D = (priority_i + bonus_i) * D - arrival_i + t

and the `t` term is common to all. Ordering by the time-free key
``(priority + bonus) * D - arrival`` therefore orders by current score. The only bonus is
swap affinity, which applies to exactly the requests whose model is loaded; those live in a
per-model heap, so the winner is the better of the top of the global heap and the top of the
loaded model's heap plus the bonus (`_pick`). Everything is integer nanoseconds, so the
comparison is exact and equal scores fall back to arrival order.

Slots (`Slots`): the upstream serves several generations of its loaded model at once. The
dispatch rule is in `Scheduler.next`; with one slot (the default) it is exactly the
one-grant-at-a-time scheduler this module always was.

Invariants, enforced here:
- at most ``slots`` requests hold a grant, and the models they name are one model: a grant
  that needs another model (a swap, or a load from nothing known loaded) is made only when
  nothing runs;
- a request that runs alone (``enqueue(alone=True)``: it changes what the upstream has loaded
  under any generation, as llama-server's model unload does) is granted only when nothing runs,
  and nothing is granted beside it;
- a request is either waiting, running, or gone; never two at once;
- the dispatch order shown by ``snapshot`` is the order ``next`` grants in when the grants are
  taken one at a time, because both use the same ``_pick`` (with several slots, a reserved
  slot can let an interactive request start before a non-interactive one listed ahead of it);
- a loaded-model report older than the latest grant, or made while anything runs, is ignored
  (``set_loaded_model``);
- removed entries are deleted lazily from heaps and compacted when they outnumber the living.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from llamaswap.core.clock import Clock
from llamaswap.core.kept import KeptPlace, KeptPlaces
from llamaswap.core.priority import INTERACTIVE_FLOOR, Band, Priority

NS_PER_S: Final = 1_000_000_000
# A decision names at most this many of the requests its winner overtook.
OVERTAKEN_LIMIT: Final = 16
# Rebuild heaps once dead entries outnumber living ones by this much.
_COMPACT_SLACK: Final = 1024


class SchedulerError(Exception):
    """Base for every failure the core reports."""


class QueueFull(SchedulerError):
    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(f"queue is full: {depth} waiting, limit {limit}")
        self.depth = depth
        self.limit = limit


class UnknownRequest(SchedulerError):
    """The request is not in the state the command needs (not waiting, or not running)."""


class InvalidSlots(SchedulerError):
    """Slot settings that cannot work: fewer than one slot for a model, a negative reservation,
    or a reservation that leaves a model no slot for non-interactive work.

    ``model`` names the model whose slots are at fault; None means the default (the slots of
    every model not listed on its own). The configuration maps this to its key paths.
    """

    def __init__(self, message: str, *, model: str | None, slots: int, reserved: int) -> None:
        super().__init__(message)
        self.model = model
        self.slots = slots
        self.reserved = reserved


@dataclasses.dataclass(frozen=True, slots=True)
class Slots:
    """How many generations of the loaded model run at once, and how many of those slots are kept
    for the interactive band (priority >= ``INTERACTIVE_FLOOR``).

    ``default`` applies to every model not in ``per_model`` and to requests that name no model
    while nothing is loaded. Non-interactive requests use at most ``of(model) - reserved`` slots
    (whatever the interactive ones use), so at every moment at least ``reserved`` slots are idle
    or serve interactive work; ``reserved`` must be below every model's slots (`InvalidSlots`
    otherwise). The defaults (one slot, none reserved) are the scheduler as it was before slots
    existed.
    """

    default: int = 1
    per_model: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_model", dict(self.per_model))  # a picture, not the caller's dict
        reserved = self.reserved
        if not _is_int(reserved) or reserved < 0:
            raise InvalidSlots(f"reserved slots must be an integer >= 0, not {reserved!r}", model=None,
                               slots=self.default, reserved=reserved)
        for model, slots in [(None, self.default), *self.per_model.items()]:
            name = "the default" if model is None else f"model {model!r}"
            if not _is_int(slots) or slots < 1:
                raise InvalidSlots(f"slots of {name} must be an integer >= 1, not {slots!r}", model=model,
                                   slots=slots, reserved=reserved)
            if reserved >= slots:
                raise InvalidSlots(f"{reserved} reserved slots leave {name} ({slots} slots) none for "
                                   "non-interactive requests: reserve fewer than its slots", model=model,
                                   slots=slots, reserved=reserved)

    @classmethod
    def fitted(cls, default: int, per_model: Mapping[str, int], reserved: int) -> Slots:
        """Slots with ``reserved`` lowered until it is below every model's slots: for slot counts
        learnt from the upstream, where refusing is no option (compare ``.reserved`` to warn)."""
        fewest = min([default, *per_model.values()])
        return cls(default, per_model, max(0, min(reserved, fewest - 1)))

    def of(self, model: str | None) -> int:
        """The slots of ``model`` (None: the default)."""
        if model is None:
            return self.default
        return self.per_model.get(model, self.default)

    @property
    def single(self) -> bool:
        """One slot for every model: the one-grant-at-a-time scheduler."""
        return self.default == 1 and all(slots == 1 for slots in self.per_model.values())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PolicyName(str, enum.Enum):
    SERIAL = "serial"  # priority + swap affinity + aging
    FIFO = "fifo"  # the model's configured priority + the header, then arrival

    def __str__(self) -> str:
        return self.value


class ReorderCause(str, enum.Enum):
    """A term of the score that changed which request went next."""

    AGING = "aging"
    SWAP_AFFINITY = "swap_affinity"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """How requests are ordered. Build with :meth:`serial` or :meth:`fifo`; the defaults of every
    setting live in the configuration (`llamaswap.config`), not here."""

    name: PolicyName
    aging_divisor_s: float
    swap_affinity_bonus: int
    # fifo only: the model's configured priority is added to the header's.
    model_priorities: Mapping[str, int]
    max_queued: int  # 0: unlimited
    max_wait_s: float  # 0: wait forever
    slots: Slots = dataclasses.field(default_factory=Slots)  # the default: one grant at a time

    @classmethod
    def serial(cls, *, aging_divisor_s: float, swap_affinity_bonus: int, max_queued: int = 0,
               max_wait_s: float = 0.0, slots: Slots | None = None) -> Policy:
        return cls(PolicyName.SERIAL, aging_divisor_s, swap_affinity_bonus, {}, max_queued, max_wait_s,
                   slots if slots is not None else Slots())

    @classmethod
    def fifo(cls, *, model_priorities: Mapping[str, int], max_queued: int = 0, max_wait_s: float = 0.0,
             slots: Slots | None = None) -> Policy:
        return cls(PolicyName.FIFO, 0.0, 0, dict(model_priorities), max_queued, max_wait_s,
                   slots if slots is not None else Slots())

    @property
    def aging_divisor_ns(self) -> int:
        return round(self.aging_divisor_s * NS_PER_S)

    @property
    def max_wait_ns(self) -> int:
        return round(self.max_wait_s * NS_PER_S)

    def base_priority(self, priority: int, model: str | None) -> int:
        if self.name is PolicyName.FIFO and model is not None:
            return priority + self.model_priorities.get(model, 0)
        return priority


class _Entry:
    __slots__ = ("request_id", "seq", "priority", "base", "model", "priority_model", "arrival_ns", "alive",
                 "older", "newer", "alone")

    def __init__(self, request_id: str, seq: int, priority: Priority, base: int, model: str | None,
                 arrival_ns: int, priority_model: str | None = None, alone: bool = False) -> None:
        self.request_id = request_id
        self.seq = seq
        self.priority = priority
        self.base = base
        self.model = model  # what it is scheduled on (affinity, swaps, slots)
        self.priority_model = priority_model if priority_model is not None else model  # models.<id>.priority
        self.arrival_ns = arrival_ns
        self.alive = True
        self.alone = alone  # granted only when nothing runs, and nothing beside it
        # Arrival order of the living, as a doubly linked list: O(1) removal, and a walk
        # from the oldest meets only waiting requests.
        self.older: _Entry | None = None
        self.newer: _Entry | None = None

    def __lt__(self, other: _Entry) -> bool:
        # Heap items are (key, seq, entry); a place taken over comes back with its seq, so a dead
        # item of the request that left may tie with it up to the entry: any order will do.
        return False


# Heap items: (negated key, seq, entry). seq is unique among the living, so living entries are never
# compared (a taken-over place's dead twin may be: `_Entry.__lt__`).
_Item = tuple[int, int, _Entry]


class _Index:
    """The waiting requests ordered by one time-free key: a global heap plus one heap per model
    (for the swap-affinity bonus). Entries leave lazily: a dead top is popped when it is met.

    ``taken`` (a set of seqs) lets a simulation treat entries as gone without touching them.
    """

    __slots__ = ("key", "scale", "all", "by_model")

    def __init__(self, key: Callable[[_Entry], int], scale: int) -> None:
        self.key = key
        self.scale = scale  # key units per priority point: the bonus is worth bonus * scale
        self.all: list[_Item] = []
        self.by_model: dict[str, list[_Item]] = {}

    def push(self, entry: _Entry) -> None:
        item: _Item = (-self.key(entry), entry.seq, entry)
        heapq.heappush(self.all, item)
        if entry.model is not None:
            heapq.heappush(self.by_model.setdefault(entry.model, []), item)

    def rebuild(self, entries: Iterable[_Entry]) -> None:
        key = self.key
        self.all = [(-key(entry), entry.seq, entry) for entry in entries]
        self.by_model = {}
        for item in self.all:
            model = item[2].model
            if model is not None:
                self.by_model.setdefault(model, []).append(item)
        heapq.heapify(self.all)
        for heap in self.by_model.values():
            heapq.heapify(heap)

    def copy(self) -> _Index:
        twin = _Index(self.key, self.scale)
        twin.all = list(self.all)
        twin.by_model = {model: list(heap) for model, heap in self.by_model.items()}
        return twin

    def top(self, taken: set[int] | None = None) -> _Item | None:
        return _prune(self.all, taken)

    def top_of(self, model: str, taken: set[int] | None = None) -> _Item | None:
        heap = self.by_model.get(model)
        if heap is None:
            return None
        item = _prune(heap, taken)
        if item is None:
            del self.by_model[model]
        return item


def _prune(heap: list[_Item], taken: set[int] | None) -> _Item | None:
    while heap and (not heap[0][2].alive or (taken is not None and heap[0][1] in taken)):
        heapq.heappop(heap)
    return heap[0] if heap else None


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
    previous_model: str | None
    reordered_by: frozenset[ReorderCause]
    overtook: tuple[str, ...]  # earlier arrivals it went ahead of (at most OVERTAKEN_LIMIT)
    queue_depth_after: int
    # Grants running once this one began, itself included (1 with one slot): the activity
    # record's serial_slots_busy. (The slots it was counted against: `Scheduler.slots_total`.)
    slots_busy: int = 1
    # It took a slot kept for the interactive band, ahead of a better-scored non-interactive
    # request that had used up its share of the slots.
    reserved_slot: bool = False
    # It runs alone (`Scheduler.enqueue`): nothing ran when it was granted, nothing is granted
    # beside it. It loads nothing (neither `load` nor `swap`).
    alone: bool = False

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


@dataclasses.dataclass(frozen=True, slots=True)
class BandStats:
    depth: int
    oldest_wait_s: float
    oldest_arrival_ns: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class QueueSnapshot:
    policy: PolicyName
    loaded_model: str | None
    running: RunningView | None  # the earliest of ``grants`` (with one slot, the grant)
    waiting: tuple[WaitingView, ...]  # dispatch order, if nothing changed from now on
    bands: Mapping[Band, BandStats]
    grants: tuple[RunningView, ...]  # every running grant, earliest first
    slots: int  # the slots of the model in effect (what `next` fills up to)
    slots_busy: int  # len(grants)


class _Load:
    """A model load begun by a grant (a load or a swap) that no release has confirmed yet:
    the model loaded before it, and whether a grant on it reached the upstream and got an
    answer that said nothing about the model (then, unconfirmed, the load may or may not have
    happened). Compared by identity."""

    __slots__ = ("previous", "unsure")

    def __init__(self, previous: str | None) -> None:
        self.previous = previous
        self.unsure = False


# A running grant: the request, why it won, and the load it ran on (if one was pending).
_Grant = tuple[_Entry, Decision, _Load | None]


class Scheduler:
    """Non-preemptive priority queue for one GPU that serves up to ``slots`` generations of its
    loaded model at once (one, by default: the size-1 resource of the specification)."""

    def __init__(self, policy: Policy, clock: Clock) -> None:
        self._clock = clock
        self._seq = 0
        self._dispatches = 0
        self._grants: dict[str, _Grant] = {}  # earliest first
        self._loaded_model: str | None = None
        # The load the loaded model came from while none of its grants has reached the upstream
        # (None once one has, or when the model was reported rather than loaded by a grant).
        self._load: _Load | None = None
        self._kept = KeptPlaces()
        self._apply_policy(policy)
        self._reset_queue()

    def _apply_policy(self, policy: Policy) -> None:
        self._policy = policy
        self._slots = policy.slots
        # The most slots of any model: one compare tells a full scheduler (with one slot, any grant).
        self._slot_most = max([policy.slots.default, *policy.slots.per_model.values()])
        self._divisor_ns = policy.aging_divisor_ns  # cached: read several times per dispatch
        self._bonus = policy.swap_affinity_bonus
        # The key ``next`` ranks by, and (when aging is on) the key without aging, which is
        # only needed to tell whether aging changed a pick.
        self._aged, self._plain = self._indexes()
        # With reserved slots, the same two for the interactive requests alone: the reserved
        # slots' candidates.
        self._reserved: tuple[_Index, _Index | None] | None = self._indexes() if policy.slots.reserved else None

    def _indexes(self) -> tuple[_Index, _Index | None]:
        divisor = self._divisor_ns
        if divisor:
            return _Index(lambda e: e.base * divisor - e.arrival_ns, divisor), _Index(lambda e: e.base, 1)
        return _Index(lambda e: e.base, 1), None

    def _reset_queue(self) -> None:
        self._waiting: dict[str, _Entry] = {}
        self._dead_in_heaps = 0
        self._rebuild(())
        self._oldest_entry: _Entry | None = None
        self._newest_entry: _Entry | None = None
        self._band_arrivals: dict[Band, deque[_Entry]] = {band: deque() for band in Band}
        self._band_depth: dict[Band, int] = dict.fromkeys(Band, 0)

    def _rebuild(self, alive: Sequence[_Entry]) -> None:
        self._aged.rebuild(alive)
        if self._plain is not None:
            self._plain.rebuild(alive)
        if self._reserved is not None:
            interactive = [entry for entry in alive if _interactive(entry)]
            aged, plain = self._reserved
            aged.rebuild(interactive)
            if plain is not None:
                plain.rebuild(interactive)

    # -- state ---------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def loaded_model(self) -> str | None:
        return self._loaded_model

    @property
    def dispatches(self) -> int:
        """Grants so far: the generation a loaded-model report was asked at."""
        return self._dispatches

    def set_loaded_model(self, model: str | None, *, as_of: int) -> bool:
        """What the upstream reports as loaded, asked when ``dispatches`` was ``as_of``.

        A report that a grant has overtaken (or that arrives while any request runs) describes a
        past the scheduler has already moved on from: it is dropped. True if applied.
        """
        if as_of != self._dispatches or self._grants:
            return False
        self._loaded_model = model
        self._load = None
        return True

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> Decision | None:
        """The earliest running grant (with one slot, the grant)."""
        for grant in self._grants.values():
            return grant[1]
        return None

    @property
    def running_id(self) -> str | None:
        """The request of the earliest running grant."""
        for request_id in self._grants:
            return request_id
        return None

    @property
    def running_grants(self) -> tuple[Decision, ...]:
        """Every running grant, earliest first."""
        return tuple(grant[1] for grant in self._grants.values())

    def is_running(self, request_id: str) -> bool:
        return request_id in self._grants

    @property
    def slots_busy(self) -> int:
        return len(self._grants)

    @property
    def slots_total(self) -> int:
        """The slots ``next`` fills up to now: those of the model the running grants name, else
        of the loaded model (the default when none is known)."""
        model = self._running_model()
        return self._slots.of(model if model is not None else self._loaded_model)

    # -- commands ------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: Priority, model: str | None = None, *,
                priority_model: str | None = None, alone: bool = False,
                retry_key: bytes | None = None) -> Queued:
        """Add a waiting request; says the queue depth it found and its arrival time.

        ``model`` is what it is scheduled on; ``priority_model`` (default: the same) is the name
        whose per-model priority it gets, which differs where a single-model upstream puts every
        request on its one model whatever name the client sent. ``alone``: it changes what the
        upstream has loaded under any generation (an unload of ``model``): granted only when
        nothing runs, nothing is granted beside it, and it loads nothing (its release says
        whether ``model`` is still loaded). A ``retry_key`` under which a place is kept (`keep`)
        with the same priority and model takes that place over: the place's arrival time and
        arrival order, so its aging, position and max wait."""
        if request_id in self._waiting or request_id in self._grants:
            raise SchedulerError(f"request {request_id!r} is already known")
        named = priority_model if priority_model is not None else model
        depth = len(self._waiting)
        now = self._clock.now_ns()
        place = self._kept.take(retry_key) if retry_key is not None else None
        if place is not None and (place.priority.value != priority.value or place.model != model
                                  or now >= place.until_ns or self._past_max_wait(place.arrival_ns, now)):
            # Not the same request after all, or a place already due (its end is `expire_kept`'s
            # to report, however late its timer runs): it stays kept.
            self._kept.add(place)
            place = None
        if place is None:
            limit = self._policy.max_queued
            if limit and depth + len(self._kept) >= limit:
                raise QueueFull(depth + len(self._kept), limit)
            self._seq += 1
            seq, arrival_ns = self._seq, now
        else:
            seq, arrival_ns = place.seq, place.arrival_ns
        entry = _Entry(request_id, seq, priority, self._policy.base_priority(priority.value, named), model,
                       arrival_ns, named, alone)
        self._waiting[request_id] = entry
        self._aged.push(entry)
        if self._plain is not None:
            self._plain.push(entry)
        if self._reserved is not None and _interactive(entry):
            aged, plain = self._reserved
            aged.push(entry)
            if plain is not None:
                plain.push(entry)
        if place is None:
            self._link(entry)
            self._band_arrivals[priority.band].append(entry)
        else:
            self._link_in_order(entry)
        self._band_depth[priority.band] += 1
        return Queued(depth, entry.arrival_ns, place)

    def keep(self, request_id: str, key: bytes, grace_ns: int) -> tuple[Removed, KeptPlace | None] | None:
        """A waiting request's client left: remove it, and keep its place under ``key`` for
        ``grace_ns`` (unless a place is already kept under that key). None if it is not waiting:
        a request that got the GPU never has a place kept."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        now = self._clock.now_ns()
        place = KeptPlace(key, request_id, entry.priority, entry.model, entry.priority_model, entry.arrival_ns,
                          entry.seq, now, now + grace_ns)
        return self._removed(entry, now), place if self._kept.add(place) else None

    def _past_max_wait(self, arrival_ns: int, now_ns: int) -> bool:
        limit_ns = self._policy.max_wait_ns
        return bool(limit_ns) and now_ns - arrival_ns >= limit_ns

    def expire_kept(self) -> list[KeptPlace]:
        """End every kept place whose grace period is over or that waited ``max_wait_s`` since
        its first arrival."""
        return self._kept.due(self._clock.now_ns(), self._policy.max_wait_ns)

    def drain_kept(self) -> list[KeptPlace]:
        """End every kept place (shutdown), oldest first."""
        return self._kept.drain()

    @property
    def kept(self) -> tuple[KeptPlace, ...]:
        """The kept places, oldest first."""
        return self._kept.places()

    @property
    def kept_count(self) -> int:
        return len(self._kept)

    def cancel(self, request_id: str) -> Removed | None:
        """Remove a waiting request; None if it is not waiting (already granted or gone)."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        return self._removed(entry, self._clock.now_ns())

    def next(self) -> Decision | None:
        """Grant the best waiting request if a slot is free for it; None if nothing can start.

        The dispatch rule. With nothing running, the best request in the order is granted,
        whatever model it needs. While fewer than ``slots`` grants run (the slots of the model
        they run on), the best request is granted at once if it needs the loaded model or no
        model. If it needs another model (a swap, or a load from nothing known loaded), or runs
        alone, nothing more is granted: the running grants drain, then it goes; lower-scored
        work of the loaded model never overtakes it (equal scores keep arrival order). Nothing
        is granted beside a request that runs alone.

        Reserved slots: a non-interactive request (priority below ``INTERACTIVE_FLOOR``) starts
        only while fewer than ``slots - reserved`` non-interactive grants run; interactive ones
        take any free slot. When the best request is non-interactive, needs the loaded model,
        and only reserved slots are free (its share is used up), the order is read as if the
        non-interactive requests were not in it: the best interactive request takes the free
        slot if it needs the loaded model or no model, whatever the non-interactive requests
        ahead of it need (none of them could use that slot); if it needs another model or runs
        alone, nothing is granted (an interactive swap waits for the drain, and no lower-scored
        work overtakes it). Such a grant says ``reserved_slot``.
        """
        if not self._waiting:
            return None
        busy = len(self._grants)
        loaded = self._loaded_model
        aged, plain = self._aged, self._plain
        reserved_slot = False
        if busy:
            if busy >= self._slot_most:
                return None  # (with one slot, always: nothing more runs beside a grant)
            running_model = self._running_model()
            total = self._slots.of(running_model if running_model is not None else loaded)
            if busy >= total or self._alone_runs():
                return None
            winner = self._pick(aged, loaded)
            if winner.alone or (winner.model is not None and winner.model != loaded):
                return None  # a swap (or a request that runs alone) waits until nothing runs
            if winner.priority.value < INTERACTIVE_FLOOR and self._non_interactive() >= total - self._slots.reserved:
                assert self._reserved is not None  # only reserved slots are free: reserved > 0
                aged, plain = self._reserved
                if aged.top() is None:
                    return None
                winner = self._pick(aged, loaded)
                if winner.alone or (winner.model is not None and winner.model != loaded):
                    return None
                reserved_slot = True
        else:
            winner = self._pick(aged, loaded)
        now = self._clock.now_ns()
        reasons: set[ReorderCause] = set()
        if plain is not None and self._pick(plain, loaded) is not winner:
            reasons.add(ReorderCause.AGING)
        if self._bonus and loaded is not None and _entry(aged.top()) is not winner:
            reasons.add(ReorderCause.SWAP_AFFINITY)
        overtook = self._overtaken_by(winner)
        self._remove(winner)
        model = winner.model
        alone = winner.alone
        loads = model is not None and not alone and model != loaded
        # `_affinity` and `_aging`, inline: this runs once per grant.
        affinity = self._bonus if model is not None and model == loaded else 0
        divisor = self._divisor_ns
        aging = (now - winner.arrival_ns) / divisor if divisor else 0.0
        self._dispatches += 1
        decision = Decision(
            request_id=winner.request_id,
            priority=winner.priority.value,
            band=winner.priority.band,
            score=winner.base + affinity + aging,
            arrival_ns=winner.arrival_ns,
            granted_ns=now,
            model=model,
            swap_affinity=affinity > 0,
            aging=aging,
            load=loads and loaded is None,
            swap=loads and loaded is not None,
            previous_model=loaded,
            reordered_by=frozenset(reasons),
            overtook=overtook,
            queue_depth_after=len(self._waiting),
            slots_busy=busy + 1,
            reserved_slot=reserved_slot,
            alone=alone,
        )
        load = None
        if model is not None and not alone:
            if loads:  # only with nothing running: a load of its own
                self._load = _Load(loaded)
                self._loaded_model = model
            load = self._load
        self._grants[winner.request_id] = (winner, decision, load)
        return decision

    def release(self, request_id: str, *, model_loaded: bool | None = True,
                reached_upstream: bool = True) -> Released:
        """End one running request's grant.

        ``model_loaded=False`` says the upstream failed the request (or unloaded its model), so
        its model is not known to be loaded: the loaded model becomes unknown until the upstream
        reports it. ``model_loaded=None`` says the upstream's answer tells nothing about the
        model (a 4xx, `core.model_stays_loaded`): what was loaded stays so, unless this grant
        used a load that no release has confirmed (it may never have happened: a model name the
        upstream does not know), below.
        ``reached_upstream=False`` says the grant was never used (its client left as it was
        given). A grant that loaded its model, and the grants of that model made while it stayed
        loaded, are that load's users: when the last of them is released and none confirmed the
        load, what was loaded before the load still is if none reached the upstream, and nothing
        is known to be loaded if some did with an answer that said nothing. (With one slot: a
        grant that never reached the upstream leaves the model loaded before it.)
        """
        grant = self._grants.pop(request_id, None)
        if grant is None:
            raise UnknownRequest(f"request {request_id!r} does not hold the grant")
        model = grant[0].model
        load = grant[2]
        if not reached_upstream or model_loaded is None:
            if load is not None and load is self._load:
                load.unsure = load.unsure or reached_upstream
                if all(other[2] is not load for other in self._grants.values()):
                    # Its last user, and none confirmed the load: none reached the upstream (what
                    # was loaded before still is), or those that did were not told (not known).
                    self._loaded_model = None if load.unsure else load.previous
                    self._load = None
        elif not model_loaded and model is not None and self._loaded_model == model:
            self._loaded_model = None
            self._load = None
        elif load is not None and load is self._load:
            self._load = None  # it reached the upstream: the load happened
        return Released(request_id, model, grant[1].granted_ns, self._clock.now_ns())

    def expire_overdue(self) -> list[Removed]:
        """Remove every request that has waited longer than ``max_wait_s``."""
        limit_ns = self._policy.max_wait_ns
        if not limit_ns:
            return []
        now = self._clock.now_ns()
        expired: list[Removed] = []
        while True:
            entry = self._oldest_entry
            if entry is None or now - entry.arrival_ns < limit_ns:
                return expired
            self._remove(entry)
            expired.append(self._removed(entry, now))

    def next_deadline_ns(self) -> int | None:
        """When the oldest waiting request will be overdue, or a kept place falls due
        (`expire_overdue`, `expire_kept`); None if neither can happen."""
        limit_ns = self._policy.max_wait_ns
        entry = self._oldest_entry if limit_ns else None
        waiting = None if entry is None else entry.arrival_ns + limit_ns
        kept = self._kept.next_deadline_ns(limit_ns) if self._kept else None
        if waiting is None or kept is None:
            return waiting if kept is None else kept
        return min(waiting, kept)

    def reconfigure(self, policy: Policy) -> None:
        """Apply new settings to the waiting requests, keeping their arrival times. Running
        grants keep their slots; with fewer slots than run, nothing starts until enough end."""
        alive = self._arrival_order()
        self._apply_policy(policy)
        for entry in alive:
            entry.base = policy.base_priority(entry.priority.value, entry.priority_model)
        self._rebuild(alive)
        self._dead_in_heaps = 0

    def drain(self) -> list[Removed]:
        """Remove every waiting request (shutdown), oldest first."""
        now = self._clock.now_ns()
        removed = [self._removed(entry, now) for entry in self._arrival_order()]
        for entry in self._waiting.values():
            entry.alive = False
        self._reset_queue()
        return removed

    # -- inspection ----------------------------------------------------------------------

    def snapshot(self) -> QueueSnapshot:
        """A read-only picture; the simulated order makes it O(n log n), so keep it off hot paths."""
        now = self._clock.now_ns()
        waiting = tuple(
            WaitingView(
                request_id=entry.request_id,
                position=index + 1,
                priority=entry.priority.value,
                band=entry.priority.band,
                score=entry.base + bonus + self._aging(now - entry.arrival_ns),
                swap_affinity=bonus > 0,
                waited_s=(now - entry.arrival_ns) / NS_PER_S,
                model=entry.model,
            )
            for index, (entry, bonus) in enumerate(self._dispatch_order())
        )
        grants = tuple(
            RunningView(
                request_id=decision.request_id,
                priority=decision.priority,
                band=decision.band,
                score=decision.score,
                model=decision.model,
                model_load=decision.model_load,
                queue_wait_s=decision.queue_wait_ns / NS_PER_S,
                running_s=(now - decision.granted_ns) / NS_PER_S,
            )
            for decision in (grant[1] for grant in self._grants.values())
        )
        return QueueSnapshot(self._policy.name, self._loaded_model, grants[0] if grants else None, waiting,
                             self.band_stats(), grants, self.slots_total, len(grants))

    def band_stats(self) -> dict[Band, BandStats]:
        """Depth and oldest wait per band in O(1) amortised (for metrics)."""
        now = self._clock.now_ns()
        stats = {}
        for band in Band:
            oldest = self._oldest(self._band_arrivals[band])
            if oldest is None:
                stats[band] = BandStats(0, 0.0, None)
            else:
                stats[band] = BandStats(self._band_depth[band], (now - oldest.arrival_ns) / NS_PER_S, oldest.arrival_ns)
        return stats

    # -- internals -----------------------------------------------------------------------

    def _running_model(self) -> str | None:
        """The model the running grants name (they name at most one)."""
        for entry, _, _ in self._grants.values():
            if entry.model is not None:
                return entry.model
        return None

    def _alone_runs(self) -> bool:
        """A running grant runs alone: nothing more is granted until it ends."""
        return any(entry.alone for entry, _, _ in self._grants.values())

    def _non_interactive(self) -> int:
        """Running grants below the interactive band: they hold the non-interactive share."""
        return sum(1 for entry, _, _ in self._grants.values() if entry.priority.value < INTERACTIVE_FLOOR)

    def _dispatch_order(self) -> list[tuple[_Entry, int]]:
        """The order `next` would grant in if nothing changed, with each one's affinity bonus
        at its turn: the same `_pick` on a copy of the index, each simulated grant making its
        model the loaded one."""
        index = self._aged.copy()
        taken: set[int] = set()
        loaded = self._loaded_model
        order: list[tuple[_Entry, int]] = []
        for _ in range(len(self._waiting)):
            pick = self._pick(index, loaded, taken)
            taken.add(pick.seq)
            order.append((pick, self._affinity(pick, loaded)))
            if pick.model is not None and not pick.alone:
                loaded = pick.model
        return order

    def _pick(self, index: _Index, loaded: str | None, taken: set[int] | None = None) -> _Entry:
        """The winner among the waiting in `index` while `loaded` is loaded: the better of the
        global top and the loaded model's top plus the bonus (key, then earlier arrival)."""
        top = index.top(taken)
        assert top is not None, "called with an empty queue"
        if loaded is None or not self._bonus:
            return top[2]
        favourite = index.top_of(loaded, taken)
        if favourite is None or favourite[2] is top[2]:
            return top[2]
        top_key = -top[0]  # the global top has no bonus, or it would be the favourite
        favourite_key = -favourite[0] + self._bonus * index.scale
        if favourite_key > top_key or (favourite_key == top_key and favourite[1] < top[1]):
            return favourite[2]
        return top[2]

    def _affinity(self, entry: _Entry, loaded: str | None) -> int:
        """The swap-affinity bonus, in points, that `entry` gets while `loaded` is loaded."""
        return self._bonus if entry.model is not None and entry.model == loaded else 0

    def _aging(self, waited_ns: int) -> float:
        return waited_ns / self._divisor_ns if self._divisor_ns else 0.0

    def _arrival_order(self) -> list[_Entry]:
        entries = []
        entry = self._oldest_entry
        while entry is not None:
            entries.append(entry)
            entry = entry.newer
        return entries

    def _link(self, entry: _Entry) -> None:
        entry.older = self._newest_entry
        entry.newer = None
        if self._newest_entry is not None:
            self._newest_entry.newer = entry
        else:
            self._oldest_entry = entry
        self._newest_entry = entry

    def _link_in_order(self, entry: _Entry) -> None:
        """Link a request that took a kept place over where its arrival order puts it, in the
        arrival list and its band's (O(n) in the newer requests: a retry, not every arrival)."""
        newer = None
        older = self._newest_entry
        while older is not None and older.seq > entry.seq:
            newer, older = older, older.older
        entry.older, entry.newer = older, newer
        if older is not None:
            older.newer = entry
        else:
            self._oldest_entry = entry
        if newer is not None:
            newer.older = entry
        else:
            self._newest_entry = entry
        arrivals = self._band_arrivals[entry.priority.band]
        index = len(arrivals)
        while index and arrivals[index - 1].seq > entry.seq:
            index -= 1
        arrivals.insert(index, entry)

    def _unlink(self, entry: _Entry) -> None:
        if entry.older is not None:
            entry.older.newer = entry.newer
        else:
            self._oldest_entry = entry.newer
        if entry.newer is not None:
            entry.newer.older = entry.older
        else:
            self._newest_entry = entry.older
        entry.older = entry.newer = None

    def _remove(self, entry: _Entry) -> None:
        entry.alive = False
        self._unlink(entry)
        del self._waiting[entry.request_id]
        self._band_depth[entry.priority.band] -= 1
        self._dead_in_heaps += 1
        if self._dead_in_heaps > len(self._waiting) + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        alive = self._arrival_order()
        self._rebuild(alive)
        self._band_arrivals = {band: deque(e for e in alive if e.priority.band is band) for band in Band}
        self._dead_in_heaps = 0

    @staticmethod
    def _oldest(arrivals: deque[_Entry]) -> _Entry | None:
        while arrivals and not arrivals[0].alive:
            arrivals.popleft()
        return arrivals[0] if arrivals else None

    def _overtaken_by(self, winner: _Entry) -> tuple[str, ...]:
        """Earlier arrivals still waiting; the list holds only the living, so this is O(limit)."""
        overtaken: list[str] = []
        entry = self._oldest_entry
        seq = winner.seq
        for _ in range(OVERTAKEN_LIMIT):  # (a bounded loop rather than a len() per step: per grant)
            if entry is None or entry.seq >= seq:
                break
            overtaken.append(entry.request_id)
            entry = entry.newer
        return tuple(overtaken)

    @staticmethod
    def _removed(entry: _Entry, now_ns: int) -> Removed:
        return Removed(entry.request_id, entry.priority.value, entry.priority.band, entry.model, entry.arrival_ns,
                       now_ns)


def _entry(item: _Item | None) -> _Entry | None:
    return item[2] if item is not None else None


def _interactive(entry: _Entry) -> bool:
    """In the interactive band: the reserved slots are for these."""
    return entry.priority.value >= INTERACTIVE_FLOOR
