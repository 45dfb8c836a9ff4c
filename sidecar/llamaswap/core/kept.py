"""Kept places: the queue position of a waiting request whose client left, held for a grace
period so that the client's retry of the same request takes it over.

A retry that takes a place over gets the place's arrival time, so its aging, its position and
its maxWaitSeconds clock all count from the first try. What "the same request" is, is decided
outside the core (a keyed hash of the caller and the request, `runtime/kept.py`); the core only
compares the opaque key, and checks the priority and model too.

Rules, enforced here and in `Scheduler.keep` / `Scheduler.enqueue`:
- a place is kept only for a request that is waiting: one that ever got the GPU never is;
- one place per key (the first one kept; a second leaving with the same key is simply gone);
- a kept place counts against maxQueued while kept;
- each place ends exactly once: taken over, or due (its grace period or its maxWaitSeconds
  passed), or drained at shutdown.
"""

from __future__ import annotations

import dataclasses
import heapq

from llamaswap.core.index import Entry
from llamaswap.core.priority import Priority


@dataclasses.dataclass(frozen=True, slots=True)
class KeptPlace:
    """A waiting request's place, kept after its client left."""

    key: bytes  # what a retry must present (opaque to the core)
    request_id: str  # the scheduler's id of the request that left
    priority: Priority
    model: str | None  # what it was scheduled on
    priority_model: str | None  # whose models.<id>.priority it had
    arrival_ns: int  # the first try's arrival: what a taker inherits
    seq: int  # its arrival order among all requests (ties in score go by it)
    left_ns: int  # when its client left
    until_ns: int  # the end of its grace period
    stopped: bool = False  # a running line's place, kept when it was stopped (`preemption.py`)

    @property
    def waited_ns(self) -> int:
        """How long it had waited when its client left."""
        return self.left_ns - self.arrival_ns

    @classmethod
    def of(cls, entry: Entry, key: bytes, now_ns: int, grace_ns: int, *, stopped: bool = False) -> KeptPlace:
        """The place of `entry`, whose client left at `now_ns` (``stopped``: a running line stopped
        then), kept for `grace_ns`."""
        return cls(key, entry.request_id, entry.priority, entry.model, entry.priority_model, entry.arrival_ns,
                   entry.seq, now_ns, now_ns + grace_ns, stopped)


class KeptPlaces:
    """The kept places by key, with their deadlines: the grace period's end (a heap by it) and
    the maxWaitSeconds one (a heap by arrival). Heaps are pruned lazily, so each operation costs
    O(log n) amortised however many places are kept."""

    __slots__ = ("_by_key", "_by_until", "_by_arrival")

    def __init__(self) -> None:
        self._by_key: dict[bytes, KeptPlace] = {}
        self._by_until: list[tuple[int, int, bytes]] = []
        self._by_arrival: list[tuple[int, int, bytes]] = []

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def add(self, place: KeptPlace) -> bool:
        """Keep `place`; False (nothing kept) if a place is already kept under its key."""
        if place.key in self._by_key:
            return False
        self._by_key[place.key] = place
        heapq.heappush(self._by_until, (place.until_ns, place.seq, place.key))
        heapq.heappush(self._by_arrival, (place.arrival_ns, place.seq, place.key))
        return True

    def take(self, key: bytes) -> KeptPlace | None:
        """Remove and return the place kept under `key`, if any."""
        return self._by_key.pop(key, None)

    def take_over(self, key: bytes, priority: Priority, model: str | None, now_ns: int,
                  max_wait_ns: int) -> KeptPlace | None:
        """The place a retry under `key` with `priority` and `model` takes over at `now_ns`, removed;
        None if none is kept under `key`, or if the one kept is not the same request after all (another
        priority or model) or is already due (its end is `due`'s to report, however late its timer
        runs): then it stays kept."""
        place = self.take(key)
        if place is None:
            return None
        if (place.priority.value != priority.value or place.model != model or now_ns >= place.until_ns
                or (max_wait_ns and now_ns - place.arrival_ns >= max_wait_ns)):
            self.add(place)
            return None
        return place

    def due(self, now_ns: int, max_wait_ns: int) -> list[KeptPlace]:
        """Remove and return every place whose grace period ended, or that has waited
        maxWaitSeconds (`max_wait_ns`, 0: no limit) since its first arrival."""
        ended: list[KeptPlace] = []
        while (top := self._top(self._by_until, until=True)) is not None and top.until_ns <= now_ns:
            ended.append(self._by_key.pop(top.key))
        if max_wait_ns:
            while ((top := self._top(self._by_arrival, until=False)) is not None
                   and top.arrival_ns + max_wait_ns <= now_ns):
                ended.append(self._by_key.pop(top.key))
        return ended

    def next_deadline_ns(self, max_wait_ns: int) -> int | None:
        """When the next place falls due; None with none kept."""
        until = self._top(self._by_until, until=True)
        if until is None:
            return None
        oldest = self._top(self._by_arrival, until=False) if max_wait_ns else None
        return until.until_ns if oldest is None else min(until.until_ns, oldest.arrival_ns + max_wait_ns)

    def drain(self) -> list[KeptPlace]:
        """Remove and return every place, oldest first (shutdown)."""
        places = sorted(self._by_key.values(), key=lambda place: place.seq)
        self._by_key.clear()
        self._by_until.clear()
        self._by_arrival.clear()
        return places

    def places(self) -> tuple[KeptPlace, ...]:
        """Every kept place, oldest first (for views)."""
        return tuple(sorted(self._by_key.values(), key=lambda place: place.seq))

    def _top(self, heap: list[tuple[int, int, bytes]], *, until: bool) -> KeptPlace | None:
        # An entry is live while its key still names a place with the same time and seq: a place
        # taken over keeps its seq, and may be kept again with a later grace period.
        while heap:
            at_ns, seq, key = heap[0]
            place = self._by_key.get(key)
            if place is not None and place.seq == seq and (place.until_ns if until else place.arrival_ns) == at_ns:
                return place
            heapq.heappop(heap)
        return None
