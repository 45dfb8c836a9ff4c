"""How each outcome looks to an HTTP client: the one table from `Outcome` to status, OpenAI
error type and code, and message. The runtime decides outcomes; only this module speaks HTTP.

Only outcomes that refuse a request have an answer of llamaswap's own; a granted request gets
the upstream's response, whatever its outcome is later recorded as.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from llamaswap.core import Outcome
from llamaswap.envoy.contract import openai_error_body
from llamaswap.runtime.coordinator import Refusal


@dataclasses.dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    error_type: str  # OpenAI's error "type"
    code: str  # OpenAI's error "code"
    message: Callable[[Refusal], str]
    param: str | None = None
    # Whether the same request may succeed if sent again: False answers `x-should-retry: false`,
    # which the OpenAI SDKs obey (they would otherwise retry a 5xx, say, and some 4xx).
    retry_helps: bool = True


REFUSALS: Mapping[Outcome, HttpError] = {
    Outcome.REJECTED_FULL: HttpError(
        429, "rate_limit_error", "queue_full",
        lambda r: f"the GPU queue is full ({r.queue_depth} requests waiting, {r.limit_key} is "
                  f"{r.queue_limit}); retry after {r.retry_after_s} s"),
    Outcome.REJECTED_UNKNOWN_MODEL: HttpError(
        404, "invalid_request_error", "model_not_found",
        lambda r: f"the model '{r.model}' does not exist here: the upstream does not serve it "
                  "(GET /v1/models lists what it serves)", param="model", retry_helps=False),
    Outcome.EXPIRED: HttpError(
        503, "server_error", "queue_wait_expired",
        lambda r: f"waited longer than routing.scheduler.maxWaitSeconds ({r.max_wait_s:g} s) for the GPU; "
                  f"retry after {r.retry_after_s} s"),
    Outcome.SHUTDOWN: HttpError(
        503, "server_error", "shutting_down",
        lambda r: "llamaswap is shutting down; retry on another instance or later"),
    # Granted, but a resident model the grant evicts would not unload (several resident models):
    # its load is not let through, or the upstream would evict a model of its own choosing.
    Outcome.UPSTREAM_ERROR: HttpError(
        503, "server_error", "model_unload_failed",
        lambda r: f"the upstream did not unload the model '{r.evicting}' to make room for '{r.model}' on its GPU; "
                  f"retry after {r.retry_after_s} s"),
    Outcome.INTERNAL_ERROR: HttpError(
        500, "server_error", "internal_error",
        lambda r: "llamaswap could not schedule the request (an internal error; see the sidecar's log)"),
    # Never seen by a client (it has gone), but answered in the same shape for completeness.
    Outcome.CANCELLED_WAITING: HttpError(
        499, "invalid_request_error", "cancelled", lambda r: "the client went away while it waited"),
}


def http_error(refusal: Refusal) -> tuple[HttpError, bytes]:
    """The error for a refusal and its body in the OpenAI error JSON shape."""
    error = REFUSALS.get(refusal.outcome) or REFUSALS[Outcome.INTERNAL_ERROR]
    return error, openai_error_body(error.message(refusal), error.error_type, error.code, error.param)


