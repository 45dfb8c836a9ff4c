"""The settle loop: after an abandoned generation (or at startup) the GPU is not free until the
upstream computes nothing beyond what this process holds (its running grants and adopted
exchanges), or a deadline passes. With upstream.abandonedGeneration: stop the generation is
stopped first (router mode: its model unloaded), but never while generations we hold still run
beside it: stopping would cut them too."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from llamaswap.core import NS_PER_S, Clock
from llamaswap.runtime.observer import Settle, SettleReason, SettleResult
from llamaswap.runtime.upstream import Upstream

_log = logging.getLogger(__name__)

# How often the upstream is asked whether it is still busy, while it settles: every
# SETTLE_POLL_FIRST_S for the first SETTLE_POLL_STEADY_S (a stopped line, or a streamed client that
# left, lets go within a token or two, and with several slots two answers one poll apart end the
# settle of a client that left: a backoff there would make a person who waits for it wait), then
# backing off to SETTLE_POLL_MAX_S (a generation abandoned unstreamed runs to its end).
SETTLE_POLL_FIRST_S = 0.02
SETTLE_POLL_STEADY_S = 0.5
SETTLE_POLL_MAX_S = 0.25


@dataclasses.dataclass(slots=True)
class Settling:
    """A settle under way: why, for which model and request, and since when."""

    reason: SettleReason
    model: str | None
    request_id: str
    granted_ns: int | None
    started_ns: int
    # Every generation it waits for is a stopped line's, which lets go at its next token: one answer
    # within what this process holds ends it (a held generation that ended unseen makes that answer
    # wrong by at most the line's next token, which the next grant then waits for at the upstream),
    # and nothing is stopped (unloading would cost a reload for a token). An abandoned generation
    # covered later may run on: from then on it takes two answers, and `stop` applies again
    # (`settle_upstream`).
    lets_go_at_token: bool = False
    task: asyncio.Task[None] | None = None

    def deadline_ns(self, settle_timeout_s: float, max_run_s: float) -> int:
        """upstream.settleTimeoutSeconds from its start; an abandoned grant's wait is also
        bounded by what is left of routing.scheduler.maxRunSeconds."""
        deadline_s = settle_timeout_s
        if max_run_s > 0 and self.granted_ns is not None:
            deadline_s = min(deadline_s, max(0.0, max_run_s - (self.started_ns - self.granted_ns) / NS_PER_S))
        return self.started_ns + round(deadline_s * NS_PER_S)


async def settle_upstream(upstream: Upstream, settling: Settling, *, stop: bool, clock: Clock, deadline_ns: int,
                          residents: Callable[[], Awaitable[frozenset[str]]] | None = None,
                          unloaded: Callable[[], None] | None = None, blind_until_ns: int | None = None,
                          known_running: Callable[[], int] | None = None) -> Settle:
    """Wait until the upstream computes no more generations than `known_running()` counts, with a
    deadline; what happened, as a Settle.

    An upstream that did not answer this time (`UpstreamUnanswered`, any error) is asked again
    until the deadline: only "idle", "cannot tell, ever" or the deadline end the wait. With `stop`
    the generation is stopped only once the upstream says it is still busy (a streamed client
    that left has already stopped its own; unloading costs a reload), and never while it waits
    for stopped lines only (`Settling.lets_go_at_token`). `residents` (at startup)
    finds which model to ask about (the one the upstream has loaded; with several loaded, every
    one: no model named); an abandoned generation's settle asks about its own model only (with
    several resident, each runs in a process of its own);
    `unloaded` hears that the generation was stopped (nothing is loaded any more); with
    `blind_until_ns`, an upstream that cannot tell holds the GPU until then (at startup: until
    Envoy's periodic entry would have revealed a running exchange).
    `known_running` counts the generations this process knows to run beside the abandoned one (its
    running grants and adopted exchanges, with several slots): the settle is over once the
    processing slots are no more than those in two answers one poll apart (or none compute; or in
    one answer where only stopped lines are waited for: `Settling.lets_go_at_token`), so the
    abandoned generation no longer takes one of the slots (/slots does not say which slot computes
    what, so a count is what can be told, and a held generation that ended at the upstream is
    counted until its end reaches this process).
    Stopping waits until `known_running` is 0, because unloading the model, or cancelling every slot,
    would cut them as well (an adopted exchange is known to be alive); until then the settle only
    waits."""
    model = settling.model
    result = SettleResult.UNANSWERED
    stopped = tried_stop = told_waiting = seen_within_known = False
    delay = SETTLE_POLL_FIRST_S
    steady_until_ns = clock.now_ns() + round(SETTLE_POLL_STEADY_S * NS_PER_S)
    while True:
        try:
            if residents is not None:
                model = _one_of(await residents())
                residents = None
            processing = await upstream.busy(model)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no answer this time: ask again until the deadline
            _log.info("the upstream did not say whether it is idle (%s); asking again", exc)
        else:
            if processing is None:
                result = SettleResult.UNSUPPORTED
                break
            beside = known_running() if known_running is not None else 0
            within_known = processing <= beside
            if within_known and (processing == 0 or seen_within_known or settling.lets_go_at_token):
                result = SettleResult.STOPPED if stopped else SettleResult.IDLE
                break
            # A count within what we hold may still be the abandoned one: a held generation that
            # just ended at the upstream is counted until its exchange's end reaches us, a little
            # later. Only a second answer, one poll later, tells (the deadline takes this one's word).
            seen_within_known = within_known
            if within_known:
                result = SettleResult.STOPPED if stopped else SettleResult.IDLE
            else:
                result = SettleResult.TIMEOUT  # it answered busy: a deadline now cuts a known generation
                may_stop = stop and not settling.lets_go_at_token  # (read each time: a join changes it)
                if may_stop and not tried_stop and beside == 0:
                    tried_stop = True
                    stopped = await _stop(upstream, model)
                    if stopped and unloaded is not None:
                        unloaded()
                    continue  # ask at once whether stopping it made it idle
                if may_stop and beside and not told_waiting:
                    told_waiting = True
                    _log.info("not stopping the abandoned generation of %s (request %s) yet: %d generation(s) "
                              "this sidecar holds run beside it; stopping once they end", model or "-",
                              settling.request_id, beside)
        if clock.now_ns() >= deadline_ns:
            break
        await asyncio.sleep(delay)
        if clock.now_ns() >= steady_until_ns:
            delay = min(delay * 2, SETTLE_POLL_MAX_S)
    if result is SettleResult.UNSUPPORTED and blind_until_ns is not None and clock.now_ns() < blind_until_ns:
        await asyncio.sleep((blind_until_ns - clock.now_ns()) / NS_PER_S)
    settle = Settle(settling.reason, result, model, settling.request_id, settling.started_ns, clock.now_ns())
    level = logging.WARNING if result in (SettleResult.TIMEOUT, SettleResult.UNANSWERED) else logging.INFO
    _log.log(level, "upstream settle after %s (request %s, model %s): %s in %.3f s", settle.reason,
             settle.request_id, model or "-", result, settle.seconds)
    return settle


def _one_of(models: frozenset[str]) -> str | None:
    """The model a startup settle asks about: the one loaded; None (all of them) with several or none."""
    return next(iter(models)) if len(models) == 1 else None


async def _stop(upstream: Upstream, model: str | None) -> bool:
    try:
        return await upstream.stop(model)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a failed stop still waits for idle
        _log.exception("stopping the abandoned generation failed")
        return False
