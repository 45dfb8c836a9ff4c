"""Evictions before a load: the resident models a grant evicts (`Decision.evicts`: none where
the upstream replaces its one model by itself, `Residency.replaces_by_itself`) are unloaded on
its GPU, and the request goes only once the upstream no longer lists them. Models no grant evicts
(the router's sleeping ones, `asleep.py`) are unloaded the same way (`unload`), and the grants
there wait for them as for a grant's.

Why the runtime waits: llama-server's router (`--models-max N`) unloads the least recently used
model by itself when a load would pass N, busy or not. llamaswap chooses what goes (never a model
that runs, loads or is held for a request; the one the queue needs least), so a load reaches the
router only once its evictions are done.

Invariants:
- a grant's unloads begin as it is granted (`granted`), and run to their end whether or not its
  client stays: an unload half done is not taken back (a client that leaves meanwhile is released
  as one that left waiting: nothing of it reached the upstream);
- on one GPU, a grant that loads a model, goes beside such a load, runs alone or names a model
  being unloaded goes only once every unload begun there before it has ended; a grant of a
  resident model that stays goes at once, and a grant with nothing to wait for never waits a loop
  turn;
- an unload that fails (refused, no router, or the model still listed `UNLOAD_TIMEOUT_S` after it)
  fails every grant waiting for it, and every unload begun after it there: each such request is
  answered 503 (`Outcome.UPSTREAM_ERROR`, released as never sent) and its GPU's models are read
  again. A load that would make the router evict by itself is never let through;
- a grant's lease waits with it: Envoy reports nothing of a request it has not sent yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from llamaswap.core import NS_PER_S, Clock, Decision, Outcome, Scheduler
from llamaswap.runtime.forecast import Forecast
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.leases import Leases
from llamaswap.runtime.ticket import Refusal, Ticket, TicketState
from llamaswap.runtime.upstream import Upstream

_log = logging.getLogger(__name__)

# How long an unload may take: llama-server's router gives a model's process 10 s to exit after
# POST /models/unload (its stop-timeout), then kills it.
UNLOAD_TIMEOUT_S = 20.0

# What a wait for unloads ends with: None once every model is gone, else one that would not go.
Unloads = asyncio.Future[str | None]


@dataclasses.dataclass(eq=False, slots=True)
class _Unloading:
    """Unloads under way on one GPU: the models, and their end."""

    models: frozenset[str]
    done: Unloads


class Evictions:
    """The unloads under way on each GPU and the grants that wait for them.

    ``scheduler``: whether a grant is still held, and where to count again the models an unload
    left resident; ``release(ticket)``: end a grant whose unloads failed (the coordinator's
    release, as never sent)."""

    def __init__(self, gpus: Gpus, clock: Clock, leases: Leases, lease_ns: Callable[[], int], forecast: Forecast, *,
                 scheduler: Scheduler, release: Callable[[Ticket], None],
                 timeout_s: float = UNLOAD_TIMEOUT_S) -> None:
        self._gpus = gpus
        self._clock = clock
        self._leases = leases
        self._lease_ns = lease_ns
        self._forecast = forecast
        self._scheduler = scheduler
        self._release = release
        self.timeout_s = timeout_s
        self._under_way: dict[str, list[_Unloading]] = {}  # by GPU, in the order they began

    def evicting(self, gpu: str) -> frozenset[str]:
        """The models being unloaded on a GPU now."""
        return frozenset(model for unloading in self._live(gpu) for model in unloading.models)

    def _live(self, gpu: str) -> list[_Unloading]:
        under_way = [unloading for unloading in self._under_way.get(gpu, ()) if not unloading.done.done()]
        if under_way:
            self._under_way[gpu] = under_way
        else:
            self._under_way.pop(gpu, None)
        return under_way

    def granted(self, decision: Decision) -> Unloads | None:
        """A grant was made: begin its unloads (after those under way on its GPU); what it waits
        for before it goes, None if nothing."""
        gpu = decision.gpu
        if not decision.evicts and gpu not in self._under_way:
            return None  # (every grant passes here: nothing is built for the common one)
        if decision.evicts:
            for eviction in decision.evicts:
                _log.info("unloading %s on %s to make room for %s (%s; request %s)", eviction.model, gpu,
                          decision.model, eviction.reason, decision.request_id)
            return self._begin(gpu, tuple(dict.fromkeys(eviction.model for eviction in decision.evicts)))
        under_way = self._live(gpu)
        if not under_way or _goes_now(decision, self.evicting(gpu)):
            return None
        return asyncio.ensure_future(_first_failure([unloading.done for unloading in under_way]))

    def unload(self, gpu: str, models: frozenset[str], why: str) -> Unloads:
        """Unload models no grant evicts (the router's sleeping ones: `asleep.py`), after the
        unloads under way on the GPU; the grants there wait for it as for a grant's evictions."""
        for model in sorted(models):
            _log.info("unloading %s on %s: %s", model, gpu, why)
        return self._begin(gpu, tuple(sorted(models)))

    def _begin(self, gpu: str, models: Sequence[str]) -> Unloads:
        under_way = self._live(gpu)
        done = asyncio.ensure_future(self._unload(gpu, models, [unloading.done for unloading in under_way]))
        self._under_way[gpu] = [*under_way, _Unloading(frozenset(models), done)]
        return done

    async def _unload(self, gpu: str, models: Sequence[str], earlier: Sequence[Unloads]) -> str | None:
        failed = await _first_failure(earlier)
        if failed is not None:
            # What runs there is not what llamaswap believes: no load goes on it, and none of its
            # models was unloaded.
            self._not_unloaded(gpu, models)
            return failed
        upstream = self._gpus.named(gpu).upstream
        gone = await asyncio.gather(*(self._unload_one(upstream, model) for model in models))
        left = [model for model, ok in zip(models, gone, strict=True) if not ok]
        if left:
            self._not_unloaded(gpu, left)
        return left[0] if left else None

    def _not_unloaded(self, gpu: str, models: Sequence[str]) -> None:
        """Models still loaded that the scheduler counted gone: counted again, whether or not a
        request waits for them (one that left or was cancelled no longer reads the models again),
        and the GPU's models read again."""
        self._scheduler.not_unloaded(gpu, frozenset(models))
        self._gpus.named(gpu).catalog.refresh_later()

    async def _unload_one(self, upstream: Upstream, model: str) -> bool:
        try:
            return await upstream.unload(model, timeout_s=self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - an adapter's failure is an unload that did not happen
            _log.exception("unloading %s failed", model)
            return False

    async def wait(self, ticket: Ticket) -> Ticket | Refusal:
        """The hold goes on until the unloads ``ticket``'s grant waits for have ended: then it goes
        (the ticket), or it is refused (an unload failed: 503; released meanwhile: its outcome's
        answer). A client that leaves meanwhile is the caller's (`Admitter.admit`): the unloads
        go on without it."""
        unloads, decision = ticket.unloads, ticket.decision
        assert unloads is not None and decision is not None
        # Its lease: no access-log entry can come before it goes. Every unload before it may take
        # up to `timeout_s`.
        waits_s = self.timeout_s * (len(self._under_way.get(decision.gpu, ())) + 1)
        self._hold_lease(ticket, waits_s)
        failed = await asyncio.shield(unloads)
        ticket.unloads = None
        if ticket.state is not TicketState.RUNNING or not self._scheduler.is_running(ticket.token):
            return self._forecast.refusal_of(ticket)  # released meanwhile (the watchdog, a shutdown, Envoy gone)
        if failed is None:
            self._hold_lease(ticket, 0.0)
            return ticket
        _log.warning("request %s for %s on %s is refused: the upstream did not unload %s to make room for it",
                     ticket.request_id, decision.model, decision.gpu, failed)
        self._release(ticket)
        return Refusal(Outcome.UPSTREAM_ERROR, self._forecast.retry_after_s(), model=decision.model,
                       evicting=failed)

    def _hold_lease(self, ticket: Ticket, more_s: float) -> None:
        ticket.lease_deadline_ns = self._clock.now_ns() + self._lease_ns() + round(more_s * NS_PER_S)
        self._leases.arm()

    def close(self) -> None:
        for under_way in self._under_way.values():
            for unloading in under_way:
                unloading.done.cancel()
        self._under_way.clear()


def _goes_now(decision: Decision, evicting: frozenset[str]) -> bool:
    """A grant that neither loads, nor runs alone, nor names a model being unloaded goes beside
    the unloads under way on its GPU (its model stays resident)."""
    if decision.alone:
        return False
    model = decision.model
    if model is None:
        return True  # it names no model: it loads nothing
    return decision.ready_at is None and model not in evicting  # (a load sets it too)


async def _first_failure(unloads: Sequence[Unloads]) -> str | None:
    """Wait for each of ``unloads`` (without cancelling them if this wait is): the first model
    that would not go, None if all went."""
    failed = None
    for done in unloads:
        result = await asyncio.shield(done)
        failed = failed or result
    return failed
