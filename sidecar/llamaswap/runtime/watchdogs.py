"""routing.scheduler.maxRunSeconds for our own grants: one timer per running grant, counted from
its grant. (The adopted exchanges' watchdog is the leases' timer, `leases.py`.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from llamaswap.core import NS_PER_S, Clock
from llamaswap.runtime.ticket import Ticket


class Watchdogs:
    """``limit_s`` reads maxRunSeconds (0: off); ``fire(token)`` runs when a grant outlives it."""

    def __init__(self, clock: Clock, limit_s: Callable[[], float], fire: Callable[[str], None]) -> None:
        self._clock = clock
        self._limit_s = limit_s
        self._fire = fire
        self._timers: dict[str, asyncio.TimerHandle] = {}  # by token

    def arm(self, ticket: Ticket) -> None:
        """A grant began: its limit counts from now."""
        limit = self._limit_s()
        if limit > 0:
            self._timers[ticket.token] = asyncio.get_running_loop().call_later(limit, self._fired, ticket.token)

    def rearm(self, ticket: Ticket) -> None:
        """maxRunSeconds changed while `ticket` runs: its limit counts from its grant, not from now
        (past it already, the watchdog fires on the next loop turn; 0 turns it off)."""
        self.cancel(ticket.token)
        limit = self._limit_s()
        decision = ticket.decision
        if limit <= 0 or decision is None:
            return
        ran_s = (self._clock.now_ns() - decision.granted_ns) / NS_PER_S
        self._timers[ticket.token] = asyncio.get_running_loop().call_later(
            max(0.0, limit - ran_s), self._fired, ticket.token)

    def cancel(self, token: str) -> None:
        timer = self._timers.pop(token, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _fired(self, token: str) -> None:
        self._timers.pop(token, None)
        self._fire(token)
