"""Settles and adoptions: what holds a GPU besides this process's grants.

A settle (`settle.py`) waits until an upstream computes no more than this process holds there:
begun at startup, and after a grant or an adopted exchange ends in a way that may leave the
upstream computing. An adoption is an exchange Envoy reports that this process does not hold
(granted by an earlier sidecar process, or a grant of ours whose lease lapsed): it is held like a
grant until its end, its lease lapses or `maxRunSeconds` passes. The scheduler owns the record
of what holds each GPU: it is told here at the moment a settle begins or ends and an adoption
begins or ends (`Scheduler.blocked_by`), so nothing reads the runtime's state to sync it. While
either runs on a GPU, nothing is granted there (`GpuHolding.blocked`, or the settling model
alone); when it ends, the coordinator is told (`freed`) so that it grants again. The coordinator
owns the tickets; this room changes no ticket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from llamaswap.config import AbandonedGeneration, Config
from llamaswap.core import NS_PER_S, Clock, Scheduler, abandons
from llamaswap.core.eviction import busy_of
from llamaswap.core.holding import GpuHolding
from llamaswap.runtime.gpus import Gpu, Gpus
from llamaswap.runtime.leases import Leases
from llamaswap.runtime.observer import Observer, Settle, SettleReason, SettleResult
from llamaswap.runtime.settle import Settling
from llamaswap.runtime.ticket import ExchangeEnd, ExchangeReport, Tokens
from llamaswap.runtime.upstream import NoUpstream

_log = logging.getLogger(__name__)


def known_running(gpu: GpuHolding, model: str | None) -> int:
    """The generations this process holds on a GPU that a settle of ``model`` counts beside the
    abandoned one: its grants of ``model`` (and of no model, which share its slots; none named:
    all its grants), and the adopted exchanges (whose model is not known). Each resident model
    runs in a process of its own, whose slots the upstream counts apart (`Upstream.busy`)."""
    return (gpu.running.busy if model is None else busy_of(gpu, model)[0]) + gpu.adopted


_ENDED = {SettleResult.ENDED: "ended", SettleResult.LAPSED: "is no longer reported by Envoy",
          SettleResult.WATCHDOG: "outlived maxRunSeconds and is let go"}


class Adoptions:
    """The settles and the adopted exchanges of the node's GPUs; all methods run on one event loop.

    ``busy``: a GPU is held by something new (the coordinator is not idle); ``changed``: the
    state the views show changed; ``freed``: a settle or an adoption ended (grant again);
    ``holding``: what holds a GPU now, by name (the generations this process holds there: `known_running`)."""

    def __init__(self, *, clock: Clock, config: Callable[[], Config], scheduler: Scheduler, gpus: Gpus,
                 leases: Leases, tokens: Tokens, observer: Observer, observe: Callable[..., None],
                 busy: Callable[[], None], changed: Callable[[], None], freed: Callable[[], None],
                 holding: Callable[[str], GpuHolding], lease_ns: Callable[[], int]) -> None:
        self._clock = clock
        self._config = config
        self._scheduler = scheduler
        self._gpus = gpus
        self._leases = leases
        self._tokens = tokens
        self._observer = observer
        self._observe = observe
        self._busy = busy
        self._changed = changed
        self._freed = freed
        self._holding = holding
        self._lease_ns = lease_ns

    def _tell(self, gpu: Gpu) -> None:
        """Tell the scheduler what holds ``gpu`` besides its grants now (`Scheduler.blocked_by`): at
        the moment a settle or an adoption there begins or ends, the one place it is told. A settle
        of a known model holds that model only, where the others may run beside it; where the
        upstream replaces its one model by itself (`Residency.replaces_by_itself`: another
        model's load would replace the settling one), it holds the whole GPU."""
        settling = gpu.settling
        self._scheduler.blocked_by(gpu.name, settling=settling is not None, adopted=len(gpu.adopted),
                                settling_model=None if settling is None else self._settled_model(gpu, settling))

    def _settled_model(self, gpu: Gpu, settling: Settling) -> str | None:
        """The model a settle of ``gpu`` waits on, as a process of its own: its model where each
        resident model runs in a process of its own; None (the whole GPU: every grant there shares
        the one process's slots) where the upstream replaces its one model by itself
        (`Residency.replaces_by_itself`), so that what it holds and what it counts beside the
        abandoned generation (`known_running`) are the same."""
        return None if self._holding(gpu.name).residency.replaces_by_itself else settling.model

    def _stops(self) -> bool:
        return self._config().upstream.abandoned_generation is AbandonedGeneration.STOP

    # -- settles ---------------------------------------------------------------------------

    def begin_startup_settle(self) -> None:
        """A new sidecar cannot know what the upstreams are doing: ask each before its first grant."""
        for gpu in self._gpus:
            if not isinstance(gpu.upstream, NoUpstream) and gpu.settling is None:
                self._begin_settle(gpu, SettleReason.STARTUP, None, "-", None, stop=False)

    def abandoned(self, gpu: Gpu, model: str | None, request_id: str, granted_ns: int | None, *,
                  reason: SettleReason = SettleReason.ABANDONED) -> None:
        """A grant of ours ended while its generation may go on: settle its GPU (with
        abandonedGeneration: stop, stopping it). ``reason`` `STOPPED`: a line of the Batch API
        stopped for a higher band (`stops.py`), which lets go at its next token
        (`Settling.lets_go_at_token`)."""
        self._settle_for(gpu, reason, model, request_id, granted_ns, stop=self._stops())

    def _settle_for(self, gpu: Gpu, reason: SettleReason, model: str | None, request_id: str,
                    granted_ns: int | None, *, stop: bool) -> None:
        """Begin a settle of ``gpu``, or join the one under way: it waits until the upstream
        computes no more than what this process holds, and the generation that ended is no longer
        held. Joined by anything but a stopped line, it now covers a generation that may run on."""
        if gpu.settling is None:
            self._begin_settle(gpu, reason, model, request_id, granted_ns, stop=stop)
        elif reason is not SettleReason.STOPPED:
            gpu.settling.lets_go_at_token = False

    def _begin_settle(self, gpu: Gpu, reason: SettleReason, model: str | None, request_id: str,
                     granted_ns: int | None, *, stop: bool) -> None:
        settling = Settling(reason, model, request_id, granted_ns, self._clock.now_ns(),
                            lets_go_at_token=reason is SettleReason.STOPPED)
        gpu.settling = settling
        self._tell(gpu)
        self._busy()
        self._changed()
        settling.task = asyncio.ensure_future(self._settle(gpu, settling, stop))

    async def _settle(self, gpu: Gpu, settling: Settling, stop: bool) -> None:
        """The settle loop (`settle.py`) of one GPU; then it is free again: grant."""
        config = self._config()
        scheduler = self._scheduler

        def unloaded() -> None:
            # Stopping unloads the settle's model (none named: every loaded one); the others stay.
            model = settling.model
            left = scheduler.residents_on(gpu.name) - {model} if model is not None else frozenset()
            if scheduler.set_residents(left, as_of=scheduler.dispatches_on(gpu.name), gpu=gpu.name):
                self._changed()

        try:
            settle = await gpu.settle(settling, stop=stop, clock=self._clock, unloaded=unloaded,
                                      settle_timeout_s=config.upstream.settle_timeout_seconds,
                                      max_run_s=config.routing.scheduler.max_run_seconds, lease_ns=self._lease_ns(),
                                      known_running=lambda: known_running(self._holding(gpu.name),
                                                                                 self._settled_model(gpu, settling)))
        finally:
            self._tell(gpu)  # it ended (or was cancelled): no longer under way
        self._observe(self._observer.settled, settle)  # after the abandoned ticket's `finished`
        self._changed()
        self._freed()

    # -- adoptions -------------------------------------------------------------------------

    def report(self, token: str, report: ExchangeReport) -> None:
        """An entry for an exchange this process does not hold. Periodic entries prove it still
        runs: unless it is ours and finished, or was let go on purpose (the watchdog), the GPU
        is busy with it, so adopt it as a lease until its end."""
        if token in self._leases.adopted:
            if not report.final:
                self._leases.renew_adopted(token, self._lease_ns())
                return
            self._end(token, SettleResult.ENDED, abandoned=abandons(report.end or ExchangeEnd.UPSTREAM_FAILED))
            self._freed()
            return
        now = self._clock.now_ns()
        ours = self._tokens.issued(token)
        adoptable = self._leases.to_adopt(token, ours=ours, final=report.final, elapsed_s=report.elapsed_s,
                                          now_ns=now)
        if adoptable is None:
            return
        whose = ("a grant of ours whose lease lapsed or whose Envoy connection went" if ours
                 else "granted by an earlier sidecar process")
        started_ns = adoptable.started_ns
        # It holds the GPU of our grant, else the one Envoy's entry names (`Gpus.reported`).
        gpu = self._gpus.named(adoptable.gpu) if adoptable.gpu is not None else self._gpus.reported(report.gpu)
        if gpu is None:
            _log.warning("Envoy reports an exchange this sidecar does not hold (%s, started %.1f s ago) on "
                         "upstream %s, which is none of this node's GPUs: it holds none of them", whose,
                         (now - started_ns) / NS_PER_S, report.gpu or "(none named)")
            return
        _log.warning("Envoy reports an exchange this sidecar does not hold (%s, started %.1f s ago) on %s; "
                     "no grant there until it ends", whose, (now - started_ns) / NS_PER_S, gpu.name)
        self._leases.adopt(token, self._lease_ns(), started_ns=started_ns, ours=ours, gpu=gpu.name)
        self._tell(gpu)
        self._busy()
        self._changed()
        self._leases.arm()

    def due(self) -> None:
        """The leases' deadline passed: lapsed adoptions end (as a lapsed grant of ours, with a
        settle), so do adoptions past maxRunSeconds (the watchdog's)."""
        for token in self._leases.lapsed_adopted():
            self._end(token, SettleResult.LAPSED, abandoned=True)
        for token in self._leases.overrun_adopted():
            _log.warning("watchdog: an adopted exchange held the GPU past maxRunSeconds; letting it go")
            self._end(token, SettleResult.WATCHDOG, abandoned=False)

    def _end(self, token: str, result: SettleResult, *, abandoned: bool) -> None:
        """An adopted exchange no longer holds the GPU. As after a grant of ours, an end that may
        leave the upstream computing (`abandoned`; the watchdog's with abandonedGeneration: stop)
        is followed by a settle."""
        adoption = self._leases.end_adopted(token)
        gpu = self._gpus.named(adoption.gpu)
        self._tell(gpu)
        if result is SettleResult.ENDED or (result is SettleResult.WATCHDOG and adoption.ours):
            self._leases.forget_lapsed(token)
        elif result is SettleResult.WATCHDOG:
            self._leases.let_go(token)
        settle = Settle(SettleReason.ADOPTED, result, None, "-", adoption.adopted_ns, self._clock.now_ns(), gpu.name)
        how = _ENDED.get(result, str(result))
        _log.info("the adopted exchange %s after %.3f s; the GPU is free again", how, settle.seconds)
        self._observe(self._observer.settled, settle)
        stop = self._stops()
        if abandoned or (result is SettleResult.WATCHDOG and stop):
            # Its model is not known: the upstream is asked about (or stops) every loaded one.
            self._settle_for(gpu, SettleReason.ABANDONED, None, "-", adoption.started_ns, stop=stop)
