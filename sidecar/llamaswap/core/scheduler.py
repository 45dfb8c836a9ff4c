"""The serial and fifo schedulers: one grant at a time, best score first.

score = priority + swap affinity + aging, where aging = waited_seconds / agingDivisor.

Why heaps work although scores change with time: with one divisor for everyone, every
waiting request gains aging at the same rate, so

    score_i(t) * D = (priority_i + bonus_i) * D - arrival_i + t

and the `t` term is common to all. Ordering by the time-free key
``(priority + bonus) * D - arrival`` therefore orders by current score. The only bonus is
swap affinity, which applies to exactly the requests whose model is loaded; those live in a
per-model heap, so the winner is the better of the top of the global heap and the top of the
loaded model's heap plus the bonus. Everything is integer nanoseconds, so the comparison is
exact and equal scores fall back to arrival order.

Invariants, enforced here:
- at most one request holds the grant (``running``); ``next`` grants only when it is free;
- a request is either waiting, running, or gone; never two at once;
- removed entries are deleted lazily from heaps and compacted when they outnumber the living.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Mapping
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
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """How requests are ordered. Build with :meth:`serial` or :meth:`fifo`."""

    name: str = "serial"
    aging_divisor_s: float = 60.0
    swap_affinity_bonus: int = 10
    # fifo only: the model's configured priority is added to the header's.
    model_priorities: Mapping[str, int] = dataclasses.field(default_factory=dict)
    max_queued: int = 0  # 0: unlimited
    max_wait_s: float = 0.0  # 0: wait forever

    @classmethod
    def serial(
        cls, aging_divisor_s: float = 60.0, swap_affinity_bonus: int = 10, *, max_queued: int = 0, max_wait_s: float = 0.0
    ) -> "Policy":
        return cls("serial", aging_divisor_s, swap_affinity_bonus, {}, max_queued, max_wait_s)

    @classmethod
    def fifo(
        cls, model_priorities: Mapping[str, int] | None = None, *, max_queued: int = 0, max_wait_s: float = 0.0
    ) -> "Policy":
        return cls("fifo", 0.0, 0, dict(model_priorities or {}), max_queued, max_wait_s)

    @property
    def aging_divisor_ns(self) -> int:
        return round(self.aging_divisor_s * NS_PER_S)

    def base_priority(self, priority: int, model: str | None) -> int:
        if self.name == "fifo" and model is not None:
            return priority + self.model_priorities.get(model, 0)
        return priority


class _Entry:
    __slots__ = ("request_id", "seq", "priority", "base", "model", "arrival_ns", "alive", "older", "newer")

    def __init__(self, request_id: str, seq: int, priority: Priority, base: int, model: str | None, arrival_ns: int):
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


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Why a request got the grant; one per dispatch."""

    request_id: str
    priority: int
    band: Band
    score: float
    queue_wait_ns: int
    model: str | None
    swap_affinity: bool
    aging: float
    swap: bool  # the model differs from the loaded one: the upstream will load it
    previous_model: str | None
    reordered_by: frozenset[str]  # subset of {"aging", "swap_affinity"}
    overtook: tuple[str, ...]  # earlier arrivals it went ahead of (at most OVERTAKEN_LIMIT)
    queue_depth_after: int

    @property
    def queue_wait_ms(self) -> float:
        return self.queue_wait_ns / 1e6


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    """A waiting request that left without a grant (cancelled or expired)."""

    request_id: str
    priority: int
    band: Band
    model: str | None
    queue_wait_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Released:
    request_id: str
    run_ns: int
    model: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class WaitingView:
    request_id: str
    position: int
    priority: int
    band: Band
    score: float
    waited_s: float
    model: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class RunningView:
    request_id: str
    priority: int
    band: Band
    score: float
    model: str | None
    queue_wait_s: float
    running_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class BandStats:
    depth: int
    oldest_wait_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class QueueSnapshot:
    policy: str
    loaded_model: str | None
    running: RunningView | None
    waiting: tuple[WaitingView, ...]  # dispatch order, if nothing changed from now on
    bands: Mapping[Band, BandStats]


