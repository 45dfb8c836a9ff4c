"""Admission and refusal: the waiting side of the coordinator's one queue.

A Check is `admit`: the request is refused at once (shutting down, over
`envoy.maxSidecarStreams`, a model nobody serves, a full queue) or queued until the grant
(`grants.py`) answers it; a waiting request ends when its client leaves (its place kept for a
retry: `kept.py`), when it outwaits `maxWaitSeconds` (one timer, at the scheduler's next
deadline) or at shutdown. Every end goes through `Grants.finish`, the one way a ticket ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from llamaswap.core import NS_PER_S, SHUTDOWN_RETRY_AFTER_S, Clock, Decision, Outcome, QueueFull, Removed, Scheduler
from llamaswap.runtime.asleep import RouterSleep
from llamaswap.runtime.forecast import Forecast
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.grants import Grants
from llamaswap.runtime.kept import PlaceKeeper
from llamaswap.runtime.live_config import LiveConfig, ModelKeys
from llamaswap.runtime.observer import Observer
from llamaswap.runtime.publishing import Publisher
from llamaswap.runtime.request_ids import RequestIds
from llamaswap.runtime.ticket import Admission, Arrival, Refusal, Ticket, TicketState, Tokens

# Read for every request, as a module global (an Enum member read through its class costs about
# 70 ns in Python 3.11, a global 10: `grants.py`).
_WAITING = TicketState.WAITING


class Admitter:
    """``tickets``: every live ticket by token (the coordinator's one record of them)."""

    def __init__(self, *, clock: Clock, config: LiveConfig, scheduler: Scheduler, gpus: Gpus, keys: ModelKeys,
                 tickets: dict[str, Ticket], request_ids: RequestIds, tokens: Tokens, observer: Observer,
                 publisher: Publisher, forecast: Forecast, kept: PlaceKeeper, grants: Grants,
                 sleep: RouterSleep) -> None:
        self._clock = clock
        self._config = config
        self._scheduler = scheduler
        self._gpus = gpus
        self._keys = keys
        self._tickets = tickets
        self._request_ids = request_ids
        self._tokens = tokens
        self._observer = observer
        self._publisher = publisher
        self._forecast = forecast
        self._kept = kept
        self._grants = grants
        self._sleep = sleep
        self.admitting = True
        self._open_checks = 0  # Checks being answered: each holds one of Envoy's streams to us
        self._expiry: asyncio.TimerHandle | None = None

    async def admit(self, arrival: Arrival) -> Admission:
        """The hold (a Check): queue the request and wait until it is granted or refused."""
        priority = self._config.priority_of(arrival.priority_header, arrival.trusted_header, arrival.objective,
                                            arrival.service_tier)
        ticket = Ticket(self._tokens.next(), arrival, priority, self._clock.now_ns())
        self._open_checks += 1
        try:
            return await self._admit(ticket)
        except asyncio.CancelledError:
            # Envoy cancelled the Check: the client left while waiting (or while the upstream was
            # asked about its model, or just as it was granted).
            self.cancelled(ticket)
            raise
        except Exception:
            # A bug while admitting: the adapter answers 500; the ticket must not stay queued
            # (it would be granted with nobody to use the grant) nor go unfinished.
            self.cancelled(ticket, Outcome.INTERNAL_ERROR)
            raise
        finally:
            self._open_checks -= 1
            ticket.drop_retry_digest()  # answered or gone: its place can no longer be kept

    async def _admit(self, ticket: Ticket) -> Admission:
        priority = ticket.priority
        if not self.admitting:
            return self._refuse(ticket, Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S))
        if self._over_stream_limit():
            return self._refuse(ticket, Refusal(Outcome.REJECTED_FULL, self._forecast.retry_after_s(),
                                                queue_depth=self._open_checks - 1,
                                                queue_limit=self._config.config.envoy.max_sidecar_streams,
                                                limit_key="envoy.maxSidecarStreams"))
        # What it is scheduled as (a single-model upstream: its one model, whatever the name) and
        # whose models.<id> settings it gets: one function says both. Read again after anything
        # awaited here: an upstream's answer, or a reload, may have changed it meanwhile.
        key = self._keys.key(ticket.model)
        if ticket.model is not None:
            served = self._serves_now(ticket.model, key.scheduled)
            if served is None:  # an upstream is asked
                served = await self.serves(ticket.model)
                key = self._keys.key(ticket.model)
            if not served:
                return self._refuse(ticket, Refusal(Outcome.REJECTED_UNKNOWN_MODEL, model=ticket.model))
        # A router may have put its model to sleep since it was last asked: then it is a load.
        rereads = self._sleep.look(key.scheduled)
        if rereads is not None:
            await rereads
        # A stoppable line's part: sent again after a stop, it takes its place back once the stopped
        # part has ended (Envoy's report of that end may come after this arrival).
        ticket.line_key = self._grants.stops.key_of(ticket)
        stopped_part = self._grants.stops.ending(ticket.line_key)
        if stopped_part is not None:
            await stopped_part
        if rereads is not None or stopped_part is not None:
            key = self._keys.key(ticket.model)
        if not self.admitting:  # shutdown began while the catalog was asked
            return self._refuse(ticket, Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S))
        ticket.schedule_model = key.scheduled
        try:
            line_key = ticket.line_key
            retry_key = line_key if line_key is not None else self._kept.retry_key(ticket)
            queued = self._scheduler.enqueue(ticket.token, priority, key.scheduled, priority_model=key.settings,
                                             alone=ticket.alone, retry_key=retry_key, max_tokens=ticket.max_tokens,
                                             stoppable=self._grants.stops.may_stop(ticket))
        except QueueFull as exc:
            return self._refuse(ticket, Refusal(Outcome.REJECTED_FULL, self._forecast.retry_after_s(),
                                                queue_depth=exc.depth, queue_limit=exc.limit))
        # One arrival time, the scheduler's: the one its waits and aging count from.
        ticket.arrival_ns = queued.arrival_ns
        ticket.queue_depth_at_arrival = queued.depth
        if queued.taken is not None:
            self._kept.took_over(ticket, queued.taken)
        self._tickets[ticket.token] = ticket
        self._request_ids.add(ticket)
        self._publisher.changed()
        self._observer.enqueued(ticket)
        self._forecast.estimate_later(ticket)
        self.arm_expiry()
        self._grants.pump()  # (it grants a live ticket with no waiter yet: this one, queued in this step)
        decision: Decision | None
        if ticket.state is _WAITING:
            # Not granted at once: it waits for its grant or its end (`Grants.finish`).
            waiter: asyncio.Future[Decision | None] = asyncio.get_running_loop().create_future()
            ticket.waiter = waiter
            decision = await waiter
        else:  # granted by that pass (the usual case on a free GPU: no future made for it)
            decision = ticket.decision if ticket.outcome is None else None
        if decision is None:
            assert ticket.outcome is not None
            return self._forecast.refusal_of(ticket)
        return ticket if ticket.unloads is None else await self._grants.evictions.wait(ticket)  # (several resident)

    async def serves(self, model: str) -> bool:
        """Whether a GPU answers ``model`` and may run it as scheduled (`Gpus.serves`)."""
        config = self._config
        return await self._gpus.serves(model, self._keys.scheduled(model), self._scheduler.policy,
                                       config.entries, config.config.upstream.model_check)

    def _serves_now(self, model: str, scheduled: str | None) -> bool | None:
        """`serves` where no upstream must be asked (None: one must), ``model`` scheduled as ``scheduled``."""
        config = self._config
        return self._gpus.serves_now(model, scheduled, self._scheduler.policy, config.entries,
                                     config.config.upstream.model_check)

    def _over_stream_limit(self) -> bool:
        """With envoy.failOpen, Envoy's circuit breaker on the sidecar's streams is lifted (its
        overflow would pass requests unscheduled, since ext_authz treats it as the sidecar being
        unreachable): the sidecar holds the limit itself and refuses past it."""
        envoy = self._config.config.envoy
        return envoy.fail_open and self._open_checks > envoy.max_sidecar_streams

    def _refuse(self, ticket: Ticket, refusal: Refusal) -> Refusal:
        self._grants.finish(ticket, refusal.outcome, self._clock.now_ns())
        return refusal

    def cancelled(self, ticket: Ticket, outcome: Outcome = Outcome.CANCELLED_WAITING, *, pump: bool = True) -> None:
        """Its Check ended without an answer (the client left, or admission failed)."""
        if ticket.state is TicketState.WAITING:
            keeps_place = outcome is Outcome.CANCELLED_WAITING
            removed = self._kept.keep(ticket, admitting=self.admitting) if keeps_place else None
            if removed is None:
                removed = self._scheduler.cancel(ticket.token)
            self._grants.finish(ticket, outcome, removed.removed_ns if removed is not None else self._clock.now_ns())
            self.arm_expiry()
            if pump:
                self._grants.pump()  # it may have been the best (a swap that held the rest back)
        elif ticket.state is TicketState.RUNNING and self._scheduler.is_running(ticket.token):
            # Granted in the same instant the client left (or admission failed): the OK never
            # reached Envoy, so nothing reached the upstream either.
            self._grants.release(ticket, outcome, abandoned=False, sent=False)

    def peer_gone(self, peer: str) -> None:
        """An Envoy connection ended: the Checks it was holding end with it (no pump: the caller's)."""
        for ticket in [t for t in self._tickets.values() if t.peer == peer and t.state is TicketState.WAITING]:
            self.cancelled(ticket, pump=False)

    def stop_admitting(self) -> None:
        """Refuse new requests and answer every waiting one 503 (graceful shutdown)."""
        self.admitting = False
        self._finish_removed(self._scheduler.drain(), Outcome.SHUTDOWN)
        self._kept.ended(self._scheduler.drain_kept())
        self._publisher.changed()
        self.arm_expiry()

    def _finish_removed(self, removed: Iterable[Removed], outcome: Outcome) -> None:
        """End the tickets of requests the scheduler took out of the queue (drained, expired)."""
        for request in removed:
            ticket = self._tickets.get(request.request_id)
            if ticket is not None:
                self._grants.finish(ticket, outcome, request.removed_ns)

    # -- maxWaitSeconds and the kept places' grace, one timer ------------------------------

    def arm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        deadline_ns = self._scheduler.next_deadline_ns()
        if deadline_ns is None:
            return
        delay_s = max(0.0, (deadline_ns - self._clock.now_ns()) / NS_PER_S)
        self._expiry = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._finish_removed(self._scheduler.expire_overdue(), Outcome.EXPIRED)
        if self._kept.ended(self._scheduler.expire_kept()):
            self._publisher.changed()
        self.arm_expiry()
        self._grants.pump()  # an expired request may have been the best (a swap that held the rest back)

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
