"""Every way a request can end: one enum, used as metric label, span status, log key and error family.

The runtime decides the outcome of each request exactly once; how an outcome looks to an HTTP
client (status, OpenAI error type and code, message) is the adapters' business
(`llamaswap.adapters.outcomes`), not the core's or the runtime's.
"""

from __future__ import annotations

import enum


class ExchangeEnd(str, enum.Enum):
    """How a granted exchange ended, as Envoy reported it (the adapters read Envoy's flags)."""

    COMPLETE = "complete"  # the upstream's whole response went to the client
    CLIENT_LEFT = "client_left"  # the client went away mid-exchange: the upstream may still compute
    UPSTREAM_FAILED = "upstream_failed"  # the upstream reset, timed out or broke off its response
    NOT_SENT = "not_sent"  # the request never reached the upstream (no connection, no route)

    def __str__(self) -> str:
        return self.value


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
    # A Batch API line stopped at a token for a request of a higher band: its feeder sends it
    # again to resume where it stopped (`core/preemption.py`). Not an error.
    STOPPED = "stopped"

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

# Retry-After for requests refused while llamaswap stops, and for Envoy's own 503 while the
# sidecar cannot be reached: another replica, or this one restarted, answers soon.
SHUTDOWN_RETRY_AFTER_S = 5

# Releases of a grant after which its model is still loaded at the upstream: it was still
# generating for it (the client left, the watchdog, a lapsed lease, Envoy gone, shutdown).
_MODEL_STAYS_LOADED = frozenset({
    Outcome.CANCELLED_RUNNING, Outcome.WATCHDOG, Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE, Outcome.SHUTDOWN,
    Outcome.STOPPED,
})


# As module globals, for the functions below (each release): a member read through its class
# costs 70 ns, a global 7 (`priority.band_of`'s note).
_COMPLETE, _CLIENT_LEFT = ExchangeEnd.COMPLETE, ExchangeEnd.CLIENT_LEFT
_SERVED, _UPSTREAM_ERROR, _CANCELLED_RUNNING = Outcome.SERVED, Outcome.UPSTREAM_ERROR, Outcome.CANCELLED_RUNNING
# The ends that may leave the upstream computing.
_ABANDONING = frozenset({ExchangeEnd.CLIENT_LEFT, ExchangeEnd.UPSTREAM_FAILED})


def exchange_outcome(end: ExchangeEnd, status: int) -> Outcome:
    """The outcome of a granted exchange that ended with `end`, the client having been sent the
    HTTP `status`: served if the upstream answered in full below 500; the client leaving is a
    cancellation; anything else the upstream's error."""
    if end is _COMPLETE:
        return _SERVED if status < 500 else _UPSTREAM_ERROR
    if end is _CLIENT_LEFT:
        return _CANCELLED_RUNNING
    return _UPSTREAM_ERROR


def abandons(end: ExchangeEnd) -> bool:
    """Whether an exchange that ended with `end` may leave the upstream computing (a settle follows)."""
    return end in _ABANDONING


def model_stays_loaded(outcome: Outcome, status: int | None, *, one_model: bool = False,
                       alone: bool = False) -> bool | None:
    """Whether a grant that ended with `outcome` (and the upstream's HTTP `status`, None if not
    known) leaves its model loaded: True if the upstream answered it successfully (200..399) or
    was still generating for it; False after a failure (nothing is known to be loaded); None
    when the answer says nothing about the model (a 4xx: the request was refused, a prompt too
    long, an unknown path), so what the scheduler believed stays, except that a model this grant
    was to load is not known to have loaded (`Scheduler.release`). On an upstream that serves
    `one_model` (which nothing unloads) it always stays: a failure changes nothing there; after a
    request that runs `alone` (an unload) its model is not loaded (nor was it if refused). The
    runtime's releases and the simulator's replay both follow this."""
    if one_model:
        return True
    if alone:
        return False
    if outcome is _SERVED:
        if status is not None and 400 <= status < 500:
            return None
        return status is None or 200 <= status < 400
    return outcome in _MODEL_STAYS_LOADED