class Scheduler:
    """Non-preemptive priority queue for one size-1 resource."""

    def __init__(self, policy: Policy, clock: Clock) -> None:
        self._clock = clock
        self._policy = policy
        self._divisor_ns = policy.aging_divisor_ns  # cached: read several times per dispatch
        self._seq = 0
        self._waiting: dict[str, _Entry] = {}
        self._dead_in_heaps = 0
        self._aged: list[_Item] = []
        self._aged_by_model: dict[str, list[_Item]] = {}
        self._plain: list[_Item] = []
        self._plain_by_model: dict[str, list[_Item]] = {}
        self._oldest_entry: _Entry | None = None
        self._newest_entry: _Entry | None = None
        self._band_arrivals: dict[Band, deque[_Entry]] = {band: deque() for band in Band}
        self._band_depth: dict[Band, int] = {band: 0 for band in Band}
        self._running: _Entry | None = None
        self._running_since_ns = 0
        self._running_decision: Decision | None = None
        self._loaded_model: str | None = None

    # -- state ---------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def loaded_model(self) -> str | None:
        return self._loaded_model

    def set_loaded_model(self, model: str | None) -> None:
        """Tell the core what the upstream has loaded (reconciled from the upstream)."""
        self._loaded_model = model

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def running_id(self) -> str | None:
        return self._running.request_id if self._running is not None else None

    @property
    def running_decision(self) -> Decision | None:
        return self._running_decision

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def band_depths(self) -> dict[Band, int]:
        return dict(self._band_depth)

    # -- commands ------------------------------------------------------------------------

    def enqueue(self, request_id: str, priority: Priority, model: str | None = None) -> int:
        """Add a waiting request; returns the queue depth it found on arrival."""
        if request_id in self._waiting or (self._running is not None and self._running.request_id == request_id):
            raise SchedulerError(f"request {request_id!r} is already known")
        depth = len(self._waiting)
        limit = self._policy.max_queued
        if limit and depth >= limit:
            raise QueueFull(depth, limit)
        self._seq += 1
        entry = _Entry(
            request_id, self._seq, priority, self._policy.base_priority(priority.value, model), model, self._clock.now_ns()
        )
        self._waiting[request_id] = entry
        self._push(entry)
        self._link(entry)
        self._band_arrivals[priority.band].append(entry)
        self._band_depth[priority.band] += 1
        return depth

    def cancel(self, request_id: str) -> Removed | None:
        """Remove a waiting request; None if it is not waiting (already granted or gone)."""
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        self._remove(entry)
        return self._removed(entry)

    def next(self) -> Decision | None:
        """Grant the best waiting request if nothing is running."""
        if self._running is not None or not self._waiting:
            return None
        now = self._clock.now_ns()
        winner = self._best(self._aged, self._aged_by_model, aged=True)
        reasons: set[str] = set()
        divisor = self._divisor_ns
        bonus = self._policy.swap_affinity_bonus
        if divisor and self._best(self._plain, self._plain_by_model, aged=False) is not winner:
            reasons.add("aging")
        if bonus and self._loaded_model is not None and self._top(self._aged) is not winner:
            reasons.add("swap_affinity")
        overtook = self._overtaken_by(winner)
        self._remove(winner)
        affinity = bool(bonus) and winner.model is not None and winner.model == self._loaded_model
        waited = now - winner.arrival_ns
        aging = waited / divisor if divisor else 0.0
        previous = self._loaded_model
        decision = Decision(
            request_id=winner.request_id,
            priority=winner.priority.value,
            band=winner.priority.band,
            score=winner.base + (bonus if affinity else 0) + aging,
            queue_wait_ns=waited,
            model=winner.model,
            swap_affinity=affinity,
            aging=aging,
            swap=winner.model is not None and winner.model != previous,
            previous_model=previous,
            reordered_by=frozenset(reasons),
            overtook=overtook,
            queue_depth_after=len(self._waiting),
        )
        self._running = winner
        self._running_since_ns = now
        self._running_decision = decision
        if winner.model is not None:
            self._loaded_model = winner.model
        return decision

    def release(self, request_id: str) -> Released:
        """End the running request's grant."""
        running = self._running
        if running is None or running.request_id != request_id:
            raise UnknownRequest(f"request {request_id!r} does not hold the grant")
        self._running = None
        self._running_decision = None
        return Released(request_id, self._clock.now_ns() - self._running_since_ns, running.model)

    def expire_overdue(self) -> list[Removed]:
        """Remove every request that has waited longer than ``max_wait_s``."""
        limit_ns = round(self._policy.max_wait_s * NS_PER_S)
        if not limit_ns:
            return []
        now = self._clock.now_ns()
        expired: list[Removed] = []
        while True:
            entry = self._oldest_entry
            if entry is None or now - entry.arrival_ns < limit_ns:
                return expired
            self._remove(entry)
            expired.append(self._removed(entry))

    def next_deadline_ns(self) -> int | None:
        """When the oldest waiting request will be overdue; None without a limit."""
        limit_ns = round(self._policy.max_wait_s * NS_PER_S)
        entry = self._oldest_entry if limit_ns else None
        return None if entry is None else entry.arrival_ns + limit_ns

    def reconfigure(self, policy: Policy) -> None:
        """Apply new settings to the waiting requests, keeping their arrival times."""
        self._policy = policy
        self._divisor_ns = policy.aging_divisor_ns
        for entry in self._waiting.values():
            entry.base = policy.base_priority(entry.priority.value, entry.model)
        self._rebuild()

    def drain(self) -> list[Removed]:
        """Remove every waiting request (shutdown)."""
        removed = [self._removed(entry) for entry in sorted(self._waiting.values(), key=lambda e: e.seq)]
        for entry in list(self._waiting.values()):
            self._remove(entry)
        return removed

    # -- inspection ----------------------------------------------------------------------

    def score_of(self, request_id: str) -> float | None:
        entry = self._waiting.get(request_id)
        if entry is None:
            return None
        return self._score(entry, self._clock.now_ns())

    def snapshot(self) -> QueueSnapshot:
        """A read-only picture; sorting makes it O(n log n), so keep it off hot paths."""
        now = self._clock.now_ns()
        ordered = self._dispatch_order()
        waiting = tuple(
            WaitingView(
                request_id=e.request_id,
                position=index + 1,
                priority=e.priority.value,
                band=e.priority.band,
                score=self._score(e, now),
                waited_s=(now - e.arrival_ns) / NS_PER_S,
                model=e.model,
            )
            for index, e in enumerate(ordered)
        )
        running = None
        if self._running is not None and self._running_decision is not None:
            d = self._running_decision
            running = RunningView(
                request_id=d.request_id,
                priority=d.priority,
                band=d.band,
                score=d.score,
                model=d.model,
                queue_wait_s=d.queue_wait_ns / NS_PER_S,
                running_s=(now - self._running_since_ns) / NS_PER_S,
            )
        return QueueSnapshot(self._policy.name, self._loaded_model, running, waiting, self.band_stats())

    def _dispatch_order(self) -> list[_Entry]:
        """The order `next` would grant in if nothing changed: each grant makes its model the
        loaded one, so the affinity bonus moves as the simulated queue drains."""
        bonus = self._policy.swap_affinity_bonus
        scale = self._divisor_ns or 1
        ranked = sorted(self._waiting.values(), key=lambda e: (-self._aged_key(e), e.seq))
        if not bonus:
            return ranked
        by_model: dict[str, deque[_Entry]] = {}
        for entry in ranked:
            if entry.model is not None:
                by_model.setdefault(entry.model, deque()).append(entry)
        taken: set[int] = set()
        order: list[_Entry] = []
        loaded = self._loaded_model
        index = 0
        while len(order) < len(ranked):
            while ranked[index].seq in taken:
                index += 1
            pick = ranked[index]
            same_model = by_model.get(loaded) if loaded is not None else None
            while same_model and same_model[0].seq in taken:
                same_model.popleft()
            if same_model and same_model[0] is not pick:
                favourite = same_model[0]
                top_key = self._aged_key(pick) + self._affinity(pick, loaded) * scale
                favourite_key = self._aged_key(favourite) + bonus * scale
                if self._ahead(favourite_key, favourite, top_key, pick):
                    pick = favourite
            taken.add(pick.seq)
            order.append(pick)
            if pick.model is not None:
                loaded = pick.model
        return order

    def band_stats(self) -> dict[Band, BandStats]:
        """Depth and oldest wait per band in O(1) amortised (for metrics)."""
        now = self._clock.now_ns()
        stats = {}
        for band in Band:
            oldest = self._oldest(self._band_arrivals[band])
            wait = (now - oldest.arrival_ns) / NS_PER_S if oldest is not None else 0.0
            stats[band] = BandStats(self._band_depth[band], wait)
        return stats

    # -- internals -----------------------------------------------------------------------

    def _affinity(self, entry: _Entry, loaded: str | None) -> int:
        """The swap-affinity bonus, in points, that `entry` gets while `loaded` is loaded."""
        return self._policy.swap_affinity_bonus if entry.model is not None and entry.model == loaded else 0

    @staticmethod
    def _ahead(key: int, entry: _Entry, other_key: int, other: _Entry) -> bool:
        """Whether `entry` goes before `other`: the larger key, then the earlier arrival."""
        return key > other_key or (key == other_key and entry.seq < other.seq)

    def _score_key(self, entry: _Entry) -> int:
        """The time-free key (see module doc), including the loaded model's bonus."""
        bonus = self._affinity(entry, self._loaded_model)
        divisor = self._divisor_ns
        return (entry.base + bonus) * divisor - entry.arrival_ns if divisor else entry.base + bonus

    def _score(self, entry: _Entry, now_ns: int) -> float:
        bonus = self._affinity(entry, self._loaded_model)
        divisor = self._divisor_ns
        return entry.base + bonus + ((now_ns - entry.arrival_ns) / divisor if divisor else 0.0)

    def _aged_key(self, entry: _Entry) -> int:
        divisor = self._divisor_ns
        return entry.base * divisor - entry.arrival_ns if divisor else entry.base

    def _push(self, entry: _Entry) -> None:
        aged: _Item = (-self._aged_key(entry), entry.seq, entry)
        heapq.heappush(self._aged, aged)
        if entry.model is not None:
            heapq.heappush(self._aged_by_model.setdefault(entry.model, []), aged)
        if self._divisor_ns:
            # Only needed to tell whether aging changed a pick.
            plain: _Item = (-entry.base, entry.seq, entry)
            heapq.heappush(self._plain, plain)
            if entry.model is not None:
                heapq.heappush(self._plain_by_model.setdefault(entry.model, []), plain)

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
            self._rebuild()

    def _rebuild(self) -> None:
        alive = sorted(self._waiting.values(), key=lambda e: e.seq)
        self._aged, self._plain = [], []
        self._aged_by_model, self._plain_by_model = {}, {}
        for entry in alive:
            self._push(entry)
        self._band_arrivals = {band: deque(e for e in alive if e.priority.band is band) for band in Band}
        self._dead_in_heaps = 0

    @staticmethod
    def _top(heap: list[_Item]) -> _Entry | None:
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _best(self, heap: list[_Item], by_model: dict[str, list[_Item]], *, aged: bool) -> _Entry:
        """The winner among waiting requests, counting the loaded model's bonus."""
        top = self._top(heap)
        assert top is not None, "called with an empty queue"
        loaded = self._loaded_model
        bonus = self._policy.swap_affinity_bonus
        if loaded is None or not bonus:
            return top
        model_heap = by_model.get(loaded)
        if model_heap is None:
            return top
        favourite = self._top(model_heap)
        if favourite is None:
            del by_model[loaded]
            return top
        if favourite is top:
            return top
        scale = self._divisor_ns if aged and self._divisor_ns else 1
        top_key = -heap[0][0] + self._affinity(top, loaded) * scale
        favourite_key = -model_heap[0][0] + bonus * scale
        return favourite if self._ahead(favourite_key, favourite, top_key, top) else top

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

    def _removed(self, entry: _Entry) -> Removed:
        return Removed(entry.request_id, entry.priority.value, entry.priority.band, entry.model,
                       self._clock.now_ns() - entry.arrival_ns)
