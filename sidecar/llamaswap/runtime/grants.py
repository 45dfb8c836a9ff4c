"""Grants and their release: the running side of the coordinator's one queue.

The grant decision re-runs (`pump`) whenever something can free a slot or change the best
waiting request; a grant is a lease (`leases.py`: renewed by Envoy's periodic access-log entries,
released when it lapses) with a watchdog (`watchdogs.py`: maxRunSeconds); Envoy's final entry
releases it and decides its outcome; a release that may leave the upstream computing begins a
settle (`adoptions.py`); and every ticket ends here, exactly once (`finish`). The tools that
hold a GPU beside the grants (leases, watchdogs, settles and adopted exchanges, the unloads a
grant waits for) are built here, with this room as what they call back.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from llamaswap.config import AbandonedGeneration
from llamaswap.core import (
    NS_PER_S,
    Clock,
    Decision,
    Estimator,
    ExchangeEnd,
    Outcome,
    Scheduler,
    abandons,
    exchange_outcome,
    model_stays_loaded,
)
from llamaswap.core.dispatch import NO_TIMES
from llamaswap.runtime.adoptions import Adoptions
from llamaswap.runtime.evictions import Evictions
from llamaswap.runtime.forecast import Forecast
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.idle import IdleUnloads
from llamaswap.runtime.leases import Adoption, Leases
from llamaswap.runtime.live_config import LiveConfig
from llamaswap.runtime.observer import Observer, SettleReason, overtaken_by
from llamaswap.runtime.publishing import Publisher
from llamaswap.runtime.request_ids import RequestIds
from llamaswap.runtime.stops import KEEP_STOPPED_MIN_NS, LineStops, Lines, NoLines
from llamaswap.runtime.ticket import ExchangeReport, Ticket, TicketState, Tokens
from llamaswap.runtime.views import free
from llamaswap.runtime.watchdogs import Watchdogs

_log = logging.getLogger(__name__)

# The members read for every request, as module globals: in Python 3.11 a member read through its
# class goes through the metaclass's ``__getattr__`` hook, about 70 ns against 10 for a global.
_RUNNING, _DONE = TicketState.RUNNING, TicketState.DONE
_SERVED, _WATCHDOG = Outcome.SERVED, Outcome.WATCHDOG
_CLIENT_LEFT = ExchangeEnd.CLIENT_LEFT
# Released while its exchange may still run: if Envoy reports it again, it is adopted.
_MAY_STILL_RUN = (Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE)


class Grants:
    """``tickets``: every live ticket by token (the coordinator's one record of them, which
    `finish` removes from); ``adopted``: the node's adopted exchanges (`Leases.adopted`, which
    each GPU reads its own from)."""

    def __init__(self, *, clock: Clock, config: LiveConfig, scheduler: Scheduler, gpus: Gpus, estimator: Estimator,
                 tickets: dict[str, Ticket], request_ids: RequestIds, tokens: Tokens, observer: Observer,
                 publisher: Publisher, forecast: Forecast, adopted: dict[str, Adoption],
                 lines: Lines | None = None) -> None:
        self._clock = clock
        self._config = config
        self._scheduler = scheduler
        self._gpus = gpus
        self._estimator = estimator
        self._tickets = tickets
        self._request_ids = request_ids
        self._observer = observer
        self._publisher = publisher
        self._forecast = forecast
        # Batch API lines stopped for a higher band (`stops.py`; without the Batch API, none).
        self.stops = LineStops(scheduler, tickets, lines or NoLines())
        self.idle = asyncio.Event()
        self.idle.set()
        # The running grant, the adopted exchanges and what is remembered of finished grants,
        # with their timer (which is also the adopted exchanges' watchdog).
        self.leases = Leases(clock, self._leases_due, self.running, max_run_ns=config.max_run_ns, adopted=adopted)
        self.watchdogs = Watchdogs(clock, config.max_run_s, self._watchdog_fire)
        # Settles and adopted exchanges (`adoptions.py`): what holds a GPU besides our grants.
        self.adoptions = Adoptions(clock=clock, config=config.current, scheduler=scheduler, gpus=gpus,
                                   leases=self.leases, tokens=tokens, observer=observer, observe=publisher.observe,
                                   busy=self.idle.clear, changed=publisher.changed, freed=self.freed,
                                   holding=scheduler.holding_of, lease_ns=config.lease_ns)
        self.evictions = Evictions(gpus, clock, self.leases, config.lease_ns, forecast, scheduler=scheduler,
                                   release=functools.partial(self.release, outcome=Outcome.UPSTREAM_ERROR,
                                                             abandoned=False, sent=False))
        # Idle unloads (`idle.py`): re-armed after each pass of the grant decision.
        self.idle_unloads = IdleUnloads(gpus, scheduler, clock, self.evictions,
                                        functools.partial(publisher.observe, observer.idle_unloaded), publisher.changed)

    def running(self) -> list[Ticket]:
        """The running grants' tickets, earliest first: the scheduler's grants are the one record
        of what runs (a grant's ticket is live until its release)."""
        tickets = self._tickets
        return [ticket for token in self._scheduler.running_ids() if (ticket := tickets.get(token)) is not None]

    def runs_model(self, gpu: str, model: str) -> bool:
        return any(t.decision is not None and t.decision.model == model and t.decision.gpu == gpu
                   for t in self.running())

    # -- Envoy's reports ---------------------------------------------------------------------

    def report(self, token: str, report: ExchangeReport) -> None:
        """An access-log entry about a granted exchange: a lease renewal, or its end."""
        ticket = self._tickets.get(token)
        if ticket is None or ticket.state is not _RUNNING:
            self.adoptions.report(token, report)  # an exchange this process does not hold
            return
        if report.first_byte_s is not None:
            ticket.first_byte_s = report.first_byte_s
        if not report.final:
            ticket.lease_deadline_ns = self._clock.now_ns() + self._config.lease_ns()
            return
        end = report.end or ExchangeEnd.UPSTREAM_FAILED
        ticket.end = end
        ticket.response_status = report.status
        # A line being stopped ends as its feeder closed it: stopped, not a client that left.
        outcome = (Outcome.STOPPED if end is _CLIENT_LEFT and self.stops.stopping(ticket)
                   else exchange_outcome(end, report.status))
        self.release(ticket, outcome, abandoned=abandons(end))

    def peer_gone(self, peer: str) -> None:
        """An Envoy connection ended: release the grants it held (its waiting Checks end first:
        `Coordinator.peer_gone`)."""
        for running in [t for t in self.running() if t.peer == peer]:
            if running.state is TicketState.RUNNING and self._scheduler.is_running(running.token):
                _log.warning("Envoy connection %s closed while request %s held the GPU; releasing it",
                             peer, running.request_id)
                self.release(running, Outcome.PROXY_GONE, abandoned=True)

    # -- granting and releasing ------------------------------------------------------------

    def pump(self) -> None:
        """Grant while a GPU has room and someone waits: up to the slots of its loaded model."""
        # (A settle or an adopted exchange on a GPU: nothing is granted there until it ends; the
        # scheduler was told as it began: `Adoptions`.)
        # (Lazy: read only if the rule asks; and where nobody waits, `Scheduler.next` reads none.)
        times = self._forecast.gpu_times() if self._scheduler.depth else NO_TIMES
        while True:
            decision = self._scheduler.next(times)
            if decision is None:
                self.stops.ask()
                self.idle_unloads.arm()
                return
            ticket = self._tickets.get(decision.request_id)
            # Its unloads begin whatever becomes of it: the scheduler counts the evicted models gone.
            unloads = self.evictions.granted(decision)
            # (A live ticket with no waiter is the one being admitted in this step: `Admitter._admit`.)
            waiter = ticket.waiter if ticket is not None else None
            if ticket is not None and (waiter is None or not waiter.done()):
                ticket.unloads = unloads
                self._grant(ticket, waiter, decision)
                continue
            # Envoy cancelled this Check a moment ago (its waiter is cancelled) and the handler
            # has not run its clean-up yet: nothing reached the upstream; the next one goes.
            self._scheduler.release(decision.request_id, reached_upstream=False)
            if ticket is not None:
                self.finish(ticket, Outcome.CANCELLED_WAITING, decision.granted_ns)

    def _grant(self, ticket: Ticket, waiter: asyncio.Future[Decision | None] | None, decision: Decision) -> None:
        ticket.state = _RUNNING
        ticket.decision = decision
        ticket.lease_deadline_ns = decision.granted_ns + self._config.lease_ns()
        self.idle.clear()
        self._publisher.changed()
        self.leases.granted(ticket.lease_deadline_ns)
        self.watchdogs.arm(ticket)
        if waiter is not None:
            waiter.set_result(decision)
        if decision.model is not None and not decision.alone and self._config.keep_alive_honoured:
            # Ollama's keep_alive: the last request granted of a model says its idle time there.
            self._scheduler.keep_alive(decision.gpu, decision.model, ticket.keep_alive_s)
        if decision.gpu in self._config.auto_slots:
            self._gpus.named(decision.gpu).slots.after_grant(decision.model)
        # (Most grants overtook nobody: no generator made for them.)
        overtook = decision.overtook
        overtaken = tuple(overtaken_by(self._tickets.get(token)) for token in overtook) if overtook else ()
        # The waiter's wake-up is already scheduled ahead of this: the next request's handoff
        # never waits for spans, metrics or log lines.
        self._publisher.observe(self._observer.dispatched, ticket, overtaken)

    def release(self, ticket: Ticket, outcome: Outcome, *, abandoned: bool, sent: bool = True) -> None:
        decision = ticket.decision
        if decision is None:  # only a running grant is released (every caller checks it runs)
            raise ValueError(f"request {ticket.request_id} was never granted: there is nothing to release")
        gpu = self._gpus.named(decision.gpu)
        model_loaded = model_stays_loaded(outcome, ticket.response_status,
                                          one_model=gpu.catalog.single_model() is not None, alone=ticket.alone)
        # A stopped line's place is kept for it to resume (`stops.py`).
        stopped = self.stops.ended(ticket)
        if stopped is None:
            released = self._scheduler.release(ticket.token, model_loaded=model_loaded, reached_upstream=sent)
        else:
            released = self._scheduler.release(ticket.token, model_loaded=model_loaded, reached_upstream=sent,
                                               keep_as=stopped.key,
                                               grace_ns=max(self._config.retry_grace_ns(), KEEP_STOPPED_MIN_NS))
        self.watchdogs.cancel(ticket.token)
        self.leases.released()
        if outcome is _SERVED and ticket.generation:
            # Only a streamed first byte is the generation's start: a non-streamed one is its end,
            # and would teach generation length as swap cost.
            self._estimator.record(decision.model, run_s=released.run_ns / NS_PER_S, model_load=decision.model_load,
                                   first_byte_s=ticket.first_byte_s if ticket.streamed else None,
                                   max_tokens=ticket.max_tokens, gpu=decision.gpu)
        # (upstream.abandonedGeneration read only where it decides: a watchdog's release.)
        ticket.abandoned = abandoned or (outcome is _WATCHDOG and
                                         self._config.config.upstream.abandoned_generation is AbandonedGeneration.STOP)
        if stopped is not None:  # (seen before its end: the line's run span carries the stop)
            self._publisher.observe(self._observer.line_stopped, ticket, stopped.waiting, stopped.tokens_kept)
        self.finish(ticket, outcome, released.released_ns)
        if ticket.abandoned:
            self.adoptions.abandoned(gpu, ticket.model, ticket.request_id, decision.granted_ns,
                                     reason=SettleReason.after(outcome))
        self._update_idle()
        self.pump()

    def finish(self, ticket: Ticket, outcome: Outcome, at_ns: int) -> bool:
        """The one way a ticket ends. The first call wins; later ones change nothing."""
        if ticket.outcome is not None:
            return False
        ticket.outcome = outcome
        ticket.finished_ns = at_ns
        ticket.state = _DONE
        self._tickets.pop(ticket.token, None)
        self._request_ids.forget(ticket)
        if ticket.decision is not None and outcome in _MAY_STILL_RUN:
            self.leases.remember_lapsed(ticket.token, ticket.decision.granted_ns, ticket.decision.gpu)
        waiter = ticket.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._publisher.changed()
        self._publisher.observe(self._observer.finished, ticket)
        return True

    def freed(self) -> None:
        """A settle, an adoption or a lease ended: grant again."""
        self._update_idle()
        self.pump()

    def _update_idle(self) -> None:
        if free(self._scheduler.holdings()):
            self.idle.set()
        self._publisher.publish()

    # -- shutdown --------------------------------------------------------------------------

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs (no grant in any slot, no settle, no adopted exchange); True if
        it finished within the grace period."""
        if self.idle.is_set():  # wait_for(..., 0) times out even on a set event (Python 3.11)
            return True
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def abandon_running(self) -> None:
        """The grace period ended: record every running request as cut off by the shutdown."""
        for ticket in self.running():
            if self._scheduler.is_running(ticket.token):
                self.release(ticket, Outcome.SHUTDOWN, abandoned=False)

    def reconfigured(self) -> None:
        """New settings: each running grant's watchdog counts maxRunSeconds anew from its grant."""
        for ticket in self.running():
            self.watchdogs.rearm(ticket)

    def close(self) -> None:
        self.idle_unloads.close()
        self.evictions.close()
        self.watchdogs.close()
        self.leases.cancel()

    # -- timers ----------------------------------------------------------------------------

    def _leases_due(self) -> None:
        """The earliest lease deadline passed: lapsed adoptions end (as a lapsed grant of ours, with
        a settle), so do adoptions past maxRunSeconds (the watchdog's), lapsed grants are released."""
        self.adoptions.due()
        lapsed = self.leases.lapsed_running()
        for running in lapsed:
            if not self._scheduler.is_running(running.token):
                continue  # released by the release before it
            _log.warning("Envoy has not reported request %s for %.1f s (envoy.leaseSeconds); releasing its grant",
                         running.request_id, self._config.config.envoy.lease_seconds)
            self.release(running, Outcome.LEASE_EXPIRED, abandoned=True)
        if not lapsed:
            self.freed()
        self.leases.arm()

    def _watchdog_fire(self, token: str) -> None:
        """A grant outlived routing.scheduler.maxRunSeconds: free its slot for the next."""
        if not self._scheduler.is_running(token):
            return
        ticket = self._tickets[token]
        _log.warning("watchdog: request %s held the GPU past maxRunSeconds; releasing it", ticket.request_id)
        self._observer.watchdog_fired(ticket)
        # The exchange itself goes on in Envoy; only the GPU's grant ends (and with
        # upstream.abandonedGeneration: stop, the generation is stopped).
        self.release(ticket, Outcome.WATCHDOG, abandoned=False)

