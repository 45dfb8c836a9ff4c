"""The grants running on each GPU of a replay, in virtual time: when each one's hold ends, and
how concurrent grants share the GPU (`engine.py` drives them; `stopping.py` stops one). No I/O."""

from __future__ import annotations

import heapq
import math
from typing import Protocol

from llamaswap.simulate.concurrency import ConcurrencySpeed

NEVER = 2**63  # later than any event


class Running(Protocol):
    """The grants holding a slot: ``start`` one, ``finish`` those done at ``release_at``, ``stop``
    one before its end."""

    release_at: int  # the next release (NEVER: none running)

    def __len__(self) -> int: ...

    def start(self, now: int, index: int, hold_ns: int) -> None: ...

    def finish(self, now: int) -> list[int]: ...

    def stop(self, now: int, index: int) -> int:
        """End ``index``'s hold at ``now``; what was left of it (solo ns)."""
        ...


class Gpu:
    """One GPU of the replay: its running grants and its figures."""

    __slots__ = ("name", "running", "swaps", "busy_ns", "busy_since")

    def __init__(self, name: str, running: Running) -> None:
        self.name = name
        self.running = running
        self.swaps = 0
        self.busy_ns = 0
        self.busy_since = 0


class Apart:
    """Each grant runs its own time, whatever else runs (one slot, or no concurrency table)."""

    def __init__(self) -> None:
        self._releases: list[tuple[int, int]] = []  # (release time, index), earliest first
        self.release_at = NEVER

    def __len__(self) -> int:
        return len(self._releases)

    def start(self, now: int, index: int, hold_ns: int) -> None:
        heapq.heappush(self._releases, (now + hold_ns, index))
        self.release_at = self._releases[0][0]

    def finish(self, now: int) -> list[int]:
        releases, done = self._releases, []
        while releases and releases[0][0] == now:
            done.append(heapq.heappop(releases)[1])
        self.release_at = releases[0][0] if releases else NEVER
        return done

    def stop(self, now: int, index: int) -> int:
        releases = self._releases
        at = next(i for i, (_, running) in enumerate(releases) if running == index)
        release = releases[at][0]
        releases[at] = releases[-1]
        releases.pop()
        heapq.heapify(releases)
        self.release_at = releases[0][0] if releases else NEVER
        return release - now


class Shared:
    """The running grants share the GPU: while n run, each progresses at speed(n) / n of its solo
    rate. Work is kept in solo nanoseconds; a release lands on the first nanosecond at which its
    work is done to within half a nanosecond (floating point)."""

    _EPS_NS = 0.5

    def __init__(self, speed: ConcurrencySpeed) -> None:
        self._speed = speed
        self._rates: dict[int, float] = {}  # n running -> each one's rate
        self._left: dict[int, float] = {}  # index -> solo ns of work left
        self._since = 0  # when _left was last brought up to date
        self.release_at = NEVER

    def __len__(self) -> int:
        return len(self._left)

    def _rate(self) -> float:
        count = len(self._left)
        rate = self._rates.get(count)
        if rate is None:
            rate = self._rates[count] = self._speed.rate(count)
        return rate

    def _advance(self, now: int) -> None:
        if self._left and now != self._since:
            done = (now - self._since) * self._rate()
            for index in self._left:
                self._left[index] -= done
        self._since = now

    def _plan(self) -> None:
        if not self._left:
            self.release_at = NEVER
            return
        least = min(self._left.values()) / self._rate()
        self.release_at = self._since + max(0, math.ceil(least - self._EPS_NS))

    def start(self, now: int, index: int, hold_ns: int) -> None:
        self._advance(now)
        self._left[index] = float(hold_ns)
        self._plan()

    def finish(self, now: int) -> list[int]:
        self._advance(now)
        rate = self._rate()
        done = sorted(index for index, left in self._left.items() if left / rate <= self._EPS_NS)
        for index in done:
            del self._left[index]
        self._plan()
        return done

    def stop(self, now: int, index: int) -> int:
        self._advance(now)
        left = self._left.pop(index)
        self._plan()
        return max(0, round(left))
