"""The waiting requests in arrival order: who waited longest (max wait, the overtaken, the
shutdown's order) and each band's depth and oldest (the gauges), all without a scan."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from llamaswap.core.index import Entry
from llamaswap.core.priority import Band


class Arrivals:
    """A doubly linked list of the living entries, oldest first (O(1) removal; a walk from the
    oldest meets only waiting requests), and per band a deque whose dead entries leave lazily."""

    __slots__ = ("oldest", "newest", "_by_band", "_depth")

    def __init__(self) -> None:
        self.oldest: Entry | None = None
        self.newest: Entry | None = None
        self._by_band: dict[Band, deque[Entry]] = {band: deque() for band in Band}
        self._depth: dict[Band, int] = dict.fromkeys(Band, 0)

    def add(self, entry: Entry) -> None:
        """The newest arrival."""
        entry.older = self.newest
        entry.newer = None
        if self.newest is not None:
            self.newest.newer = entry
        else:
            self.oldest = entry
        self.newest = entry
        band = entry.priority.band
        self._by_band[band].append(entry)
        self._depth[band] += 1

    def add_in_order(self, entry: Entry) -> None:
        """A request that took a kept place over, where its arrival order (its seq) puts it, in the
        list and its band's (O(n) in the newer requests: a retry, not every arrival)."""
        newer = None
        older = self.newest
        while older is not None and older.seq > entry.seq:
            newer, older = older, older.older
        entry.older, entry.newer = older, newer
        if older is not None:
            older.newer = entry
        else:
            self.oldest = entry
        if newer is not None:
            newer.older = entry
        else:
            self.newest = entry
        band = entry.priority.band
        arrivals = self._by_band[band]
        index = len(arrivals)
        while index and arrivals[index - 1].seq > entry.seq:
            index -= 1
        arrivals.insert(index, entry)
        self._depth[band] += 1

    def remove(self, entry: Entry) -> None:
        """A waiting request left (its band's deque drops it when met: `oldest_of`)."""
        if entry.older is not None:
            entry.older.newer = entry.newer
        else:
            self.oldest = entry.newer
        if entry.newer is not None:
            entry.newer.older = entry.older
        else:
            self.newest = entry.older
        entry.older = entry.newer = None
        self._depth[entry.priority.band] -= 1

    def order(self) -> list[Entry]:
        """The living, oldest first."""
        entries = []
        entry = self.oldest
        while entry is not None:
            entries.append(entry)
            entry = entry.newer
        return entries

    def compact(self, alive: Iterable[Entry]) -> None:
        """Drop the bands' dead entries (``alive``: the living, oldest first)."""
        self._by_band = {band: deque() for band in Band}
        for entry in alive:
            self._by_band[entry.priority.band].append(entry)

    def depth(self, band: Band) -> int:
        return self._depth[band]

    def oldest_of(self, band: Band) -> Entry | None:
        """The band's longest waiting request, O(1) amortised."""
        arrivals = self._by_band[band]
        while arrivals and not arrivals[0].alive:
            arrivals.popleft()
        return arrivals[0] if arrivals else None

    def before(self, winner: Entry, limit: int) -> tuple[str, ...]:
        """Up to ``limit`` earlier arrivals still waiting (those ``winner`` overtook): O(limit)."""
        entry = self.oldest
        seq = winner.seq
        if entry is None or entry.seq >= seq:
            return ()  # (it overtook nobody, as most grants: no list built)
        overtaken: list[str] = []
        for _ in range(limit):  # (a bounded loop rather than a len() per step: per grant)
            if entry is None or entry.seq >= seq:
                break
            overtaken.append(entry.request_id)
            entry = entry.newer
        return tuple(overtaken)
