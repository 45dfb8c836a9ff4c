"""The waiting requests' indexes: one heap per time-free key, plus one per model for the
swap-affinity bonus (why heaps work although scores change: `scheduler.py`'s docstring)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from heapq import heappush

from llamaswap.core.priority import Priority


class Entry:
    """A waiting request as the scheduler keeps it (it is also a `dispatch.Candidate`)."""

    __slots__ = ("request_id", "seq", "priority", "base", "model", "priority_model", "arrival_ns", "alive",
                 "older", "newer", "alone", "interactive", "max_tokens", "stoppable", "resumed")

    def __init__(self, request_id: str, seq: int, priority: Priority, base: int, model: str | None,
                 arrival_ns: int, priority_model: str | None = None, alone: bool = False,
                 max_tokens: int | None = None, stoppable: bool = False, resumed: bool = False) -> None:
        self.request_id = request_id
        self.seq = seq
        self.priority = priority
        self.base = base
        self.model = model  # what it is scheduled on (affinity, swaps, slots)
        self.priority_model = priority_model if priority_model is not None else model  # models.<id>.priority
        self.arrival_ns = arrival_ns
        self.alive = True
        self.alone = alone  # granted only when nothing runs, and nothing beside it
        self.interactive = priority.band.interactive  # may take a reserved slot
        self.max_tokens = max_tokens  # output tokens it asks for (None: not said): sizes its expected run
        self.stoppable = stoppable  # once granted, it may be stopped for a higher band (`preemption.py`)
        self.resumed = resumed  # a stopped line sent again (it took its stopped place back): a minimum run first
        # Arrival order of the living, as a doubly linked list: O(1) removal, and a walk
        # from the oldest meets only waiting requests.
        self.older: Entry | None = None
        self.newer: Entry | None = None

    def __lt__(self, other: Entry) -> bool:
        # Heap items are (key, seq, entry); a place taken over comes back with its seq, so a dead
        # item of the request that left may tie with it up to the entry: any order will do.
        return False


# Heap items: (negated key, seq, entry). seq is unique among the living, so living entries are never
# compared (a taken-over place's dead twin may be: `Entry.__lt__`).
Item = tuple[int, int, Entry]


class Index:
    """The waiting requests ordered by one time-free key (`key`): a global heap plus one heap per
    model (for the swap-affinity bonus). Entries leave lazily: a dead top is popped when it is met.

    ``taken`` (a set of seqs) lets a simulation treat entries as gone without touching them.
    """

    __slots__ = ("divisor_ns", "scale", "all", "by_model")

    def __init__(self, divisor_ns: int) -> None:
        self.divisor_ns = divisor_ns  # the aging divisor its key has (0: a key without aging)
        self.scale = divisor_ns or 1  # key units per priority point: the bonus is worth bonus * scale
        self.all: list[Item] = []
        # Per model named (None: no model), for the bonus and a node's GPUs.
        self.by_model: dict[str | None, list[Item]] = {}

    def key(self, entry: Entry) -> int:
        """Its time-free key, the larger the better: ``base * divisor - arrival`` with aging, else
        ``base`` (why it orders by score: `scheduler.py`'s docstring)."""
        divisor = self.divisor_ns
        return entry.base * divisor - entry.arrival_ns if divisor else entry.base

    def push(self, entry: Entry) -> None:
        divisor = self.divisor_ns  # (`key`, negated, inline: two pushes or more a request)
        item: Item = (entry.arrival_ns - entry.base * divisor if divisor else -entry.base, entry.seq, entry)
        heappush(self.all, item)
        heap = self.by_model.get(entry.model)  # (not setdefault: it builds a list at every push)
        if heap is None:
            heap = self.by_model[entry.model] = []
        heappush(heap, item)

    def rebuild(self, entries: Iterable[Entry]) -> None:
        key = self.key
        self.all = [(-key(entry), entry.seq, entry) for entry in entries]
        self.by_model = {}
        for item in self.all:
            self.by_model.setdefault(item[2].model, []).append(item)
        heapq.heapify(self.all)
        for heap in self.by_model.values():
            heapq.heapify(heap)

    def copy(self) -> Index:
        twin = Index(self.divisor_ns)
        twin.all = list(self.all)
        twin.by_model = {model: list(heap) for model, heap in self.by_model.items()}
        return twin

    def top(self, taken: set[int] | None = None) -> Item | None:
        return prune(self.all, taken)

    def top_of(self, model: str | None, taken: set[int] | None = None) -> Item | None:
        heap = self.by_model.get(model)
        if heap is None:
            return None
        item = prune(heap, taken)
        if item is None:
            del self.by_model[model]
        return item


class QueueIndexes:
    """The scheduler's indexes of its waiting requests: ``aged``, by the key `Scheduler.next` ranks
    by; ``plain``, where aging is on, by the key without aging (only needed to tell whether aging
    changed a pick; None without aging); with reserved slots, ``reserved``, the same two over the
    interactive requests alone (the reserved slots' candidates; None without)."""

    __slots__ = ("aged", "plain", "reserved", "_every")

    def __init__(self, divisor_ns: int, reserves_slots: bool) -> None:
        self.aged, self.plain = _ranked(divisor_ns)
        self.reserved = _ranked(divisor_ns) if reserves_slots else None
        every = (self.aged, self.plain, *(self.reserved or ()))
        self._every = tuple(index for index in every if index is not None)

    def push(self, entry: Entry) -> None:
        self.aged.push(entry)
        if self.plain is not None:
            self.plain.push(entry)
        if self.reserved is not None and entry.interactive:
            aged, plain = self.reserved
            aged.push(entry)
            if plain is not None:
                plain.push(entry)

    def rebuild(self, alive: Sequence[Entry]) -> None:
        self.aged.rebuild(alive)
        if self.plain is not None:
            self.plain.rebuild(alive)
        if self.reserved is not None:
            interactive = [entry for entry in alive if entry.interactive]
            aged, plain = self.reserved
            aged.rebuild(interactive)
            if plain is not None:
                plain.rebuild(interactive)

    def clear(self) -> None:
        """Nothing waits: every item left is dead, and all go at once (none is met one by one
        later, and a picture's copy of the heaps copies none: `order.dispatch_order`)."""
        for index in self._every:
            index.all.clear()
            index.by_model.clear()


def _ranked(divisor_ns: int) -> tuple[Index, Index | None]:
    """An index by the time-free key and, where aging is on, one by the key without aging."""
    return Index(divisor_ns), Index(0) if divisor_ns else None


def prune(heap: list[Item], taken: set[int] | None) -> Item | None:
    while heap and (not heap[0][2].alive or (taken is not None and heap[0][1] in taken)):
        heapq.heappop(heap)
    return heap[0] if heap else None


def entry_of(item: Item | None) -> Entry | None:
    return item[2] if item is not None else None
