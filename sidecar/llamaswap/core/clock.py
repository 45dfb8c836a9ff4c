"""Time for the core, injected so decisions can be replayed exactly."""

from __future__ import annotations

import time
from typing import Final, Protocol

NS_PER_S: Final = 1_000_000_000


class Clock(Protocol):
    """A monotonic clock in integer nanoseconds.

    Integers keep score comparisons exact: aging is compared as a rational number, never
    as a rounded float.
    """

    def now_ns(self) -> int: ...


class MonotonicClock:
    """The process's monotonic clock; the default outside tests."""

    def now_ns(self) -> int:
        return time.monotonic_ns()


class ManualClock:
    """A clock that moves only when told to; for tests and simulation."""

    def __init__(self, start_ns: int = 0) -> None:
        self._now_ns = start_ns

    def now_ns(self) -> int:
        return self._now_ns

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self._now_ns += round(seconds * 1_000_000_000)

    def set_ns(self, now_ns: int) -> None:
        if now_ns < self._now_ns:
            raise ValueError("a monotonic clock cannot go back")
        self._now_ns = now_ns
