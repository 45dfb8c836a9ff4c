"""The coordinator: the asyncio adapter around the pure core; it and its rooms are the only place that changes it.

One Ticket per request. Envoy's held ext_authz Check is `admit`: the ticket waits in the
scheduler until it is granted (the Check answers OK) or refused. Envoy's access log then
reports the granted exchange: periodic entries renew its lease (`report`, not final), the
final entry ends it and decides its outcome. Everything runs on one event loop, so the core
needs no locks.

Invariants enforced here (the other rooms of the runtime serve them and change nothing alone):
- a grant is made on a GPU (one upstream of `upstreams:`, `gpus.py`) only when it has room for
  it in fact (`GpuHolding.blocked`, told by `Adoptions` as each begins and ends): no abandoned
  generation is still computing there (a settle, `settle.py`), no exchange this process does not
  hold is still reported on it by Envoy (an adopted lease, `leases.py`: granted by an earlier
  sidecar process, or a grant of ours whose lease lapsed), and the scheduler has a free slot there for the request
  (`Scheduler.next`: at most its ``slots`` grants, all of one model). An abandoned generation
  keeps its slot until its upstream's /slots processes no more slots than the grants and
  adopted exchanges this process holds there: while its settle runs, nothing new is granted on
  that GPU (the others serve on);
- every ticket is finished exactly once, through `Grants.finish` (the first call wins), and
  `Observer.finished` fires exactly once per ticket;
- each grant is a lease: unrenewed for `envoy.leaseSeconds` it is released (`Grants._leases_due`),
  so a lost final entry or a killed Envoy never leaves a ghost holder;
- an adopted exchange is held like a grant: `maxRunSeconds` applies to it (from the exchange's
  start) and an end that may leave the upstream computing is followed by a settle;
- a release tells the scheduler whether the model stays loaded by one rule,
  `core.model_stays_loaded`, which the simulator's replay follows too (an unload says it is
  not; a single-model upstream's one model always is);
- whatever can free a slot or change the best waiting request re-runs the grant decision
  (`Grants.pump`): a release, a waiting request that leaves or expires, a reload, a settle's end,
  an adoption's end;
- the runtime decides outcomes; how they look over HTTP is the adapters' business.

The coordinator builds its parts and holds them together; each job is a room of its own:
admission and refusal, the waiting side (`admission.py`); grants, leases, watchdogs and release,
the running side (`grants.py`); the publishing of pictures and observers (`publishing.py`); the
configuration in effect and what a model is scheduled as (`live_config.py`); what holds each GPU
is the scheduler's record (`Scheduler.holdings`). The coordinator itself applies a reload
(`reconfigure`) and answers the adapters. Elsewhere (docs/architecture.md, "The rooms"): the model
catalog checks and the model key (`catalog.py`), slot learning (`slot_learning.py`), Retry-After and arrival estimates
(`forecast.py`), the grants' watchdogs (`watchdogs.py`), deferred telemetry (`deferred.py`), the
queue views and what holds the GPU (`views.py`), places kept for a retry (`kept.py`), the
request-id index (`request_ids.py`), settles and adopted exchanges (`adoptions.py`), the unloads
a grant waits for (`evictions.py`), idle unloads (`idle.py`, built and re-armed by the grants).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from llamaswap.config import Config
from llamaswap.core import Clock, Estimator, MonotonicClock, Scheduler
from llamaswap.core.holding import GpuHolding
from llamaswap.runtime.admission import Admitter
from llamaswap.runtime.asleep import RouterSleep
from llamaswap.runtime.forecast import RETRY_AFTER_MAX_S, Forecast
from llamaswap.runtime.gpus import make_gpus, node_policy
from llamaswap.runtime.grants import Grants
from llamaswap.runtime.kept import KeptEvent, PlaceKeeper
from llamaswap.runtime.leases import Adoption
from llamaswap.runtime.live_config import LiveConfig, ModelKeys
from llamaswap.runtime.observer import NoopObserver, Observer
from llamaswap.runtime.publishing import Publisher, Version
from llamaswap.runtime.request_ids import RequestIds
from llamaswap.runtime.stops import Lines
from llamaswap.runtime.ticket import Admission, Arrival, ExchangeReport, Refusal, Ticket, TicketState, Tokens
from llamaswap.runtime.upstream import Catalog, NoUpstream, Upstream
from llamaswap.runtime.views import GpuState, QueueView, QueueViews, RunningRow, WaitingRow

# How long the running request may take to finish when llamaswap stops (`--grace`).
GRACE_SECONDS_DEFAULT = 30.0
__all__ = ["GRACE_SECONDS_DEFAULT", "RETRY_AFTER_MAX_S", "Admission", "Coordinator", "GpuState", "QueueView",
           "Refusal", "RunningRow", "WaitingRow"]


class Coordinator:
    """Owns the Scheduler and every live Ticket; all methods run on one event loop."""

    def __init__(self, config: Config, *, clock: Clock | None = None, observer: Observer | None = None,
                 upstream: Upstream | None = None, upstreams: Sequence[Upstream] | None = None,
                 observe_after_grant: bool = True, lines: Lines | None = None) -> None:
        """``upstreams``: one per `Config.gpu_entries`, in order (``upstream``: the one of a
        configuration with one upstream; neither: `NoUpstream`s). ``lines``: the Batch API's
        lines that may be stopped for a higher band (`stops.py`; none without it)."""
        self._clock = clock or MonotonicClock()
        self._config = LiveConfig(config)
        if upstreams is None:
            upstreams = [upstream or NoUpstream()] if upstream is not None else [
                NoUpstream() for _ in config.gpu_entries]
        # The node's adopted exchanges by token: the one record of them (`Leases.adopted`), which each GPU reads.
        adopted: dict[str, Adoption] = {}
        # Each GPU's catalog, slot learning (upstream.slots: auto), settle and adopted exchanges: `gpus.py`.
        # (Its callbacks reach the scheduler and the grants, built after it: the coordinator's methods.)
        self.gpus = make_gpus(config, upstreams, dispatches=self._dispatches_on, observed=self._catalog_of,
                              config_now=self._config.current, learnt=self._learnt, runs=self._runs_model,
                              default_slots=self._default_slots, adopted=adopted)
        self.scheduler = Scheduler(node_policy(config, self.gpus, None), self._clock)
        self._keys = ModelKeys(self._config, self.gpus)
        estimates = config.estimates
        self.estimator = Estimator(default_run_s=estimates.default_run_seconds,
                                   default_swap_s=estimates.default_swap_seconds, samples=estimates.samples)
        self._observer: Observer = observer or NoopObserver()
        self._tokens = Tokens()
        self._tickets: dict[str, Ticket] = {}
        self._request_ids = RequestIds()
        self._version = Version()

        def views(blocked: Callable[[], Mapping[str, float]]) -> QueueViews:
            return QueueViews(self.scheduler, self.estimator, self._clock, self._tickets, self._request_ids.first,
                              version=self._version.current, blocked=blocked, holdings=self.scheduler.holdings,
                              unloadable=self.gpus.routers, lines=lines)

        self._forecast = Forecast(self._clock, self.scheduler, self.estimator, gpus=self.gpus,
                                  schedule_model=self._keys.scheduled, views=views)
        assert self._forecast.views is not None
        self._views: QueueViews = self._forecast.views
        self._publisher = Publisher(version=self._version, scheduler=self.scheduler,
                                    observer=self._observer, views=self._views, immediate=not observe_after_grant)
        self._grants = Grants(clock=self._clock, config=self._config, scheduler=self.scheduler, gpus=self.gpus,
                              estimator=self.estimator, tickets=self._tickets, request_ids=self._request_ids,
                              tokens=self._tokens, observer=self._observer, publisher=self._publisher,
                              forecast=self._forecast, adopted=adopted, lines=lines)
        self._leases = self._grants.leases
        self._watchdogs = self._grants.watchdogs
        self._adoptions = self._grants.adoptions
        self._evictions = self._grants.evictions
        # The router's own sleep (`asleep.py`): read before a request of a model it may have put to sleep.
        self._sleep = RouterSleep(self.gpus, self.scheduler, self._clock, self._evictions)
        # routing.retryGraceSeconds: places kept for a retry (`kept.py`; the scheduler keeps them).
        self._kept = PlaceKeeper(self.scheduler, self._clock, grace_ns=self._config.retry_grace_ns,
                                 observe=self._observe_kept)
        self._admitter = Admitter(clock=self._clock, config=self._config, scheduler=self.scheduler, gpus=self.gpus,
                                  keys=self._keys, tickets=self._tickets, request_ids=self._request_ids,
                                  tokens=self._tokens, observer=self._observer, publisher=self._publisher,
                                  forecast=self._forecast, kept=self._kept, grants=self._grants,
                                  sleep=self._sleep)
        self._observer.settings_changed(self.scheduler.policy)

    # -- configuration and state ---------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._config.config

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def admitting(self) -> bool:
        return self._admitter.admitting

    def holding_of(self, gpu: str) -> GpuHolding:
        return self.scheduler.holding_of(gpu)

    def _dispatches_on(self, gpu: str) -> int:
        return self.scheduler.dispatches_on(gpu)

    def _default_slots(self, name: str) -> int:
        return self.scheduler.policy.gpu(name).slots.default

    def _runs_model(self, gpu: str, model: str) -> bool:
        return self._grants.runs_model(gpu, model)

    def _observe_kept(self, event: KeptEvent) -> None:
        self._publisher.observe(self._observer.kept_place, event)

    @property
    def gpu_state(self) -> GpuState:
        return self._views.gpus().gpu

    @property
    def version(self) -> int:
        """A change counter: it moves whenever the queue, the grant or the GPU's state does."""
        return self._version.current()

    def live_tickets(self) -> int:
        return len(self._tickets)

    def reconfigure(self, config: Config) -> None:
        """Apply new settings; the queue, the running request and the measurements are kept."""
        if config is not self._config.config:
            self.gpus.reloaded(config)
        self._config.set(config)
        # Which models.<id> is each waiting request's under the new file (one may have been added).
        settings = {ticket.token: self._keys.key(ticket.model).settings
                    for ticket in self._tickets.values() if ticket.state is TicketState.WAITING}
        self.scheduler.reconfigure(node_policy(config, self.gpus, self.gpus.single_model()), settings)
        self.estimator.default_run_s = config.estimates.default_run_seconds
        self.estimator.default_swap_s = config.estimates.default_swap_seconds
        self._observer.settings_changed(self.scheduler.policy)
        self._grants.reconfigured()
        self._publisher.changed()
        self._admitter.arm_expiry()
        self._leases.arm()  # the adopted exchanges' watchdog follows a changed maxRunSeconds
        self._grants.pump()

    # -- the request's way ---------------------------------------------------------------

    async def admit(self, arrival: Arrival) -> Admission:
        """The hold (a Check): queue the request and wait until it is granted or refused (`admission.py`)."""
        return await self._admitter.admit(arrival)

    def report(self, token: str, report: ExchangeReport) -> None:
        """An access-log entry about a granted exchange: a lease renewal, or its end (`grants.py`)."""
        self._grants.report(token, report)

    def peer_gone(self, peer: str) -> None:
        """An Envoy access-log stream ended: that Envoy connection's grant and waiting Checks
        are gone with it.

        In the bootstrap llamaswap generates (static, no listener updates) the stream ends only
        with its HTTP/2 connection, which also carried that Envoy worker's Checks. Their own
        cancellations arrive a moment later, and in any order with this call: the waiting ones
        end here first, so that the release below cannot grant the GPU to one of them (a grant
        nobody would use, holding the GPU until its lease lapsed)."""
        self._admitter.peer_gone(peer)
        self._grants.peer_gone(peer)
        self._grants.pump()  # the requests that left may have been the best: the next best may go now

    # -- shutdown ------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        """Refuse new requests and answer every waiting one 503 (graceful shutdown)."""
        self._admitter.stop_admitting()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs (no grant in any slot, no settle, no adopted exchange); True if
        it finished within the grace period."""
        return await self._grants.wait_idle(timeout_s)

    def abandon_running(self) -> None:
        """The grace period ended: record every running request as cut off by the shutdown."""
        self._grants.abandon_running()

    def close(self) -> None:
        """Cancel timers and background work, and tell the observers what is left to tell (the
        loop is about to stop)."""
        self._publisher.flush()
        self._admitter.close()
        self._forecast.close()
        self._grants.close()
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

    def _learnt(self) -> None:
        """The upstream said how many slots it has: schedule with them."""
        self.reconfigure(self._config.config)
        self._grants.pump()  # more slots may let waiting requests go now

    async def serves(self, model: str) -> bool:
        """Whether a GPU that may run ``model`` as scheduled lists it (`Admitter.serves`; the
        Batch API's feeder asks it of each line)."""
        return await self._admitter.serves(model)

    def _catalog_of(self, gpu: str, catalog: Catalog, as_of: int) -> None:
        self.observe_catalog(catalog, as_of, gpu)

    def observe_catalog(self, catalog: Catalog, as_of: int, gpu: str) -> None:
        """A catalog of an upstream, asked when its `Scheduler.dispatches_on`
        was `as_of` (the reconcile loop): `Gpus.reconcile`, with the sleeping models that would not
        unload counted (`RouterSleep.reported`); then the models the router put to sleep that hold
        a place of its own are unloaded (`RouterSleep.observed`)."""
        catalog = self._sleep.reported(gpu, catalog)
        self.gpus.reconcile(catalog, as_of, gpu, scheduler=self.scheduler, config=self._config.config,
                            changed=self._publisher.changed, reconfigure=self._reload_in_effect)
        self._sleep.observed(self.gpus.named(gpu), catalog)
        self._grants.idle_unloads.arm()  # (a model counted resident anew counts its idle time from now)

    def _reload_in_effect(self) -> None:
        self.reconfigure(self._config.config)

    # -- views -----------------------------------------------------------------------------

    def view(self) -> QueueView:
        """The live queue (`views.py`), with the kept places."""
        return self._views.view(kept=self._kept.rows())

    def status_of(self, request_id: str) -> tuple[Ticket, WaitingRow | RunningRow] | None:
        """One client's own request, by its x-request-id (the public status route)."""
        return self._views.status_of(request_id)
