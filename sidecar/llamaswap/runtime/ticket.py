"""A Ticket: everything the runtime knows about one request, from its arrival to its outcome.

Created when Envoy's ext_authz Check arrives (the hold), granted or refused by the
coordinator, and finished exactly once: by the end of its exchange (Envoy's access log), by a
lapsed lease, by the watchdog, or when it leaves the queue. Holds no prompt or completion text.

Only the coordinator's rooms write to a ticket (`admission.py`, `grants.py`; the lease of a grant
that waits for unloads, `evictions.py`; the estimated wait, `forecast.py`); adapters and observers read it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
from collections.abc import Callable
from typing import Final

from llamaswap.core import Decision, Outcome, Priority
# How a granted exchange ended is the core's (`core/outcome.py`: it decides the outcome); named here too.
from llamaswap.core.decisions import built_by_assignment
from llamaswap.core.outcome import ExchangeEnd as ExchangeEnd


class TicketState(str, enum.Enum):
    WAITING = "waiting"  # in the scheduler's queue, its Check held
    RUNNING = "running"  # granted: its exchange holds the GPU
    DONE = "done"  # finished; the outcome is final

    def __str__(self) -> str:
        return self.value


# Every ticket begins waiting; read as a module global (an Enum member read through its class
# costs about 70 ns in Python 3.11, a global 10).
_WAITING = TicketState.WAITING


@dataclasses.dataclass(frozen=True, slots=True)
class ExchangeReport:
    """One access-log entry about a granted exchange, in the runtime's terms."""

    final: bool  # the end of the exchange; otherwise a periodic entry (a lease renewal)
    end: ExchangeEnd | None  # set on a final entry
    status: int  # the HTTP status sent to the client (0: none)
    first_byte_s: float | None  # request at the upstream -> its first response byte
    # How long the exchange had run at the upstream when the entry arrived (from Envoy's
    # start_time and its first upstream byte: the queue wait does not count), if it says.
    elapsed_s: float | None = None
    # The upstream that served it, by name (its Envoy cluster's); None if it reached none.
    gpu: str | None = None  # the GPU of the cluster Envoy routed it to (None: not one of ours)


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """What the adapter read from a held Check: no body, only what scheduling needs."""

    request_id: str
    priority_header: str | None
    trusted_header: str | None  # the operator's trusted priority header's value, if configured
    model: str | None
    peer: str  # the gRPC peer (one Envoy worker's connection): its access-log stream ends with it
    trace_parent: str | None  # W3C traceparent of Envoy's span for the Check call
    trace_state: str | None
    method: str = ""  # the HTTP method and path (a generation is told by them and the status)
    path: str = ""
    max_tokens: int | None = None  # output tokens the body asks for (max_tokens, n_predict, ...)
    streamed: bool = False  # the body asks for a streamed response ("stream": true)
    request_id_replaced: bool = False  # the client's x-request-id was too long: this is Envoy's id
    # It unloads `model` (llama-server's POST /models/unload): it runs alone (`Scheduler.enqueue`).
    alone: bool = False
    objective: str | None = None  # the InferenceObjective it names (x-llm-d-inference-objective)
    service_tier: str | None = None  # the body's OpenAI `service_tier`, if a string
    # routing.retryGraceSeconds: the keyed digest that says which request this is (runtime/kept.py),
    # and which try (the SDKs' x-stainless-retry-count), if the client said. The adapter gives the
    # digest as `retry_digest`, computed on first read (`Ticket.retry_key`): only a request that
    # finds kept places or whose client leaves while it waits needs it (an HMAC of its body).
    retry_key: bytes | None = None
    attempt: int | None = None
    # Ollama's keep_alive in the body, in seconds (`core/keep_alive.py`), read only where
    # routing.keepAlive.honour is on; None: none (or not honoured, or not a duration).
    keep_alive_s: float | None = None
    # (a computation, not a value: arrivals compare and print without it)
    retry_digest: Callable[[], bytes | None] | None = dataclasses.field(default=None, compare=False, repr=False)


# Made for every Check and every access-log entry: built by plain assignment, still frozen
# (`decisions.built_by_assignment`: every field given, in order).
new_arrival: Final = built_by_assignment(Arrival)
new_exchange_report: Final = built_by_assignment(ExchangeReport)


@dataclasses.dataclass(frozen=True, slots=True)
class Takeover:
    """A request that took a kept place over: from which try, and how long the client was away."""

    from_attempt: int | None  # the x-stainless-retry-count of the try that left, if it said
    left_ns: int
    taken_ns: int

    @property
    def away_ns(self) -> int:
        return self.taken_ns - self.left_ns


# Paths whose POST runs a generation on the GPU (OpenAI's and llama-server's own names).
GENERATION_PATHS = frozenset({
    "/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
    "/embedding", "/embeddings", "/v1/embeddings", "/infill", "/rerank", "/reranking", "/v1/rerank",
    "/v1/reranking", "/v1/messages", "/v1/responses",
})


def is_generation(method: str, path: str, status: int) -> bool:
    """A POST to a generation path that the upstream answered 2xx: the only exchanges whose
    run time says how long a model takes to generate (not a 4xx, not a GET on the catch-all)."""
    # (The path itself is looked up first: most carry no query, and each release asks.)
    return method == "POST" and 200 <= status < 300 and (
        path in GENERATION_PATHS or path.split("?", 1)[0] in GENERATION_PATHS)


