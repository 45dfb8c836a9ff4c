"""What the runtime tells clients about time: when to come back (Retry-After, and the refusal
that carries it) and the estimated wait recorded at arrival, both from the estimator
(`core.estimate`) over what runs now."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping

from llamaswap.core import NS_PER_S, SHUTDOWN_RETRY_AFTER_S, Clock, Estimator, Outcome, Scheduler
from llamaswap.core.dispatch import full, takes_nothing
from llamaswap.core.estimate import expected_end_s, left_s
from llamaswap.core.estimate_node import NodeTimes
from llamaswap.runtime.gpus import Gpus
from llamaswap.runtime.ticket import Refusal, Ticket, TicketState
from llamaswap.runtime.views import QueueViews

# A refused client is told to come back when a place is expected to free, within these bounds.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 3600
# Estimates made at arrival are batched: one walk of the queue for all arrivals in this window,
# widened when walks get slow (a deep queue), so estimating never costs more than ~10% of a core.
ESTIMATE_BATCH_S = 0.05
_ESTIMATE_CPU_SHARE = 0.1


class Forecast:
    """``gpus``: the node's GPUs as the runtime keeps them (each one's settle under way, if any);
    ``schedule_model`` says what a settling generation was scheduled as (the estimator's key);
    ``views`` builds the queue views from this forecast's `blocked_by_gpu` (the views show
    it, and the arrival estimates walk them: each needs the other); without it nothing is
    estimated at arrival."""

    def __init__(self, clock: Clock, scheduler: Scheduler, estimator: Estimator, *, gpus: Gpus | None = None,
                 schedule_model: Callable[[str | None], str | None],
                 views: Callable[[Callable[[], Mapping[str, float]]], QueueViews] | None = None) -> None:
        self._clock = clock
        self._scheduler = scheduler
        self._estimator = estimator
        self._gpus = gpus
        self._schedule_model = schedule_model
        self.views = views(self.blocked_by_gpu) if views is not None else None
        self._pending: list[Ticket] = []
        self._handle: asyncio.TimerHandle | None = None
        self._batch_s = ESTIMATE_BATCH_S

    def retry_after_s(self) -> int:
        """When a place is expected to free: when the GPU's current work is expected to end."""
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(self.busy_s()))))

    def refusal_of(self, ticket: Ticket) -> Refusal:
        """The answer for a ticket that left without a grant it could use (expired, shut down,
        released while its evictions ran), with when to come back."""
        outcome = ticket.outcome
        if outcome is Outcome.EXPIRED:
            return Refusal(outcome, self.retry_after_s(), max_wait_s=self._scheduler.policy.max_wait_s)
        if outcome is Outcome.SHUTDOWN:
            return Refusal(outcome, SHUTDOWN_RETRY_AFTER_S)
        return Refusal(outcome or Outcome.INTERNAL_ERROR)

    def busy_s(self) -> float:
        """How long until some GPU is expected to take the next grant: the soonest over the GPUs
        of when each can. One that takes work now (`dispatch.takes_nothing`, the rule's one
        measure: a settle of one of its models leaves the others to serve) can at once; one that
        takes nothing, once its settle ends (nothing is granted there meanwhile, free slot or not)
        and, when what runs there leaves no place for another request (`dispatch.full`: every
        slot taken and no room to load beside it), once the first of its running grants ends
        (with one slot, the grant's)."""
        now = self._clock.now_ns()
        times = self.gpu_times()  # (the running grants' ends read only if some GPU is full)
        soonest = math.inf
        for gpu in self._scheduler.holdings():
            if not takes_nothing(gpu):
                return 0.0
            busy = self.settle_left_s(gpu.name, now)
            if full(gpu):
                busy = max(busy, times.soonest_end_s(gpu.name))
            soonest = min(soonest, busy)
        return soonest if math.isfinite(soonest) else 0.0

    def gpu_times(self) -> NodeTimes:
        """What the node rule may know of time now (`dispatch.GpuTimes`): the times the
        estimates walk from (`NodeTimes`: each running grant's end after the ready time its grant
        set), over what runs on each GPU; read once, when the rule first asks."""
        return NodeTimes.of_grants(lambda: self._scheduler.running_grants, self._clock.now_ns(), self._estimator)

    def settle_left_s(self, gpu: str, now_ns: int) -> float:
        """How much longer the generation a GPU's settle waits for is expected to run, by that
        GPU's figures (0 without a settle, or one of no known grant: a startup's)."""
        settling = self._gpus.named(gpu).settling if self._gpus is not None else None
        if settling is None or settling.granted_ns is None:
            return 0.0
        # (A settle follows a generation whose load, if any, is over: ready at once.)
        end_s = expected_end_s(self._estimator, self._schedule_model(settling.model), gpu=gpu)
        return left_s(end_s, (now_ns - settling.granted_ns) / NS_PER_S) or 0.0

    def blocked_by_gpu(self) -> dict[str, float]:
        """How much longer work the scheduler did not grant holds each GPU that has some (a
        settling generation's expected rest, `settle_left_s`; `math.inf` once it is past its
        expected end, or for an adopted exchange: held for a time nobody can tell)."""
        now = self._clock.now_ns()
        blocked: dict[str, float] = {}
        for held in self._scheduler.holdings():
            if held.blocked or held.settling_model is not None:  # (several resident: that model only)
                left = self.settle_left_s(held.name, now)
                blocked[held.name] = left if left > 0 else math.inf
        return blocked

    def estimate_later(self, ticket: Ticket) -> None:
        """Record `ticket`'s estimated wait soon, in one walk with the other arrivals of the batch."""
        self._pending.append(ticket)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self._batch_s, self._estimate)

    def _estimate(self) -> None:
        self._handle = None
        pending, self._pending = self._pending, []
        waiting = [t for t in pending if t.state is TicketState.WAITING]
        if not waiting or self.views is None:
            return
        snapshot, starts = self.views.walk(fresh=True)
        start_of = {view.request_id: start for view, start in zip(snapshot.waiting, starts)}
        now = self._clock.now_ns()
        for ticket in waiting:
            start = start_of.get(ticket.token)
            if start is not None and math.isfinite(start):  # inf: unknown, no estimate to record
                ticket.estimated_wait_s = (now - ticket.arrival_ns) / NS_PER_S + start
        self._batch_s = max(ESTIMATE_BATCH_S, self.views.last_walk_s / _ESTIMATE_CPU_SHARE)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

