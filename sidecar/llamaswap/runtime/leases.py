"""The leases: the running grants, the adopted exchanges, the memory of finished grants, and the
one timer that watches their deadlines.

A grant is a lease: Envoy's periodic access-log entries renew it, and unrenewed for
envoy.leaseSeconds it lapses. An exchange Envoy reports that this process did not grant (an
earlier sidecar process did, or its lease lapsed) is adopted: the GPU is busy with it until it
ends or is no longer reported. The finished memory tells a late entry of ours from a stranger's.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from llamaswap.core import NS_PER_S, Clock, Outcome
from llamaswap.runtime.ticket import Ticket

# Tokens of finished grants remembered, so a late access-log entry is recognised as ours.
FINISHED_MEMORY = 4096


class Leases:
    """What holds the GPU by lease. `due` runs when the earliest deadline passes (the coordinator
    decides what a lapse means)."""

    def __init__(self, clock: Clock, due: Callable[[], None]) -> None:
        self._clock = clock
        self._due = due
        # The running grants by token, earliest first (one per slot in use).
        self.running: dict[str, Ticket] = {}
        # token -> (when adopted, lease deadline), in ns.
        self.adopted: dict[str, tuple[int, int]] = {}
        self._finished: collections.OrderedDict[str, Outcome] = collections.OrderedDict()
        self._timer: asyncio.TimerHandle | None = None

    # -- the finished memory ---------------------------------------------------------------

    def remember(self, token: str, outcome: Outcome) -> None:
        """A granted ticket finished with `outcome` (the oldest memories are forgotten)."""
        self._finished[token] = outcome
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def finished(self, token: str) -> Outcome | None:
        """How a grant of ours ended, if it is still remembered."""
        return self._finished.get(token)

    # -- adopted exchanges -----------------------------------------------------------------

    def adopt(self, token: str, lease_ns: int) -> None:
        now = self._clock.now_ns()
        self.adopted[token] = (now, now + lease_ns)

    def renew_adopted(self, token: str, lease_ns: int) -> None:
        adopted_ns, _ = self.adopted[token]
        self.adopted[token] = (adopted_ns, self._clock.now_ns() + lease_ns)

    def end_adopted(self, token: str) -> int:
        """Forget an adopted exchange; when it was adopted (ns)."""
        adopted_ns, _ = self.adopted.pop(token)
        return adopted_ns

    def lapsed_adopted(self) -> list[str]:
        """The adopted exchanges whose lease has passed."""
        now = self._clock.now_ns()
        return [token for token, (_, deadline) in self.adopted.items() if now >= deadline]

    # -- the running grants ----------------------------------------------------------------

    def lapsed_running(self) -> list[Ticket]:
        """The running grants whose lease has passed, earliest granted first."""
        now = self._clock.now_ns()
        return [ticket for ticket in self.running.values() if now >= ticket.lease_deadline_ns]

    # -- the one timer ---------------------------------------------------------------------

    def arm(self) -> None:
        """One timer for the leases (every running grant's and the adopted ones), at the earliest."""
        self.cancel()
        deadlines = [deadline for _, deadline in self.adopted.values()]
        deadlines.extend(ticket.lease_deadline_ns for ticket in self.running.values())
        if not deadlines:
            return
        delay_s = max(0.0, (min(deadlines) - self._clock.now_ns()) / NS_PER_S)
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._due()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
