"""Every way a request can end: one enum, used as metric label, span status, log key and error family.

The runtime decides the outcome of each request exactly once; how an outcome looks to an HTTP
client (status, OpenAI error type and code, message) is the adapters' business
(`llamaswap.adapters.outcomes`), not the core's or the runtime's.
"""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    # Granted the GPU, and the upstream answered in full (any status below 500).
    SERVED = "served"
    # The client left while it waited (its held Check was cancelled).
    CANCELLED_WAITING = "cancelled_waiting"
    # The client left while its exchange ran; the upstream may still be computing.
    CANCELLED_RUNNING = "cancelled_running"
    # Refused at arrival: routing.scheduler.maxQueued requests were already waiting.
    REJECTED_FULL = "rejected_full"
    # Refused at arrival: the upstream does not serve the requested model.
    REJECTED_UNKNOWN_MODEL = "rejected_unknown_model"
    # Waited longer than routing.scheduler.maxWaitSeconds.
    EXPIRED = "expired"
    # Granted, but the upstream failed: a 5xx, a reset, or no connection at all.
    UPSTREAM_ERROR = "upstream_error"
    # Refused or dropped because llamaswap is stopping.
    SHUTDOWN = "shutdown"
    # Granted longer than routing.scheduler.maxRunSeconds: the GPU was taken back.
    WATCHDOG = "watchdog"
    # Granted, then Envoy stopped reporting the exchange for envoy.leaseSeconds (Envoy killed,
    # or its access-log entries lost): the grant was released as a lapsed lease.
    LEASE_EXPIRED = "lease_expired"
    # Granted, then the Envoy connection that holds the exchange went away (Envoy stopped).
    PROXY_GONE = "proxy_gone"
    # llamaswap itself failed while deciding (a bug): the client gets a 500.
    INTERNAL_ERROR = "internal_error"

    @property
    def is_error(self) -> bool:
        """Outcomes that a span reports with error status."""
        return self in _ERROR_OUTCOMES

    def __str__(self) -> str:  # so f-strings and %-logging print the label
        return self.value


_ERROR_OUTCOMES = frozenset({
    Outcome.REJECTED_FULL, Outcome.REJECTED_UNKNOWN_MODEL, Outcome.EXPIRED, Outcome.UPSTREAM_ERROR,
    Outcome.SHUTDOWN, Outcome.WATCHDOG, Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE, Outcome.INTERNAL_ERROR,
})
