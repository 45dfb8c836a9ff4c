# The scheduling core's scheduler as it was before slots (main at d77fb0f), frozen here unchanged
# below this header: tests/test_scheduler_legacy.py drives it and today's scheduler with one slot
# side by side and asserts they decide the same. Not imported by anything else; delete it when
# the one-slot equivalence no longer needs proving.
# ruff: noqa
"""The serial and fifo schedulers: one grant at a time, best score first.

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

Invariants, enforced here:
- at most one request holds the grant (``running``); ``next`` grants only when it is free;
- a request is either waiting, running, or gone; never two at once;
- the dispatch order shown by ``snapshot`` is the order ``next`` would grant in, because both
  use the same ``_pick``;
- a loaded-model report older than the latest grant is ignored (``set_loaded_model``);
- removed entries are deleted lazily from heaps and compacted when they outnumber the living.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from llamaswap.core.clock import Clock
from llamaswap.core.priority import Band, Priority

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

    @classmethod
    def serial(cls, *, aging_divisor_s: float, swap_affinity_bonus: int, max_queued: int = 0,
               max_wait_s: float = 0.0) -> Policy:
        return cls(PolicyName.SERIAL, aging_divisor_s, swap_affinity_bonus, {}, max_queued, max_wait_s)

    @classmethod
    def fifo(cls, *, model_priorities: Mapping[str, int], max_queued: int = 0, max_wait_s: float = 0.0) -> Policy:
        return cls(PolicyName.FIFO, 0.0, 0, dict(model_priorities), max_queued, max_wait_s)

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
    __slots__ = ("request_id", "seq", "priority", "base", "model", "arrival_ns", "alive", "older", "newer")

    def __init__(self, request_id: str, seq: int, priority: Priority, base: int, model: str | None,
                 arrival_ns: int) -> None:
        self.request_id = request_id
        self.seq = seq
        self.priority = priority
        self.base = base
        self.model = model
        self.arrival_ns = arrival_ns
        self.alive = True
        # Arrival order of the living, as a doubly linked list: O(1) removal, and a walk
        # from the oldest meets only waiting requests.
        self.older: _Entry | None = None
        self.newer: _Entry | None = None


# Heap items: (negated key, seq, entry). seq is unique, so entries are never compared.
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
    running: RunningView | None
    waiting: tuple[WaitingView, ...]  # dispatch order, if nothing changed from now on
    bands: Mapping[Band, BandStats]


class Scheduler:
    """Non-preemptive priority queue for one size-1 resource."""

    def __init__(self, policy: Policy, clock: Clock) -> None:
        self._clock = clock
        self._seq = 0
        self._dispatches = 0
        self._running: _Entry | None = None
        self._running_decision: Decision | None = None
        self._loaded_model: str | None = None
        self._apply_policy(policy)
        self._reset_queue()

    def _apply_policy(self, policy: Policy) -> None:
        self._policy = policy
        self._divisor_ns = policy.aging_divisor_ns  # cached: read several times per dispatch
        self._bonus = policy.swap_affinity_bonus
        # The key ``next`` ranks by, and (when aging is on) the key without aging, which is
        # only needed to tell whether aging changed a pick.
        divisor = self._divisor_ns
        if divisor:
            self._aged = _Index(lambda e: e.base * divisor - e.arrival_ns, divisor)
            self._plain: _Index | None = _Index(lambda e: e.base, 1)
        else:
            self._aged = _Index(lambda e: e.base, 1)
            self._plain = None

    def _reset_queue(self) -> None:
        self._waiting: dict[str, _Entry] = {}
        self._dead_in_heaps = 0
        self._aged.rebuild(())
        if self._plain is not None:
            self._plain.rebuild(())
        self._oldest_entry: _Entry | None = None
        self._newest_entry: _Entry | None = None
        self._band_arrivals: dict[Band, deque[_Entry]] = {band: deque() for band in Band}
        self._band_depth: dict[Band, int] = dict.fromkeys(Band, 0)

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

        A report that a grant has overtaken (or that arrives while a request runs) describes a
        past the scheduler has already moved on from: it is dropped. True if applied.
        """
        if as_of != self._dispatches or self._running is not None:
            return False
        self._loaded_model = model
        return True

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> Decision | None:
        return self._running_decision

    @property
    def running_id(self) -> str | None:
        return self._running.request_id if self._running is not None else None

    # -- commands ------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: Priority, model: str | None = None) -> Queued:
        """Add a waiting request; says the queue depth it found and its arrival time."""
        if request_id in self._waiting or (self._running is not None and self._running.request_id == request_id):
            raise SchedulerError(f"request {request_id!r} is already known")
        depth = len(self._waiting)
        limit = self._policy.max_queued
        if limit and depth >= limit:
            raise QueueFull(depth, limit)
        self._seq += 1
        entry = _Entry(request_id, self._seq, priority, self._policy.base_priority(priority.value, model), model,
                       self._clock.now_ns())
        self._waiting[request_id] = entry
        self._aged.push(entry)
        if self._plain is not None:
            self._plain.push(entry)
        self._link(entry)
        self._band_arrivals[priority.band].append(entry)
        self._band_depth[priority.band] += 1
        return Queued(depth, entry.arrival_ns)

    def cancel(self, request_id: str) -> Removed | None:
        """Remove a waiting request; None if it is not waiting (already granted or gone)."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        return self._removed(entry, self._clock.now_ns())

    def next(self) -> Decision | None:
        """Grant the best waiting request if nothing is running."""
        if self._running is not None or not self._waiting:
            return None
        now = self._clock.now_ns()
        loaded = self._loaded_model
        winner = self._pick(self._aged, loaded)
        reasons: set[ReorderCause] = set()
        if self._plain is not None and self._pick(self._plain, loaded) is not winner:
            reasons.add(ReorderCause.AGING)
        if self._bonus and loaded is not None and _entry(self._aged.top()) is not winner:
            reasons.add(ReorderCause.SWAP_AFFINITY)
        overtook = self._overtaken_by(winner)
        self._remove(winner)
        affinity = self._affinity(winner, loaded) > 0
        aging = self._aging(now - winner.arrival_ns)
        self._dispatches += 1
        decision = Decision(
            request_id=winner.request_id,
            priority=winner.priority.value,
            band=winner.priority.band,
            score=winner.base + self._affinity(winner, loaded) + aging,
            arrival_ns=winner.arrival_ns,
            granted_ns=now,
            model=winner.model,
            swap_affinity=affinity,
            aging=aging,
            load=winner.model is not None and loaded is None,
            swap=winner.model is not None and loaded is not None and winner.model != loaded,
            previous_model=loaded,
            reordered_by=frozenset(reasons),
            overtook=overtook,
            queue_depth_after=len(self._waiting),
        )
        self._running = winner
        self._running_decision = decision
        if winner.model is not None:
            self._loaded_model = winner.model
        return decision

    def release(self, request_id: str, *, model_loaded: bool = True, reached_upstream: bool = True) -> Released:
        """End the running request's grant.

        ``model_loaded=False`` says the upstream failed the request, so its model is not known
        to be loaded: the loaded model becomes unknown until the upstream reports it.
        ``reached_upstream=False`` says the grant was never used (its client left as it was
        given): what was loaded before it still is.
        """
        running = self._running
        decision = self._running_decision
        if running is None or decision is None or running.request_id != request_id:
            raise UnknownRequest(f"request {request_id!r} does not hold the grant")
        self._running = None
        self._running_decision = None
        if not reached_upstream:
            self._loaded_model = decision.previous_model
        elif not model_loaded and running.model is not None and self._loaded_model == running.model:
            self._loaded_model = None
        return Released(request_id, running.model, decision.granted_ns, self._clock.now_ns())

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
        """When the oldest waiting request will be overdue; None without a limit."""
        limit_ns = self._policy.max_wait_ns
        entry = self._oldest_entry if limit_ns else None
        return None if entry is None else entry.arrival_ns + limit_ns

    def reconfigure(self, policy: Policy) -> None:
        """Apply new settings to the waiting requests, keeping their arrival times."""
        alive = self._arrival_order()
        self._apply_policy(policy)
        for entry in alive:
            entry.base = policy.base_priority(entry.priority.value, entry.model)
        self._aged.rebuild(alive)
        if self._plain is not None:
            self._plain.rebuild(alive)
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
        running = None
        decision = self._running_decision
        if decision is not None:
            running = RunningView(
                request_id=decision.request_id,
                priority=decision.priority,
                band=decision.band,
                score=decision.score,
                model=decision.model,
                model_load=decision.model_load,
                queue_wait_s=decision.queue_wait_ns / NS_PER_S,
                running_s=(now - decision.granted_ns) / NS_PER_S,
            )
        return QueueSnapshot(self._policy.name, self._loaded_model, running, waiting, self.band_stats())

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
            if pick.model is not None:
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
        self._aged.rebuild(alive)
        if self._plain is not None:
            self._plain.rebuild(alive)
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
        while entry is not None and entry.seq < winner.seq and len(overtaken) < OVERTAKEN_LIMIT:
            overtaken.append(entry.request_id)
            entry = entry.newer
        return tuple(overtaken)

    @staticmethod
    def _removed(entry: _Entry, now_ns: int) -> Removed:
        return Removed(entry.request_id, entry.priority.value, entry.priority.band, entry.model, entry.arrival_ns,
                       now_ns)


def _entry(item: _Item | None) -> _Entry | None:
    return item[2] if item is not None else None
