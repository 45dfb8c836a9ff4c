"""One object per request (a Ticket), from the first gRPC message to the end of the exchange.

The transport opens a ticket when Envoy's ext_proc stream starts, admits it when the
ext_authz Check arrives (the hold), and closes it when the ext_proc stream ends. The
coordinator turns the core's decisions into resolved futures. It is the only place that
mutates the Scheduler, and it runs on one event loop, so the core needs no locks.

Invariants enforced here:
- a ticket is released to the core exactly once, and `Observer.finished` fires exactly once
  per admitted ticket;
- a grant given to a ticket whose waiter has gone is released at once, so the GPU is never
  held for nobody.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import secrets
from collections.abc import Callable, Mapping

from llamaswap.config import Config
from llamaswap.core import Clock, MonotonicClock, Outcome, Priority, Scheduler
from llamaswap.core.scheduler import NS_PER_S, Decision, QueueFull
from llamaswap.runtime.model import LARGE_BODY_BYTES, model_from_body
from llamaswap.runtime.observer import NoopObserver, Observer

_log = logging.getLogger(__name__)

TICKET_HEADER = "x-llamaswap-ticket"
PRIORITY_HEADER = "x-llamaswap-priority"


class TicketState(str, enum.Enum):
    OPEN = "open"  # ext_proc stream started; Check not yet arrived
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class Rejected:
    """Why a request was refused, in the shape the transport turns into an HTTP error."""

    outcome: Outcome
    http_status: int
    message: str
    error_type: str
    code: str
    retry_after_s: int | None = None


@dataclasses.dataclass(frozen=True)
class Admission:
    """The result of waiting: a grant (decision) or a rejection."""

    decision: Decision | None = None
    rejected: Rejected | None = None


class Ticket:
    """Everything known about one request. Holds no prompt text."""

    __slots__ = (
        "token", "request_id", "state", "priority", "model", "decision", "outcome", "response_status",
        "queue_depth_at_arrival", "arrival_ns", "granted_ns", "finished_ns", "trace_context",
        "_waiter", "extras",
    )

    def __init__(self, token: str, request_id: str, arrival_ns: int) -> None:
        self.token = token
        self.request_id = request_id
        self.state = TicketState.OPEN
        self.priority: Priority | None = None
        self.model: str | None = None
        self.decision: Decision | None = None
        self.outcome: Outcome | None = None
        self.response_status: int | None = None
        self.queue_depth_at_arrival = 0
        self.arrival_ns = arrival_ns
        self.granted_ns: int | None = None
        self.finished_ns: int | None = None
        # Opaque to the runtime: the transport stores trace parents here for telemetry.
        self.trace_context: dict[str, object] = {}
        self._waiter: asyncio.Future[Admission] | None = None
        self.extras: dict[str, object] = {}

    def response_headers(self) -> list[tuple[str, str]]:
        """The x-llamaswap-* headers that tell the client what happened."""
        if self.decision is None or self.priority is None:
            return []
        d = self.decision
        return [
            ("x-llamaswap-priority", str(d.priority)),
            ("x-llamaswap-band", d.band.value),
            ("x-llamaswap-score", f"{d.score:.3f}"),
            ("x-llamaswap-queue-wait-ms", f"{d.queue_wait_ns / 1e6:.1f}"),
        ]


class Coordinator:
    """Owns the Scheduler and every live Ticket; all methods run on one event loop."""

    def __init__(self, config: Config, *, clock: Clock | None = None, observer: Observer | None = None,
                 observe_after_grant: bool = True) -> None:
        self._clock = clock or MonotonicClock()
        self._config = config
        self.scheduler = Scheduler(config.policy(), self._clock)
        self.observer: Observer = observer or NoopObserver()
        # Telemetry for a grant and a release runs on the next loop turn, after the grant is
        # on its way; tests that read telemetry synchronously turn this off.
        self._observe_after_grant = observe_after_grant
        self._tickets: dict[str, Ticket] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._admitting = True
        self._idle = asyncio.Event()
        self._idle.set()

    # -- configuration -------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    def reconfigure(self, config: Config) -> None:
        """Apply new scheduler settings; the queue and the running request are kept."""
        self._config = config
        self.scheduler.reconfigure(config.policy())
        self._arm_expiry()
        self._pump()

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def admitting(self) -> bool:
        return self._admitting

    def live_tickets(self) -> int:
        return len(self._tickets)

    def ticket(self, token: str) -> Ticket | None:
        return self._tickets.get(token)

    # -- the request's way ---------------------------------------------------------------

    def open(self, request_id: str) -> Ticket:
        """A new exchange began (ext_proc request headers). The token is unguessable."""
        ticket = Ticket(secrets.token_urlsafe(18), request_id or "-", self._clock.now_ns())
        self._tickets[ticket.token] = ticket
        return ticket

    async def admit(self, token: str, headers: Mapping[str, str], body: bytes) -> Admission:
        """The hold: wait until this ticket is granted or rejected (ext_authz Check)."""
        refused = await self.prepare(token, headers, body)
        return refused if refused is not None else await self.wait(token)

    async def prepare(self, token: str, headers: Mapping[str, str], body: bytes) -> Admission | None:
        """Read the priority and the model; a refusal, or None when `wait` may follow.

        Split from `wait` so that the caller need not keep the request (and its body) alive
        for the wait, which can last hours.
        """
        ticket = self._tickets.get(token)
        if ticket is None or ticket.state is not TicketState.OPEN:
            # No live exchange carries this token: forged, replayed, or the client left.
            return Admission(rejected=Rejected(Outcome.CANCELLED_WAITING, 403, "unknown or used scheduling ticket",
                                               "invalid_request_error", "invalid_ticket"))
        if not self._admitting:
            return self._reject(ticket, _shutdown_rejection())
        policy = self._config.priority_policy
        trusted = headers.get(policy.trusted_header) if policy.trusted_header else None
        ticket.priority = policy.resolve(headers.get(PRIORITY_HEADER), trusted)
        if len(body) > LARGE_BODY_BYTES:
            ticket.model = await asyncio.get_running_loop().run_in_executor(None, model_from_body, body)
        else:
            ticket.model = model_from_body(body)
        if ticket.state is not TicketState.OPEN:  # closed while parsing off-loop
            return Admission(rejected=Rejected(Outcome.CANCELLED_WAITING, 499, "client went away",
                                               "invalid_request_error", "cancelled"))
        return None

    async def wait(self, token: str) -> Admission:
        """Queue a prepared ticket and wait for its grant or rejection."""
        ticket = self._tickets.get(token)
        if ticket is None or ticket.state is not TicketState.OPEN or ticket.priority is None:
            return Admission(rejected=Rejected(Outcome.CANCELLED_WAITING, 499, "client went away",
                                               "invalid_request_error", "cancelled"))
        if not self._admitting:  # shutdown began while the body was being read
            return self._reject(ticket, _shutdown_rejection())
        try:
            depth = self.scheduler.enqueue(token, ticket.priority, ticket.model)
        except QueueFull as exc:
            return self._reject(ticket, Rejected(
                Outcome.REJECTED_FULL, 429,
                f"the GPU queue is full ({exc.depth} requests waiting); retry later",
                "rate_limit_error", "queue_full", retry_after_s=self._retry_after_s()))
        ticket.state = TicketState.WAITING
        ticket.queue_depth_at_arrival = depth
        ticket.arrival_ns = self._clock.now_ns()
        waiter: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        ticket._waiter = waiter
        self.observer.enqueued(ticket, depth)
        self._arm_expiry()
        self._pump()
        try:
            return await waiter
        except asyncio.CancelledError:
            # Envoy cancelled the Check: the client disconnected while waiting.
            self.close(token)
            raise

    def record_response(self, token: str, status: int) -> None:
        ticket = self._tickets.get(token)
        if ticket is not None:
            ticket.response_status = status

    def close(self, token: str) -> None:
        """The exchange ended (ext_proc stream closed or Check cancelled). Idempotent."""
        ticket = self._tickets.pop(token, None)
        if ticket is None:
            return
        if ticket.state is TicketState.WAITING:
            self.scheduler.cancel(token)
            self._finish(ticket, Outcome.CANCELLED_WAITING)
            self._resolve(ticket, Admission(rejected=Rejected(
                Outcome.CANCELLED_WAITING, 499, "client went away", "invalid_request_error", "cancelled")))
            self._arm_expiry()
        elif ticket.state is TicketState.RUNNING:
            self._release(ticket, self._running_outcome(ticket))
        else:
            ticket.state = TicketState.DONE
        self._pump()

    # -- shutdown ------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        """Refuse new requests and answer every waiting one 503 (graceful shutdown)."""
        self._admitting = False
        for removed in self.scheduler.drain():
            ticket = self._tickets.get(removed.request_id)
            if ticket is not None:
                self._reject(ticket, _shutdown_rejection())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs; True if it finished within the grace period."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # -- internals -----------------------------------------------------------------------

    def _observe(self, callback: Callable[..., None], *args: object) -> None:
        if self._observe_after_grant:
            asyncio.get_running_loop().call_soon(callback, *args)
        else:
            callback(*args)

    def _running_outcome(self, ticket: Ticket) -> Outcome:
        status = ticket.response_status
        if status is None:
            return Outcome.CANCELLED_RUNNING
        if status >= 500:
            return Outcome.UPSTREAM_ERROR
        return Outcome.SERVED

    def _pump(self) -> None:
        """Grant the GPU if it is free and someone waits."""
        while True:
            decision = self.scheduler.next()
            if decision is None:
                return
            ticket = self._tickets.get(decision.request_id)
            waiter = ticket._waiter if ticket is not None else None
            if ticket is None or waiter is None or waiter.done():
                # The waiter vanished between cancel and grant; give the GPU to the next.
                self.scheduler.release(decision.request_id)
                continue
            ticket.state = TicketState.RUNNING
            ticket.decision = decision
            ticket.granted_ns = self._clock.now_ns()
            self._idle.clear()
            self._arm_watchdog(ticket)
            waiter.set_result(Admission(decision=decision))
            # The waiter's wake-up is already scheduled ahead of this: the next request's
            # handoff never waits for spans, metrics or log lines.
            self._observe(self.observer.dispatched, ticket, decision)
            return

    def _release(self, ticket: Ticket, outcome: Outcome) -> None:
        self.scheduler.release(ticket.token)
        self._disarm_watchdog()
        self._idle.set()
        self._finish(ticket, outcome)

    def _finish(self, ticket: Ticket, outcome: Outcome) -> None:
        ticket.state = TicketState.DONE
        ticket.outcome = outcome
        ticket.finished_ns = self._clock.now_ns()
        self._observe(self.observer.finished, ticket, outcome)

    def _reject(self, ticket: Ticket, rejected: Rejected) -> Admission:
        admission = Admission(rejected=rejected)
        if ticket.state is TicketState.WAITING:
            self.scheduler.cancel(ticket.token)
        self._finish(ticket, rejected.outcome)
        self._resolve(ticket, admission)
        return admission

    @staticmethod
    def _resolve(ticket: Ticket, admission: Admission) -> None:
        waiter = ticket._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(admission)

    def _retry_after_s(self) -> int:
        """A hint for rejected clients: roughly how long the queue takes to move."""
        return max(1, min(60, 1 + self.scheduler.depth // 10))

    def _arm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        deadline_ns = self.scheduler.next_deadline_ns()
        if deadline_ns is None:
            return
        delay_s = max(0.0, (deadline_ns - self._clock.now_ns()) / NS_PER_S)
        self._expiry = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        limit = self.scheduler.policy.max_wait_s
        for removed in self.scheduler.expire_overdue():
            ticket = self._tickets.get(removed.request_id)
            if ticket is None:
                continue
            ticket.state = TicketState.DONE  # already out of the core's queue
            self._finish(ticket, Outcome.EXPIRED)
            self._resolve(ticket, Admission(rejected=Rejected(
                Outcome.EXPIRED, 503, f"waited longer than routing.scheduler.maxWaitSeconds ({limit:g} s) for the GPU",
                "server_error", "queue_wait_expired", retry_after_s=self._retry_after_s())))
        self._arm_expiry()

    def _arm_watchdog(self, ticket: Ticket) -> None:
        limit = self._config.scheduler.max_run_s
        if limit > 0:
            self._watchdog = asyncio.get_running_loop().call_later(limit, self._watchdog_fire, ticket.token)

    def _disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _watchdog_fire(self, token: str) -> None:
        """A grant outlived routing.scheduler.maxRunSeconds: free the GPU for the next."""
        self._watchdog = None
        ticket = self._tickets.get(token)
        if ticket is None or ticket.state is not TicketState.RUNNING:
            return
        _log.warning("watchdog: request %s held the GPU past maxRunSeconds; releasing it", ticket.request_id)
        self.observer.watchdog_fired(ticket)
        # The exchange itself goes on in Envoy; only the GPU's grant ends. Its ext_proc stream
        # still closes the (now forgotten) ticket when it finally ends.
        self._tickets.pop(token, None)
        self._release(ticket, Outcome.WATCHDOG)
        self._pump()


def _shutdown_rejection() -> Rejected:
    return Rejected(Outcome.SHUTDOWN, 503, "llamaswap is shutting down; retry on another instance or later",
                    "server_error", "shutting_down", retry_after_s=5)
