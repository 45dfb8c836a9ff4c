"""The coordinator: the asyncio adapter around the pure core, and the only place that changes it.

One Ticket per request. Envoy's held ext_authz Check is `admit`: the ticket waits in the
scheduler until it is granted (the Check answers OK) or refused. Envoy's access log then
reports the granted exchange: periodic entries renew its lease (`report`, not final), the
final entry ends it and decides its outcome. Everything runs on one event loop, so the core
needs no locks.

Invariants enforced here (the other rooms of the runtime serve them and change nothing alone):
- a grant is made on a GPU (one upstream of `upstreams:`, `gpus.py`) only when it has room for
  it in fact (`GpuHolding.blocked`, told by `Gpus.tell`): no abandoned generation is still computing
  there (a settle, `settle.py`), no exchange this process does not hold is still reported on it
  by Envoy (an adopted lease, `leases.py`: granted by an earlier sidecar process, or a grant of
  ours whose lease lapsed), and the scheduler has a free slot there for the request
  (`Scheduler.next`: at most its ``slots`` grants, all of one model). An abandoned generation
  keeps its slot until its upstream's /slots processes no more slots than the grants and
  adopted exchanges this process holds there: while its settle runs, nothing new is granted on
  that GPU (the others serve on);
- every ticket is finished exactly once, through `_finish` (the first call wins), and
  `Observer.finished` fires exactly once per ticket;
- each grant is a lease: unrenewed for `envoy.leaseSeconds` it is released (`_leases_due`), so a
  lost final entry or a killed Envoy never leaves a ghost holder;
- an adopted exchange is held like a grant: `maxRunSeconds` applies to it (from the exchange's
  start) and an end that may leave the upstream computing is followed by a settle;
- a release tells the scheduler whether the model stays loaded by one rule,
  `core.model_stays_loaded`, which the simulator's replay follows too (an unload says it is
  not; a single-model upstream's one model always is);
- whatever can free a slot or change the best waiting request re-runs the grant decision
  (`_pump`): a release, a waiting request that leaves or expires, a reload, a settle's end,
  an adoption's end;
- the runtime decides outcomes; how they look over HTTP is the adapters' business.

Elsewhere (docs/architecture.md, "The rooms"): the model catalog checks and the model key
(`catalog.py`), slot learning (`slot_learning.py`), Retry-After and arrival estimates
(`forecast.py`), the grants' watchdogs (`watchdogs.py`), deferred telemetry (`deferred.py`), the
queue views and what holds the GPU (`views.py`), places kept for a retry (`kept.py`), the
request-id index (`request_ids.py`), settles and adopted exchanges (`adoptions.py`), the unloads
a grant waits for (`evictions.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from llamaswap.config import AbandonedGeneration, Config
from llamaswap.core import (
    NS_PER_S,
    SHUTDOWN_RETRY_AFTER_S,
    Clock,
    Decision,
    Estimator,
    MonotonicClock,
    Outcome,
    ExchangeEnd,
    QueueFull,
    Scheduler,
    abandons,
    exchange_outcome,
    model_stays_loaded,
)
from llamaswap.core.holding import GpuHolding
from llamaswap.config.model_key import ModelKey, model_key
from llamaswap.runtime.gpus import auto_slots, make_gpus, node_policy
from llamaswap.runtime.adoptions import Adoptions
from llamaswap.runtime.deferred import Deferred
from llamaswap.runtime.evictions import Evictions
from llamaswap.runtime.forecast import RETRY_AFTER_MAX_S, Forecast
from llamaswap.runtime.kept import PlaceKeeper
from llamaswap.runtime.leases import Leases
from llamaswap.runtime.request_ids import RequestIds
from llamaswap.runtime.observer import NoopObserver, Observer, overtaken_by, queue_picture
from llamaswap.runtime.ticket import Admission, Arrival, ExchangeReport, Refusal, Ticket, TicketState, Tokens
from llamaswap.runtime.upstream import Catalog, NoUpstream, Upstream
from llamaswap.runtime.views import GpuState, QueueView, QueueViews, RunningRow, WaitingRow, free
from llamaswap.runtime.watchdogs import Watchdogs

_log = logging.getLogger(__name__)

# How long the running request may take to finish when llamaswap stops (`--grace`).
GRACE_SECONDS_DEFAULT = 30.0
__all__ = ["GRACE_SECONDS_DEFAULT", "RETRY_AFTER_MAX_S", "Admission", "Coordinator", "GpuState", "QueueView",
           "Refusal", "RunningRow", "WaitingRow"]


class Coordinator:
    """Owns the Scheduler and every live Ticket; all methods run on one event loop."""

    def __init__(self, config: Config, *, clock: Clock | None = None, observer: Observer | None = None,
                 upstream: Upstream | None = None, upstreams: Sequence[Upstream] | None = None,
                 observe_after_grant: bool = True) -> None:
        """``upstreams``: one per `Config.upstream_entries`, in order (``upstream``: the one of a
        configuration with one upstream; neither: `NoUpstream`s)."""
        self._clock = clock or MonotonicClock()
        self._config = config
        if upstreams is None:
            upstreams = [upstream or NoUpstream()] if upstream is not None else [
                NoUpstream() for _ in config.upstream_entries]
        # The running grant, the adopted exchanges and what is remembered of finished grants,
        # with their timer (which is also the adopted exchanges' watchdog).
        self._leases = Leases(self._clock, self._leases_due, lambda: self._running, max_run_ns=self._max_run_ns)
        self.gpus = make_gpus(config, upstreams, dispatches=lambda name: self.scheduler.dispatches_on(name),
                               observed=lambda name, catalog, as_of: self.observe_catalog(catalog, as_of, name),
                               config_now=lambda: self._config, learnt=lambda: self._learnt(self._config),
                               runs=self._runs_model, default_slots=self._default_slots,
                               adopted=self._leases.adopted)
        self.scheduler = Scheduler(node_policy(config, self.gpus, None), self._clock)
        self._auto_slots = auto_slots(config)
        estimates = config.estimates
        self.estimator = Estimator(default_run_s=estimates.default_run_seconds,
                                   default_swap_s=estimates.default_swap_seconds, samples=estimates.samples)
        self._observer: Observer = observer or NoopObserver()
        self._tokens = Tokens()
        self._tickets: dict[str, Ticket] = {}
        self._request_ids = RequestIds()
        # routing.retryGraceSeconds: places kept for a retry (`kept.py`; the scheduler keeps them).
        self._kept = PlaceKeeper(self.scheduler, self._clock,
                                 grace_ns=lambda: round(self._config.routing.retry_grace_seconds * NS_PER_S),
                                 observe=lambda event: self._observe(self._observer.kept_place, event))
        self._held_checks = 0  # Checks being answered: each holds one of Envoy's streams to us
        # Each GPU's catalog, slot learning (upstream.slots: auto), settle and adopted exchanges: `gpus.py`.
        self._expiry: asyncio.TimerHandle | None = None
        self._watchdogs = Watchdogs(self._clock, lambda: self._config.routing.scheduler.max_run_seconds,
                                    self._watchdog_fire)
        self._admitting = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._version = 0
        # Settles and adopted exchanges (`adoptions.py`): what holds a GPU besides our grants.
        self._adoptions = Adoptions(clock=self._clock, config=lambda: self._config, scheduler=self.scheduler,
                                    gpus=self.gpus, leases=self._leases, tokens=self._tokens, observer=self._observer,
                                    observe=self._observe, busy=self._idle.clear, changed=self._changed,
                                    freed=self._freed, holding=self.holding_of,
                                    lease_ns=self._lease_ns)
        self._forecast = Forecast(self._clock, self.scheduler, self.estimator, gpus=self.gpus,
                                  schedule_model=lambda model: self._key(model).scheduled)
        self._views = self._forecast.views = QueueViews(
            self.scheduler, self.estimator, self._clock, self._tickets, self._request_ids.first,
            version=lambda: self._version, blocked=self._forecast.blocked_by_upstream,
            holdings=self._holdings)
        self._evictions = Evictions(self.gpus, self._clock, self._leases, self._lease_ns, self._forecast,
                                    scheduler=self.scheduler, release=lambda ticket: self._release(
                                        ticket, Outcome.UPSTREAM_ERROR, abandoned=False, sent=False))
        self._deferred = Deferred(self._publish_now, immediate=not observe_after_grant)
        self._observer.settings_changed(self.scheduler.policy)

    # -- configuration and state ---------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def _running(self) -> list[Ticket]:
        """The running grants' tickets, earliest first: the scheduler's grants are the one record
        of what runs (a grant's ticket is live until its release)."""
        tickets = self._tickets
        return [ticket for token in self.scheduler.running_ids() if (ticket := tickets.get(token)) is not None]

    def _holdings(self) -> tuple[GpuHolding, ...]:
        """What holds each GPU, the scheduler told first (`Gpus.tell`: a settle or adoption may have just changed)."""
        self.gpus.tell(self.scheduler)
        return self.scheduler.holdings()

    def holding_of(self, gpu: str) -> GpuHolding:
        return next(holding for holding in self._holdings() if holding.name == gpu)

    def _key(self, model: str | None) -> ModelKey:
        """What a request naming ``model`` is scheduled as, and whose models.<id> it gets."""
        return model_key(model, self._single_model(), self._config.models.keys())

    def _single_model(self) -> str | None:
        return self.gpus.single_model()

    def _default_slots(self, name: str) -> int:
        return self.scheduler.policy.gpu(name).slots.default

    @property
    def gpu_state(self) -> GpuState:
        return self._views.gpus().gpu

    @property
    def version(self) -> int:
        """A change counter: it moves whenever the queue, the grant or the GPU's state does."""
        return self._version

    def live_tickets(self) -> int:
        return len(self._tickets)

    def reconfigure(self, config: Config) -> None:
        """Apply new settings; the queue, the running request and the measurements are kept."""
        if config is not self._config:
            self.gpus.reloaded(config)
        self._config = config
        self._auto_slots = auto_slots(config)
        # Which models.<id> is each waiting request's under the new file (one may have been added).
        settings = {ticket.token: model_key(ticket.model, self._single_model(), config.models.keys()).settings
                    for ticket in self._tickets.values() if ticket.state is TicketState.WAITING}
        self.scheduler.reconfigure(node_policy(config, self.gpus, self._single_model()), settings)
        self.estimator.default_run_s = config.estimates.default_run_seconds
        self.estimator.default_swap_s = config.estimates.default_swap_seconds
        self._observer.settings_changed(self.scheduler.policy)
        for ticket in self._running:
            self._watchdogs.rearm(ticket)
        self._changed()
        self._arm_expiry()
        self._leases.arm()  # the adopted exchanges' watchdog follows a changed maxRunSeconds
        self._pump()

    # -- the request's way ---------------------------------------------------------------

    async def admit(self, arrival: Arrival) -> Admission:
        """The hold (a Check): queue the request and wait until it is granted or refused."""
        policy = self._config.priority_policy()
        priority = policy.resolve(arrival.priority_header, arrival.trusted_header, arrival.objective,
                                  arrival.service_tier)
        ticket = Ticket(self._tokens.next(), arrival, priority, self._clock.now_ns())
        self._held_checks += 1
        try:
            return await self._admit(ticket)
        except asyncio.CancelledError:
            # Envoy cancelled the Check: the client left while waiting (or while the upstream was
            # asked about its model, or just as it was granted).
            self._check_cancelled(ticket)
            raise
        except Exception:
            # A bug while admitting: the adapter answers 500; the ticket must not stay queued
            # (it would be granted with nobody to use the grant) nor go unfinished.
            self._check_cancelled(ticket, Outcome.INTERNAL_ERROR)
            raise
        finally:
            self._held_checks -= 1

    async def _admit(self, ticket: Ticket) -> Admission:
        priority = ticket.priority
        if not self._admitting:
            return self._refuse(ticket, Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S))
        if self._over_stream_limit():
            return self._refuse(ticket, Refusal(Outcome.REJECTED_FULL, self._forecast.retry_after_s(),
                                                queue_depth=self._held_checks - 1,
                                                queue_limit=self._config.envoy.max_sidecar_streams,
                                                limit_key="envoy.maxSidecarStreams"))
        if ticket.model is not None and not await self.serves(ticket.model):
            return self._refuse(ticket, Refusal(Outcome.REJECTED_UNKNOWN_MODEL, model=ticket.model))
        if not self._admitting:  # shutdown began while the catalog was asked
            return self._refuse(ticket, Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S))
        # What it is scheduled as (a single-model upstream: its one model, whatever the name) and
        # whose models.<id> settings it gets: one function says both.
        key = self._key(ticket.model)
        ticket.schedule_model = key.scheduled
        try:
            queued = self.scheduler.enqueue(ticket.token, priority, key.scheduled, priority_model=key.settings,
                                            alone=ticket.alone, retry_key=self._kept.retry_key(ticket),
                                            max_tokens=ticket.max_tokens)
        except QueueFull as exc:
            return self._refuse(ticket, Refusal(Outcome.REJECTED_FULL, self._forecast.retry_after_s(),
                                                queue_depth=exc.depth, queue_limit=exc.limit))
        # One arrival time, the scheduler's: the one its waits and aging count from.
        ticket.arrival_ns = queued.arrival_ns
        ticket.queue_depth_at_arrival = queued.depth
        if queued.taken is not None:
            self._kept.took_over(ticket, queued.taken)
        waiter: asyncio.Future[Decision | None] = asyncio.get_running_loop().create_future()
        ticket.waiter = waiter
        self._tickets[ticket.token] = ticket
        self._request_ids.add(ticket)
        self._changed()
        self._observer.enqueued(ticket)
        self._forecast.estimate_later(ticket)
        self._arm_expiry()
        self._pump()
        decision = await waiter
        if decision is None:
            assert ticket.outcome is not None
            return self._forecast.refusal_of(ticket)
        return ticket if ticket.unloads is None else await self._evictions.wait(ticket)  # (several resident)

    def report(self, token: str, report: ExchangeReport) -> None:
        """An access-log entry about a granted exchange: a lease renewal, or its end."""
        ticket = self._tickets.get(token)
        if ticket is None or ticket.state is not TicketState.RUNNING:
            self._adoptions.report(token, report)  # an exchange this process does not hold
            return
        if report.first_byte_s is not None:
            ticket.first_byte_s = report.first_byte_s
        now = self._clock.now_ns()
        if not report.final:
            ticket.lease_deadline_ns = now + self._lease_ns()
            return
        end = report.end or ExchangeEnd.UPSTREAM_FAILED
        ticket.end = end
        ticket.response_status = report.status
        self._release(ticket, exchange_outcome(end, report.status), abandoned=abandons(end))

    def peer_gone(self, peer: str) -> None:
        """An Envoy access-log stream ended: that Envoy connection's grant and waiting Checks
        are gone with it.

        In the bootstrap llamaswap generates (static, no listener updates) the stream ends only
        with its HTTP/2 connection, which also carried that Envoy worker's Checks. Their own
        cancellations arrive a moment later, and in any order with this call: the waiting ones
        end here first, so that the release below cannot grant the GPU to one of them (a grant
        nobody would use, holding the GPU until its lease lapsed)."""
        for ticket in [t for t in self._tickets.values() if t.peer == peer and t.state is TicketState.WAITING]:
            self._check_cancelled(ticket, pump=False)
        for running in [t for t in self._running if t.peer == peer]:
            if running.state is TicketState.RUNNING and self.scheduler.is_running(running.token):
                _log.warning("Envoy connection %s closed while request %s held the GPU; releasing it",
                             peer, running.request_id)
                self._release(running, Outcome.PROXY_GONE, abandoned=True)
        self._pump()  # the requests that left may have been the best: the next best may go now

    # -- shutdown ------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        """Refuse new requests and answer every waiting one 503 (graceful shutdown)."""
        self._admitting = False
        for removed in self.scheduler.drain():
            ticket = self._tickets.get(removed.request_id)
            if ticket is not None:
                self._finish(ticket, Outcome.SHUTDOWN, removed.removed_ns)
        self._kept.ended(self.scheduler.drain_kept())
        self._changed()
        self._arm_expiry()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs (no grant in any slot, no settle, no adopted exchange); True if
        it finished within the grace period."""
        if self._idle.is_set():  # wait_for(..., 0) times out even on a set event (Python 3.11)
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def abandon_running(self) -> None:
        """The grace period ended: record every running request as cut off by the shutdown."""
        for ticket in self._running:
            if self.scheduler.is_running(ticket.token):
                self._release(ticket, Outcome.SHUTDOWN, abandoned=False)

    def close(self) -> None:
        """Cancel timers and background work, and tell the observers what is left to tell (the
        loop is about to stop)."""
        self._deferred.run()
        if self._expiry is not None:
            self._expiry.cancel()
        self._forecast.close()
        self._evictions.close()
        self._watchdogs.close()
        self._leases.cancel()
        self.gpus.close()

    # -- the upstream --------------------------------------------------------------------

    def begin_startup_settle(self) -> None:
        """A new sidecar cannot know what the upstreams are doing: ask each before its first grant."""
        self._adoptions.begin_startup_settle()

    async def learn_slots(self) -> None:
        """upstream.slots: auto: ask the upstream how many generations it runs at once, and
        schedule with that many slots (1, with a log line, when it cannot tell). A reservation
        the learnt slots cannot hold is lowered, with a warning. In router mode each model is
        asked about once it is loaded (asking never loads it): `observe_catalog` asks for every
        model it sees loaded for the first time (`slot_learning.py`)."""
        await asyncio.gather(*(gpu.slots.learn() for gpu in self.gpus))

    def _learnt(self, config: Config) -> None:
        """The upstream said how many slots it has: schedule with them."""
        self.reconfigure(config)
        self._pump()  # more slots may let waiting requests go now

    def _runs_model(self, upstream: str, model: str) -> bool:
        return any(t.decision is not None and t.decision.model == model and t.decision.upstream == upstream
                   for t in self._running)

    async def serves(self, model: str) -> bool:
        """Whether a GPU that may run ``model`` as scheduled lists it (`Gpus.serves`)."""
        return await self.gpus.serves(model, self._key(model).scheduled, self.scheduler.policy,
                                      self._config.upstream.model_check)

    def observe_catalog(self, catalog: Catalog, as_of: int, upstream: str | None = None) -> None:
        """A catalog of an upstream (None: the first), asked when its `Scheduler.dispatches_on`
        was `as_of` (the reconcile loop): `Gpus.reconcile`."""
        self.gpus.reconcile(catalog, as_of, upstream, scheduler=self.scheduler, config=self._config,
                            changed=self._changed, reconfigure=lambda: self.reconfigure(self._config))

    # -- internals: granting and releasing -----------------------------------------------

    def _pump(self) -> None:
        """Grant while a GPU has room and someone waits: up to the slots of its loaded model."""
        # A settle or an adopted exchange on a GPU: nothing is granted there until it ends.
        self.gpus.tell(self.scheduler)
        times = self._forecast.gpu_times()  # (lazy: read only if the rule asks)
        while True:
            decision = self.scheduler.next(times)
            if decision is None:
                return
            ticket = self._tickets.get(decision.request_id)
            # Its unloads begin whatever becomes of it: the scheduler counts the evicted models gone.
            unloads = self._evictions.granted(decision)
            waiter = ticket.waiter if ticket is not None else None
            if ticket is not None and waiter is not None and not waiter.done():
                ticket.unloads = unloads
                self._grant(ticket, waiter, decision)
                continue
            # Envoy cancelled this Check a moment ago (its waiter is cancelled) and the handler
            # has not run its clean-up yet: nothing reached the upstream; the next one goes.
            self.scheduler.release(decision.request_id, reached_upstream=False)
            if ticket is not None:
                self._finish(ticket, Outcome.CANCELLED_WAITING, decision.granted_ns)

    def _grant(self, ticket: Ticket, waiter: asyncio.Future[Decision | None], decision: Decision) -> None:
        ticket.state = TicketState.RUNNING
        ticket.decision = decision
        ticket.lease_deadline_ns = decision.granted_ns + self._lease_ns()
        self._idle.clear()
        self._changed()
        self._leases.arm()
        self._watchdogs.arm(ticket)
        waiter.set_result(decision)
        if decision.upstream in self._auto_slots:
            self.gpus.named(decision.upstream).slots.after_grant(decision.model)
        overtaken = tuple(overtaken_by(self._tickets.get(token)) for token in decision.overtook)
        # The waiter's wake-up is already scheduled ahead of this: the next request's handoff
        # never waits for spans, metrics or log lines.
        self._observe(self._observer.dispatched, ticket, overtaken)

    def _release(self, ticket: Ticket, outcome: Outcome, *, abandoned: bool, sent: bool = True) -> None:
        decision = ticket.decision
        gpu = self.gpus.named(decision.upstream if decision is not None else None)
        model_loaded = model_stays_loaded(outcome, ticket.response_status,
                                          one_model=gpu.catalog.single_model() is not None, alone=ticket.alone)
        released = self.scheduler.release(ticket.token, model_loaded=model_loaded, reached_upstream=sent)
        self._watchdogs.cancel(ticket.token)
        # The lease timer also watches the adopted leases: re-arm it for them (or drop it).
        self._leases.arm()
        if outcome is Outcome.SERVED and decision is not None and ticket.generation:
            # Only a streamed first byte is the generation's start: a non-streamed one is its end,
            # and would teach generation length as swap cost.
            self.estimator.record(decision.model, run_s=released.run_ns / NS_PER_S, model_load=decision.model_load,
                                  first_byte_s=ticket.first_byte_s if ticket.streamed else None,
                                  max_tokens=ticket.max_tokens, upstream=decision.upstream)
        stop = self._config.upstream.abandoned_generation is AbandonedGeneration.STOP
        ticket.abandoned = abandoned or (outcome is Outcome.WATCHDOG and stop)
        self._finish(ticket, outcome, released.released_ns)
        if ticket.abandoned:
            self._adoptions.abandoned(gpu, ticket.model, ticket.request_id,
                                      decision.granted_ns if decision is not None else None)
        self._update_idle()
        self._pump()

    def _finish(self, ticket: Ticket, outcome: Outcome, at_ns: int) -> bool:
        """The one way a ticket ends. The first call wins; later ones change nothing."""
        if ticket.outcome is not None:
            return False
        ticket.outcome = outcome
        ticket.finished_ns = at_ns
        ticket.state = TicketState.DONE
        self._tickets.pop(ticket.token, None)
        self._request_ids.forget(ticket)
        if ticket.decision is not None and outcome in (Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE):
            # Released while its exchange may still run: if Envoy reports it again, it is adopted.
            self._leases.remember_lapsed(ticket.token, ticket.decision.granted_ns)
        waiter = ticket.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._changed()
        self._observe(self._observer.finished, ticket)
        return True

    def _over_stream_limit(self) -> bool:
        """With envoy.failOpen, Envoy's circuit breaker on the sidecar's streams is lifted (its
        overflow would pass requests unscheduled, since ext_authz treats it as the sidecar being
        unreachable): the sidecar holds the limit itself and refuses past it."""
        envoy = self._config.envoy
        return envoy.fail_open and self._held_checks > envoy.max_sidecar_streams

    def _refuse(self, ticket: Ticket, refusal: Refusal) -> Refusal:
        self._finish(ticket, refusal.outcome, self._clock.now_ns())
        return refusal

    def _check_cancelled(self, ticket: Ticket, outcome: Outcome = Outcome.CANCELLED_WAITING, *,
                         pump: bool = True) -> None:
        if ticket.state is TicketState.WAITING:
            keeps_place = outcome is Outcome.CANCELLED_WAITING
            removed = self._kept.keep(ticket, admitting=self._admitting) if keeps_place else None
            if removed is None:
                removed = self.scheduler.cancel(ticket.token)
            self._finish(ticket, outcome, removed.removed_ns if removed is not None else self._clock.now_ns())
            self._arm_expiry()
            if pump:
                self._pump()  # it may have been the best (a swap that held the rest back)
        elif ticket.state is TicketState.RUNNING and self.scheduler.is_running(ticket.token):
            # Granted in the same instant the client left (or admission failed): the OK never
            # reached Envoy, so nothing reached the upstream either.
            self._release(ticket, outcome, abandoned=False, sent=False)

    def _freed(self) -> None:
        """A settle, an adoption or a lease ended: grant again."""
        self._update_idle()
        self._pump()

    def _update_idle(self) -> None:
        if free(self._holdings()):
            self._idle.set()
        self._publish()

    # -- internals: timers ---------------------------------------------------------------

    def _lease_ns(self) -> int:
        return round(self._config.envoy.lease_seconds * NS_PER_S)

    def _max_run_ns(self) -> int:
        return round(self._config.routing.scheduler.max_run_seconds * NS_PER_S)

    def _leases_due(self) -> None:
        """The earliest lease deadline passed: lapsed adoptions end (as a lapsed grant of ours, with
        a settle), so do adoptions past maxRunSeconds (the watchdog's), lapsed grants are released."""
        self._adoptions.due()
        lapsed = self._leases.lapsed_running()
        for running in lapsed:
            if not self.scheduler.is_running(running.token):
                continue  # released by the release before it
            _log.warning("Envoy has not reported request %s for %.1f s (envoy.leaseSeconds); releasing its grant",
                         running.request_id, self._config.envoy.lease_seconds)
            self._release(running, Outcome.LEASE_EXPIRED, abandoned=True)
        if not lapsed:
            self._freed()
        self._leases.arm()

    def _watchdog_fire(self, token: str) -> None:
        """A grant outlived routing.scheduler.maxRunSeconds: free its slot for the next."""
        if not self.scheduler.is_running(token):
            return
        ticket = self._tickets[token]
        _log.warning("watchdog: request %s held the GPU past maxRunSeconds; releasing it", ticket.request_id)
        self._observer.watchdog_fired(ticket)
        # The exchange itself goes on in Envoy; only the GPU's grant ends (and with
        # upstream.abandonedGeneration: stop, the generation is stopped).
        self._release(ticket, Outcome.WATCHDOG, abandoned=False)

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
        for removed in self.scheduler.expire_overdue():
            ticket = self._tickets.get(removed.request_id)
            if ticket is not None:
                self._finish(ticket, Outcome.EXPIRED, removed.removed_ns)
        if self._kept.ended(self.scheduler.expire_kept()):
            self._changed()
        self._arm_expiry()
        self._pump()  # an expired request may have been the best (a swap that held the rest back)

    # -- views -----------------------------------------------------------------------------

    def view(self) -> QueueView:
        """The live queue (`views.py`), with the kept places."""
        return self._views.view(kept=self._kept.rows())

    def status_of(self, request_id: str) -> tuple[Ticket, WaitingRow | RunningRow] | None:
        """One client's own request, by its x-request-id (the public status route)."""
        return self._views.status_of(request_id)

    def _changed(self) -> None:
        self._version += 1
        self._publish()

    def _publish(self) -> None:
        self.gpus.tell(self.scheduler)  # (a settle's or an adoption's change publishes, or frees: `_holdings`)
        self._deferred.publish()

    def _publish_now(self) -> None:
        """The gauges' picture (`observer.queue_picture`; `deferred.py` sends it once per loop turn)."""
        self._observer.queue_changed(queue_picture(self.scheduler, self._views.gpus()))

    def _observe(self, callback: Callable[..., None], *args: object) -> None:
        """Observers run after the step (`deferred.py`): no handoff waits for telemetry."""
        self._deferred.observe(callback, *args)