class Tokens:
    """Unguessable grant tokens, each `<epoch>.<128 random bits>` in hex, from the OS's CSPRNG.

    The epoch (32 random bits, one per Tokens, so one per sidecar process) says which process
    issued a token: an access-log entry whose token has our epoch and no live ticket is a grant
    of ours that finished, with no memory of it needed. The random part is read from the OS a
    few thousand at a time: a system call per request would cost more than the rest of admission."""

    _BATCH = 256

    def __init__(self) -> None:
        self.epoch = os.urandom(4).hex()
        self._prefix = self.epoch + "."
        self._pool = b""
        self._at = 0  # the next token's first byte in the pool (not sliced off: that copied the rest)

    def next(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(16 * self._BATCH)
            at = 0
        self._at = at + 16
        return self._prefix + self._pool[at:at + 16].hex()

    def issued(self, token: str) -> bool:
        """Whether this process issued `token` (its epoch; a forged or an earlier process's one is not)."""
        return token.startswith(self._prefix)


class Ticket:
    __slots__ = (
        "token", "request_id", "priority", "model", "peer", "trace_parent", "trace_state",
        "state", "arrival_ns", "queue_depth_at_arrival", "estimated_wait_s", "decision",
        "lease_deadline_ns", "first_byte_s", "response_status", "end", "abandoned", "outcome", "finished_ns",
        "waiter", "method", "path", "max_tokens", "streamed", "schedule_model", "request_id_replaced", "alone",
        "_retry_key", "_retry_digest", "attempt", "takeover", "unloads", "line_key",
        "keep_alive_s",
    )

    def __init__(self, token: str, arrival: Arrival, priority: Priority, arrival_ns: int) -> None:
        self.token = token  # the scheduler's id for it; a secret that only Envoy's metadata carries
        self.request_id = arrival.request_id or "-"
        self.request_id_replaced = arrival.request_id_replaced
        self.priority = priority
        self.model = arrival.model
        self.peer = arrival.peer
        self.trace_parent = arrival.trace_parent
        self.trace_state = arrival.trace_state
        self.state = _WAITING
        self.arrival_ns = arrival_ns
        self.queue_depth_at_arrival = 0
        self.estimated_wait_s: float | None = None  # the estimate made when it arrived
        self.decision: Decision | None = None
        self.lease_deadline_ns = 0
        self.first_byte_s: float | None = None
        self.response_status = 0
        self.end: ExchangeEnd | None = None
        # Released while the upstream may still compute for it: a settle follows its end.
        self.abandoned = False
        self.outcome: Outcome | None = None
        self.finished_ns: int | None = None
        self.waiter: asyncio.Future[Decision | None] | None = None
        self.method = arrival.method
        self.path = arrival.path
        self.max_tokens = arrival.max_tokens
        self.keep_alive_s = arrival.keep_alive_s  # its model's idle time once granted (`core/idle.py`)
        self.streamed = arrival.streamed
        self.alone = arrival.alone
        # The model the scheduler and the estimates key on: the client's, except where the
        # upstream serves one model whatever the name (then every request is on the loaded one).
        self.schedule_model = arrival.model
        self._retry_key = arrival.retry_key
        self._retry_digest = arrival.retry_digest  # computes _retry_key when first read
        self.attempt = arrival.attempt
        self.takeover: Takeover | None = None  # the kept place it took over, if it did
        # Granted: the unloads it waits for before it goes (several resident models, `evictions.py`;
        # their result: None once done, else the model that would not go); None: nothing to wait for.
        self.unloads: asyncio.Future[str | None] | None = None
        # A Batch API line that may be stopped for a higher band: the key its place is kept
        # under when it is (`stops.py`); None for any other request.
        self.line_key: bytes | None = None

    @property
    def retry_key(self) -> bytes | None:
        """Its keyed digest (`Arrival.retry_key`), computed here on first read. None without one,
        and after `drop_retry_digest` when nobody read it while its Check was held."""
        digest = self._retry_digest
        if digest is not None:
            self._retry_digest = None
            self._retry_key = digest()
        return self._retry_key

    def drop_retry_digest(self) -> None:
        """Its Check was answered: a place is kept or taken over only while it is held, so the
        digest is never read now; let go of what it would be computed from (the Check's body)."""
        self._retry_digest = None

    @property
    def generation(self) -> bool:
        """A generation answered 2xx (`is_generation`): what the run-time estimates learn from."""
        return is_generation(self.method, self.path, self.response_status)

    @property
    def ended_ns(self) -> int:
        """When it finished (its arrival while it has not)."""
        return self.finished_ns if self.finished_ns is not None else self.arrival_ns

    @property
    def queue_wait_ns(self) -> int:
        """How long it waited: to its grant, or to its end if it never got one."""
        left_ns = self.decision.granted_ns if self.decision is not None else self.ended_ns
        return max(0, left_ns - self.arrival_ns)

    @property
    def granted_ns(self) -> int | None:
        return self.decision.granted_ns if self.decision is not None else None

    @property
    def trace_id(self) -> str | None:
        """The trace this request belongs to, from Envoy's traceparent (00-TRACE-SPAN-FLAGS)."""
        parent = self.trace_parent
        if parent is None or len(parent) < 55 or parent[2] != "-":
            return None
        trace_id = parent[3:35]
        return None if trace_id == "0" * 32 else trace_id


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request did not get the GPU; the adapters turn it into an HTTP error."""

    outcome: Outcome
    retry_after_s: int | None = None
    queue_depth: int = 0
    queue_limit: int = 0
    max_wait_s: float = 0.0
    model: str | None = None
    limit_key: str = "routing.scheduler.maxQueued"  # the setting `queue_limit` is
    evicting: str | None = None  # the resident model the upstream would not unload to make room for `model`


# What `admit` answers: the granted ticket, or a refusal.
Admission = Ticket | Refusal
