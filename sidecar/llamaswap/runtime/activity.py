"""The activity log: one JSON line per dispatched request, and the most recent in memory."""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Any

from llamaswap.core import Outcome
from llamaswap.core.scheduler import Decision
from llamaswap.runtime.coordinator import Ticket

_log = logging.getLogger("llamaswap.activity")


class ActivityLog:
    """An Observer that records each dispatched request's decision when it ends."""

    def __init__(self, capacity: int = 1000) -> None:
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        items = list(self._recent)
        return items[-limit:] if limit else items

    def enqueued(self, ticket: Ticket, queue_depth: int) -> None:
        pass

    def dispatched(self, ticket: Ticket, decision: Decision) -> None:
        pass

    def watchdog_fired(self, ticket: Ticket) -> None:
        pass

    def finished(self, ticket: Ticket, outcome: Outcome) -> None:
        decision = ticket.decision
        if decision is None:  # never dispatched: spans and metrics cover it
            return
        run_ms = None
        if ticket.granted_ns is not None and ticket.finished_ns is not None:
            run_ms = round((ticket.finished_ns - ticket.granted_ns) / 1e6, 3)
        record = {
            "time": round(time.time(), 3),
            "event": "dispatch",
            "request_id": ticket.request_id,
            "trace_id": ticket.extras.get("trace_id"),
            "model": decision.model,
            "serial_priority": decision.priority,
            "serial_band": decision.band.value,
            "serial_score": round(decision.score, 3),
            "serial_queue_wait_ms": round(decision.queue_wait_ns / 1e6, 3),
            "swap_affinity": decision.swap_affinity,
            "aging": round(decision.aging, 3),
            "reordered_by": sorted(decision.reordered_by),
            "swap": decision.swap,
            "run_ms": run_ms,
            "outcome": outcome.value,
        }
        self._recent.append(record)
        _log.info("%s", json.dumps(record, separators=(",", ":")))
