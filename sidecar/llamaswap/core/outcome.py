"""Every way a request can end: one enum, used as metric label, span status and log key."""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    SERVED = "served"
    CANCELLED_WAITING = "cancelled_waiting"
    CANCELLED_RUNNING = "cancelled_running"
    REJECTED_FULL = "rejected_full"
    EXPIRED = "expired"
    UPSTREAM_ERROR = "upstream_error"
    SHUTDOWN = "shutdown"
    WATCHDOG = "watchdog"

    @property
    def is_error(self) -> bool:
        """Outcomes that a span reports with error status."""
        return self in _ERROR_OUTCOMES

    def __str__(self) -> str:  # so f-strings and %-logging print the label
        return self.value


_ERROR_OUTCOMES = frozenset(
    {Outcome.REJECTED_FULL, Outcome.EXPIRED, Outcome.UPSTREAM_ERROR, Outcome.SHUTDOWN, Outcome.WATCHDOG}
)
