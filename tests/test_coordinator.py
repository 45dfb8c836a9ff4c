"""The runtime's promises, on a real Coordinator driven like Envoy drives it (tests/flow.py).

Time is virtual: the coordinator's clock and the event loop's timers are one ManualClock, so
leases, the watchdog, maxWaitSeconds, settles and estimate batches fire exactly when the test
moves the clock, and never on their own.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable

import pytest
from flow import STATED_SWAP_S, PEER, FakeUpstream, Flow, Request, router, single, virtual_time, with_stated_swap
from llamaswap.adapters.admin import queue_document
from llamaswap.commands.queue import render
from llamaswap.config import parse_config
from llamaswap.core import SHUTDOWN_RETRY_AFTER_S, Band, ManualClock, Outcome, ReorderCause, Scheduler
from llamaswap.runtime.coordinator import RETRY_AFTER_MAX_S, Coordinator, Refusal
from llamaswap.runtime.settle import SETTLE_POLL_FIRST_S, SETTLE_POLL_MAX_S, SETTLE_POLL_STEADY_S
from llamaswap.runtime.views import RunningRow, WaitingRow
from llamaswap.runtime.observer import SettleReason, SettleResult
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, Ticket, TicketState, Tokens
from llamaswap.runtime.upstream import Catalog, UpstreamKind

S = 1_000_000_000
OTHER_PEER = "ipv4:127.0.0.1:40002"  # another Envoy connection (another worker, or another Envoy)
# Defaults of the configuration the numbers below rely on (asserted in test_the_defaults_used_here).
LEASE_S = 3.0
RUN_S = 10.0
SWAP_S = STATED_SWAP_S  # the Flow's, not the product's default
LONG_LEASE = {"envoy": {"leaseSeconds": 1000}}  # for scenarios longer than a lease without renewals
FINISHED_MEMORY_ON_MAIN = 4096  # how many finished grants the sidecar used to remember, and no more


def test_the_defaults_used_here() -> None:
    config = parse_config({})
    assert config.envoy.lease_seconds == LEASE_S
    assert config.estimates.default_run_seconds == RUN_S
    assert parse_config(with_stated_swap({})).estimates.default_swap_seconds == SWAP_S
    assert config.upstream.model_check.value == "auto"
    assert config.upstream.abandoned_generation.value == "wait"


def busy_flow(config: dict | None = None, **upstream: object) -> Flow:
    return Flow(config, upstream=FakeUpstream(**upstream))  # type: ignore[arg-type]


# -- grants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@virtual_time
async def test_grant_order_matches_the_core(seed: int) -> None:
    """The same arrivals and releases through a bare Scheduler grant in the same order, with
    the same decisions."""
    rng = random.Random(seed)
    headers = ["interactive", "normal", "batch", "-20", "7", "60", None, "junk", "150"]
    models = ["a", "b", "c", None]
    arrivals = [(round(i * 0.7 * S), f"r{i}", rng.choice(headers), rng.choice(models)) for i in range(40)]
    durations = {name: rng.choice([300, 1100, 2000, 3300, 4700]) * 1_000_000 for _, name, _, _ in arrivals}
    config = {"envoy": {"leaseSeconds": 100}, "routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 2}}}}}

    flow = Flow(config)
    start = flow.now_ns
    policy = flow.config.priority_policy()
    core_clock = ManualClock(start)
    core = Scheduler(flow.config.policy(), core_clock)
    expected = []

    def core_next() -> None:
        decision = core.next()
        if decision is not None:
            expected.append(decision)

    # Driven by the flow's state; the same steps go to the core. Ends come before arrivals at
    # the same instant, in both.
    pending = list(arrivals)
    while True:
        running = [t for t, _ in flow.recorder.grants if t.outcome is None]
        end_at = running[0].decision.granted_ns + durations[running[0].request_id] if running else None
        arrive_at = start + pending[0][0] if pending else None
        if end_at is None and arrive_at is None:
            break
        if end_at is not None and (arrive_at is None or end_at <= arrive_at):
            await flow.advance_to(end_at)
            core_clock.set_ns(end_at)
            await flow.complete(flow.requests[running[0].request_id])
            earliest = next(core.running_ids(), None)
            if earliest is not None:
                core.release(earliest)
            core_next()
        else:
            _, name, header, model = pending.pop(0)
            await flow.advance_to(arrive_at)
            core_clock.set_ns(arrive_at)
            await flow.arrive(name, header, model)
            core.enqueue(name, policy.resolve(header), model)
            core_next()

    assert flow.recorder.grant_order() == [d.request_id for d in expected]
    assert flow.recorder.most_holders == 1

    def fields(decision):  # everything but the id (a ticket token in the coordinator)
        return (decision.priority, decision.band, decision.score, decision.arrival_ns, decision.granted_ns,
                decision.model, decision.swap_affinity, decision.aging, decision.load, decision.swap,
                decision.residents_before, decision.reordered_by, decision.queue_depth_after)

    assert [fields(t.decision) for t, _ in flow.recorder.grants] == [fields(d) for d in expected]
    assert set(flow.recorder.outcomes().values()) == {Outcome.SERVED}
    # The scripted mix exercised both reorder causes.
    causes = set().union(*(d.reordered_by for d in expected))
    assert causes == {ReorderCause.AGING, ReorderCause.SWAP_AFFINITY}


@virtual_time
async def test_one_grant_at_a_time() -> None:
    flow = Flow()
    first = await flow.arrive("first", "batch", "a")
    others = [await flow.arrive(f"r{i}", "interactive", "a") for i in range(5)]
    assert first.granted
    assert [r.waiting for r in others] == [True] * 5
    assert flow.coordinator.gpu_state == "running"
    assert flow.running_id() == "first"
    for expected in ["first", "r0", "r1", "r2", "r3"]:
        await flow.complete(flow.requests[expected])
        assert sum(r.granted and r.outcome is None for r in flow.requests.values()) == 1
    assert flow.recorder.most_holders == 1
    assert flow.recorder.grant_order() == ["first", "r0", "r1", "r2", "r3", "r4"]


@virtual_time
async def test_the_ticket_state_machine() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="m")
    b = await flow.arrive("b", model="m")
    t = b.ticket
    # Granted in its own admission's pass (a free GPU): answered without a future to wait on.
    assert a.granted and a.ticket.state is TicketState.RUNNING and a.ticket.waiter is None
    assert t.state is TicketState.WAITING and t.decision is None and t.outcome is None and t.finished_ns is None
    assert t.arrival_ns == flow.now_ns and t.queue_depth_at_arrival == 0  # nothing waited when b came
    await flow.advance(1.5)
    await flow.complete(a)
    assert b.granted and b.ticket is t
    assert t.state is TicketState.RUNNING and t.outcome is None
    assert t.waiter is not None and t.waiter.result() is t.decision  # it waited: its grant came through it
    assert t.decision is not None and t.decision.granted_ns == flow.now_ns
    assert t.decision.queue_wait_ns == round(1.5 * S)
    assert t.lease_deadline_ns == flow.now_ns + round(LEASE_S * S)
    await flow.advance(2)
    await flow.complete(b, 201, first_byte_s=0.25)
    assert t.state is TicketState.DONE and t.outcome is Outcome.SERVED
    assert t.finished_ns == flow.now_ns and t.response_status == 201 and t.first_byte_s == 0.25
    assert t.end is ExchangeEnd.COMPLETE and not t.abandoned
    # Done is final: later entries about it change nothing.
    await flow.end(b, ExchangeEnd.UPSTREAM_FAILED, 502)
    await flow.renew(b)
    assert t.state is TicketState.DONE and t.outcome is Outcome.SERVED and t.response_status == 201
    assert flow.coordinator.live_tickets() == 0
    assert flow.coordinator.gpu_state == "idle"


# -- every way a ticket ends, each exactly once -----------------------------------------------


class RaisesOnEnqueue:
    """A broken observer: an internal error in the middle of admitting `victim`."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: None

    def enqueued(self, ticket: Ticket) -> None:
        if ticket.request_id == self.victim:
            raise RuntimeError("observer failed")


Scenario = Callable[[Flow], Awaitable[Request]]


async def refused_full(flow: Flow) -> Request:
    await flow.arrive("blocker", model="a")
    await flow.arrive("queued", model="a")
    return await flow.arrive("it", model="a")


async def unknown_model(flow: Flow) -> Request:
    flow.upstream.catalog_answer = router("a")
    return await flow.arrive("it", model="zzz")


async def cancelled_waiting(flow: Flow) -> Request:
    await flow.arrive("blocker", model="a")
    it = await flow.arrive("it", model="a")
    await flow.advance(1)
    await flow.cancel(it)
    return it


async def expired(flow: Flow) -> Request:
    await flow.arrive("blocker", model="a")
    it = await flow.arrive("it", model="a")
    await flow.advance(2)
    return it


async def shutdown_waiting(flow: Flow) -> Request:
    await flow.arrive("blocker", model="a")
    it = await flow.arrive("it", model="a")
    flow.coordinator.stop_admitting()
    await flow.idle()
    return it


async def shutdown_arriving(flow: Flow) -> Request:
    flow.coordinator.stop_admitting()
    return await flow.arrive("it", model="a")


async def shutdown_running(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    flow.coordinator.stop_admitting()
    flow.coordinator.abandon_running()
    await flow.idle()
    return it


async def served(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.complete(it)
    return it


async def upstream_error(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.complete(it, 500)
    return it


async def cancelled_running(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.end(it, ExchangeEnd.CLIENT_LEFT)
    return it


async def watchdog(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.advance(2)
    await flow.renew(it)  # the lease holds; maxRunSeconds does not
    await flow.advance(2)
    return it


async def lease_expired(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.advance(LEASE_S)
    return it


async def proxy_gone(flow: Flow) -> Request:
    it = await flow.arrive("it", model="a")
    await flow.peer_gone(PEER)
    return it


async def internal_error(flow: Flow) -> Request:
    return await flow.arrive("it", model="a")  # with RaisesOnEnqueue("it")


ENDINGS: list[tuple[Scenario, Outcome]] = [
    (refused_full, Outcome.REJECTED_FULL),
    (unknown_model, Outcome.REJECTED_UNKNOWN_MODEL),
    (cancelled_waiting, Outcome.CANCELLED_WAITING),
    (expired, Outcome.EXPIRED),
    (shutdown_waiting, Outcome.SHUTDOWN),
    (shutdown_arriving, Outcome.SHUTDOWN),
    (shutdown_running, Outcome.SHUTDOWN),
    (served, Outcome.SERVED),
    (upstream_error, Outcome.UPSTREAM_ERROR),
    (cancelled_running, Outcome.CANCELLED_RUNNING),
    (watchdog, Outcome.WATCHDOG),
    (lease_expired, Outcome.LEASE_EXPIRED),
    (proxy_gone, Outcome.PROXY_GONE),
    (internal_error, Outcome.INTERNAL_ERROR),
]


@pytest.mark.parametrize(("scenario", "outcome"), ENDINGS, ids=[s.__name__ for s, _ in ENDINGS])
@virtual_time
async def test_finished_exactly_once_however_it_ends(scenario: Scenario, outcome: Outcome) -> None:
    # lease 3 s (the default) < maxRunSeconds 4 s; maxWaitSeconds 2 s < the lease.
    config = {"routing": {"scheduler": {"maxQueued": 1, "maxWaitSeconds": 2, "maxRunSeconds": 4}}}
    observers = [RaisesOnEnqueue("it")] if scenario is internal_error else []
    flow = Flow(config, observers=observers)
    it = await scenario(flow)
    ticket = it.ticket
    assert ticket.outcome is outcome
    assert ticket.state is TicketState.DONE
    assert flow.recorder.times_finished(ticket) == 1
    finished_ns = ticket.finished_ns

    # First finish wins: everything that could end it again changes nothing.
    if not it.task.done():
        await flow.cancel(it)
    await flow.end(ticket.token, ExchangeEnd.UPSTREAM_FAILED, 502)
    if ticket.decision is not None and outcome is not Outcome.LEASE_EXPIRED and outcome is not Outcome.PROXY_GONE:
        await flow.renew(ticket.token)  # its exchange reported late (those two would be adopted again)
    await flow.peer_gone(PEER)
    assert flow.coordinator._grants.finish(ticket, Outcome.INTERNAL_ERROR, flow.now_ns) is False
    await flow.advance(30)
    assert ticket.outcome is outcome and ticket.finished_ns == finished_ns
    assert flow.recorder.times_finished(ticket) == 1
    # Every ticket the coordinator ever showed finished exactly once, and none is left.
    for request in flow.requests.values():
        if request.task.done() and not request.task.cancelled() and request.granted and request.outcome is None:
            await flow.complete(request)
    await flow.advance(30)
    seen = {id(t): t for name, t in flow.recorder.events if name in ("enqueued", "finished")}
    assert seen and all(flow.recorder.times_finished(t) == 1 for t in seen.values())
    assert flow.coordinator.live_tickets() == 0
    assert flow.coordinator.gpu_state == "idle"


@virtual_time
async def test_an_internal_error_while_admitting_leaves_nothing_behind() -> None:
    flow = Flow(observers=[RaisesOnEnqueue("boom")])
    a = await flow.arrive("a", model="a")
    boom = await flow.arrive("boom", model="a")
    after = await flow.arrive("after", model="a")
    assert isinstance(boom.task.exception(), RuntimeError)  # the servicer answers 500
    assert boom.ticket.outcome is Outcome.INTERNAL_ERROR
    assert flow.recorder.times_finished(boom.ticket) == 1
    assert flow.waiting_ids() == ["after"]
    await flow.complete(a)
    assert after.granted  # not held up by a queued ghost
    assert flow.recorder.grant_order() == ["a", "after"]


class RaisesOnDispatch(RaisesOnEnqueue):
    def enqueued(self, ticket: Ticket) -> None:
        pass

    def dispatched(self, ticket: Ticket, overtaken: object) -> None:
        if ticket.request_id == self.victim:
            raise RuntimeError("observer failed")


@virtual_time
async def test_an_internal_error_as_it_is_granted_frees_the_gpu() -> None:
    flow = Flow(observers=[RaisesOnDispatch("boom")])
    warm = await flow.arrive("warm", model="a")
    await flow.complete(warm)
    boom = await flow.arrive("boom", model="b")  # granted at once, and admission fails
    assert isinstance(boom.task.exception(), RuntimeError)
    assert boom.ticket.outcome is Outcome.INTERNAL_ERROR and not boom.ticket.abandoned
    assert flow.coordinator.gpu_state == "idle"
    after = await flow.arrive("after", model="a")
    assert after.granted and not after.ticket.decision.load  # b never reached the upstream


# -- outcomes from the access log --------------------------------------------------------------

REPORTS = [
    (ExchangeEnd.COMPLETE, 200, Outcome.SERVED, True),
    (ExchangeEnd.COMPLETE, 399, Outcome.SERVED, True),
    # A refusal (a prompt too long, an unknown path) says nothing about the loaded model.
    (ExchangeEnd.COMPLETE, 400, Outcome.SERVED, True),
    (ExchangeEnd.COMPLETE, 499, Outcome.SERVED, True),
    (ExchangeEnd.COMPLETE, 500, Outcome.UPSTREAM_ERROR, False),
    (ExchangeEnd.COMPLETE, 503, Outcome.UPSTREAM_ERROR, False),
    (ExchangeEnd.CLIENT_LEFT, 200, Outcome.CANCELLED_RUNNING, True),  # it was still generating for it
    (ExchangeEnd.UPSTREAM_FAILED, 200, Outcome.UPSTREAM_ERROR, False),
    (ExchangeEnd.NOT_SENT, 503, Outcome.UPSTREAM_ERROR, False),
    (None, 200, Outcome.UPSTREAM_ERROR, False),  # a final entry without an end counts as failed
]


@pytest.mark.parametrize(("end", "status", "outcome", "stays_loaded"), REPORTS)
@virtual_time
async def test_outcome_from_the_final_report(end: ExchangeEnd | None, status: int, outcome: Outcome,
                                             stays_loaded: bool) -> None:
    flow = Flow()
    warm = await flow.arrive("warm", model="a")
    assert warm.ticket.decision.load
    await flow.complete(warm)
    it = await flow.arrive("it", model="a")
    assert not it.ticket.decision.load and not it.ticket.decision.swap  # model a is loaded
    await flow.report(it, ExchangeReport(final=True, end=end, status=status, first_byte_s=None))
    assert it.outcome is outcome
    assert it.ticket.response_status == status
    assert it.ticket.abandoned is (end in (ExchangeEnd.CLIENT_LEFT, ExchangeEnd.UPSTREAM_FAILED, None))
    assert flow.coordinator.view().resident_models == (("a",) if stays_loaded else ())
    after = await flow.arrive("after", model="a")
    assert after.granted
    assert after.ticket.decision.load is (not stays_loaded)
    assert after.ticket.decision.swap is False


@virtual_time
async def test_served_requests_teach_the_estimator_and_failures_do_not() -> None:
    flow = Flow(LONG_LEASE)
    a = await flow.arrive("a", model="a")
    await flow.advance(4)
    await flow.complete(a, 500)
    assert flow.coordinator.estimator.expected_run_s("a") == RUN_S
    b = await flow.arrive("b", model="a")
    await flow.advance(7)
    await flow.complete(b, 200, first_byte_s=1.0)
    # b loaded its model (the failure forgot it): its 7 s minus the swap cost, now measured by
    # its own first byte (1 s; no warm first byte yet).
    assert flow.coordinator.estimator.expected_swap_s("a") == 1.0
    assert flow.coordinator.estimator.expected_run_s("a") == 6.0
    c = await flow.arrive("c", model="a")
    assert not c.ticket.decision.load
    await flow.advance(3)
    await flow.complete(c, 200, first_byte_s=0.25)
    assert flow.coordinator.estimator.expected_run_s("a") == (6 + 3) / 2
    assert flow.coordinator.estimator.expected_swap_s("a") == 1.0 - 0.25


# -- settles -----------------------------------------------------------------------------------


async def abandon_by_client_left(flow: Flow, request: Request) -> None:
    await flow.end(request, ExchangeEnd.CLIENT_LEFT, 0)


async def abandon_by_upstream_failed(flow: Flow, request: Request) -> None:
    await flow.end(request, ExchangeEnd.UPSTREAM_FAILED, 200)


async def abandon_by_lease(flow: Flow, request: Request) -> None:
    await flow.advance(LEASE_S)


async def abandon_by_proxy_gone(flow: Flow, request: Request) -> None:
    await flow.peer_gone(PEER)


ABANDONS = [(abandon_by_client_left, Outcome.CANCELLED_RUNNING),
            (abandon_by_upstream_failed, Outcome.UPSTREAM_ERROR),
            (abandon_by_lease, Outcome.LEASE_EXPIRED),
            (abandon_by_proxy_gone, Outcome.PROXY_GONE)]


@pytest.mark.parametrize(("abandon", "outcome"), ABANDONS, ids=[a.__name__ for a, _ in ABANDONS])
@virtual_time
async def test_no_grant_until_the_upstream_is_idle(abandon, outcome: Outcome) -> None:
    flow = busy_flow(busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="b", peer=OTHER_PEER)  # a connection that stays (another Envoy worker)
    await abandon(flow, a)
    assert a.outcome is outcome and a.ticket.abandoned
    started_ns = flow.now_ns
    assert flow.coordinator.gpu_state == "settling"
    await flow.advance(20)
    assert b.waiting and flow.coordinator.gpu_state == "settling"
    assert flow.upstream.busy_calls and set(flow.upstream.busy_calls) == {"a"}
    assert flow.upstream.stop_calls == []  # abandonedGeneration: wait
    flow.upstream.busy_answer = False
    idle_from = flow.now_ns
    await flow.advance(SETTLE_POLL_MAX_S)
    assert b.granted
    [settle] = flow.recorder.settles
    assert (settle.reason, settle.result, settle.model, settle.request_id) == (
        SettleReason.ABANDONED, SettleResult.IDLE, "a", "a")
    assert settle.started_ns == started_ns
    assert idle_from <= settle.ended_ns <= idle_from + round(SETTLE_POLL_MAX_S * S)
    assert b.ticket.decision.granted_ns == settle.ended_ns
    assert flow.coordinator.gpu_state == "running"
    # The settle was reported after the abandoned ticket's end.
    names = [name for name, _ in flow.recorder.events]
    assert names.index("settled") > names.index("finished")


@virtual_time
async def test_a_settle_ends_at_once_when_the_upstream_cannot_tell() -> None:
    flow = busy_flow(busy=None)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.advance(1)
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    assert b.granted
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.UNSUPPORTED and settle.seconds == 0
    assert flow.upstream.busy_calls == ["a"]
    assert b.ticket.decision.granted_ns == a.ticket.finished_ns


@virtual_time
async def test_a_settle_asks_every_first_interval_at_first_then_backs_off() -> None:
    """An upstream that lets go within its first SETTLE_POLL_STEADY_S (a stopped line, a streamed
    client that left: the next token) is seen idle within one SETTLE_POLL_FIRST_S, not at a
    backed-off ask; a longer one is asked less and less often."""
    flow = busy_flow(LONG_LEASE, busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(0.19)
    steady_calls = len(flow.upstream.busy_calls)
    assert b.waiting and steady_calls >= round(0.19 / SETTLE_POLL_FIRST_S)  # (doubling: 3 asks by then)
    flow.upstream.busy_answer = False
    idle_from = flow.now_ns
    await flow.advance(SETTLE_POLL_FIRST_S)
    assert b.granted
    [settle] = flow.recorder.settles
    assert idle_from <= settle.ended_ns <= idle_from + round(SETTLE_POLL_FIRST_S * S)
    # Past the steady window, the asks back off (to SETTLE_POLL_MAX_S apart).
    flow.upstream.busy_answer = True
    c = await flow.arrive("c", model="a")
    await flow.end(b, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(SETTLE_POLL_STEADY_S + 0.01)
    before = len(flow.upstream.busy_calls)
    await flow.advance(5 * SETTLE_POLL_MAX_S)
    assert c.waiting and len(flow.upstream.busy_calls) - before <= 6


@virtual_time
async def test_a_settle_keeps_asking_an_upstream_that_does_not_answer() -> None:
    """No answer (a timeout, a refused connection, a 5xx) is not "no /slots": ask again."""
    flow = busy_flow(LONG_LEASE, busy=False)
    # Past the steady polls (every SETTLE_POLL_FIRST_S for SETTLE_POLL_STEADY_S), into the backoff.
    failures = round(SETTLE_POLL_STEADY_S / SETTLE_POLL_FIRST_S) + 5
    flow.upstream.busy_failures = failures
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    started = flow.now_ns
    await flow.advance(0.5)
    assert b.waiting and flow.coordinator.gpu_state == "settling"
    await flow.advance(5)
    assert b.granted
    assert flow.upstream.busy_calls == ["a"] * (failures + 1)  # without an answer, then "idle"
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.IDLE and settle.ended_ns > started + round(0.5 * S)
    assert b.ticket.decision.granted_ns == settle.ended_ns


@virtual_time
async def test_a_settle_that_never_gets_an_answer_ends_at_its_deadline() -> None:
    upstream = FakeUpstream(busy=True)

    async def broken(model: str | None) -> bool | None:
        upstream.calls.append(("busy", model))
        raise ConnectionError("GET /slots failed")

    upstream.busy = broken  # type: ignore[method-assign]
    flow = Flow({"upstream": {"settleTimeoutSeconds": 2}}, upstream=upstream)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    started = flow.now_ns
    await flow.advance(1.99)
    assert b.waiting and len(upstream.busy_calls) > 3
    await flow.advance(SETTLE_POLL_MAX_S + 0.01)
    assert b.granted  # the queue goes on at the deadline
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.UNANSWERED
    assert started + 2 * S <= settle.ended_ns <= started + round((2 + SETTLE_POLL_MAX_S) * S)


@virtual_time
async def test_a_settle_times_out_at_settle_timeout_seconds() -> None:
    flow = busy_flow({"upstream": {"settleTimeoutSeconds": 2}}, busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    started = flow.now_ns
    await flow.advance(1.99)
    assert b.waiting
    await flow.advance(SETTLE_POLL_MAX_S + 0.01)
    assert b.granted
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.TIMEOUT
    assert started + 2 * S <= settle.ended_ns <= started + round((2 + SETTLE_POLL_MAX_S) * S)


@pytest.mark.parametrize("ran_s", [8.0, 9.75])
@virtual_time
async def test_a_settle_is_bounded_by_max_run_seconds_since_the_grant(ran_s: float) -> None:
    flow = busy_flow({"routing": {"scheduler": {"maxRunSeconds": 10}}, "envoy": {"leaseSeconds": 100}}, busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    granted = flow.now_ns
    await flow.advance(ran_s)
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(10 - ran_s - 0.01)
    assert b.waiting
    await flow.advance(SETTLE_POLL_MAX_S + 0.01)
    assert b.granted
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.TIMEOUT
    assert granted + 10 * S <= settle.ended_ns <= granted + round((10 + SETTLE_POLL_MAX_S) * S)


@virtual_time
async def test_abandoned_generation_stop_stops_first_and_forgets_the_model() -> None:
    flow = busy_flow({"upstream": {"abandonedGeneration": "stop"}}, busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a", peer=OTHER_PEER)
    await flow.peer_gone(PEER)  # a release that otherwise keeps its model loaded
    assert a.outcome is Outcome.PROXY_GONE
    settle_calls = [call for call in flow.upstream.calls if call[0] != "catalog"]
    assert settle_calls == [("busy", "a"), ("stop", "a"), ("busy", "a")]  # stopped because still busy
    assert b.granted
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.STOPPED
    assert b.ticket.decision.load and b.ticket.decision.residents_before == frozenset()


@virtual_time
async def test_a_stop_that_fails_still_waits_for_idle() -> None:
    flow = busy_flow({"upstream": {"abandonedGeneration": "stop"}}, busy=True, stops=False)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(3)
    assert b.waiting and flow.upstream.stop_calls == ["a"]
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert b.granted and flow.recorder.settles[0].result is SettleResult.IDLE


@virtual_time
async def test_abandoned_generation_stop_stops_nothing_that_already_ended() -> None:
    """A streamed client that left has stopped its generation itself: unloading would only cost a reload."""
    flow = busy_flow({"upstream": {"abandonedGeneration": "stop"}}, busy=False)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    assert b.granted
    assert flow.upstream.stop_calls == [] and flow.upstream.busy_calls == ["a"]
    assert flow.recorder.settles[0].result is SettleResult.IDLE
    assert not b.ticket.decision.load  # still loaded


@virtual_time
async def test_abandoned_generation_stop_waits_for_an_answer_before_stopping() -> None:
    flow = busy_flow({"upstream": {"abandonedGeneration": "stop"}}, busy=True)
    flow.upstream.busy_failures = 2
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(1)
    assert b.granted
    settle_calls = [call for call in flow.upstream.calls if call[0] != "catalog"]
    assert settle_calls == [("busy", "a")] * 3 + [("stop", "a"), ("busy", "a")]
    assert flow.recorder.settles[0].result is SettleResult.STOPPED


@pytest.mark.parametrize("abandoned_generation", ["wait", "stop"])
@virtual_time
async def test_the_watchdog_frees_the_gpu(abandoned_generation: str) -> None:
    config = {"routing": {"scheduler": {"maxRunSeconds": 30}}, "envoy": {"leaseSeconds": 100},
              "upstream": {"abandonedGeneration": abandoned_generation}}
    flow = busy_flow(config, busy=True)
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.advance(29.999)
    assert a.outcome is None
    await flow.advance(0.001)
    assert a.outcome is Outcome.WATCHDOG
    assert a.ticket.finished_ns == a.ticket.decision.granted_ns + 30 * S
    assert flow.recorder.watchdogs == [a.ticket]
    assert b.granted
    if abandoned_generation == "stop":
        assert flow.upstream.stop_calls == ["a"]
        assert flow.recorder.settles[0].result is SettleResult.STOPPED
        assert b.ticket.decision.load  # stopping unloaded it
    else:
        assert flow.upstream.busy_calls == [] and flow.upstream.stop_calls == []  # it goes on in Envoy
        assert flow.recorder.settles == []
        assert not b.ticket.decision.load


@virtual_time
async def test_the_startup_settle_holds_grants_until_idle() -> None:
    flow = busy_flow(busy=True, catalog=router("a", "b", loaded="a"))
    flow.coordinator.begin_startup_settle()
    flow.coordinator.begin_startup_settle()  # once is enough
    await flow.idle()
    assert flow.coordinator.gpu_state == "settling"
    a = await flow.arrive("a", model="a")
    await flow.advance(5)
    assert a.waiting
    assert set(flow.upstream.busy_calls) == {"a"}  # the model the catalog says is loaded
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a.granted
    [settle] = flow.recorder.settles
    assert (settle.reason, settle.result, settle.request_id, settle.model) == (
        SettleReason.STARTUP, SettleResult.IDLE, "-", "a")
    assert not a.ticket.decision.load  # the catalog's loaded model was applied


@virtual_time
async def test_no_startup_settle_without_an_upstream() -> None:
    coordinator = Coordinator(parse_config({}), clock=ManualClock(), observe_after_grant=False)
    coordinator.begin_startup_settle()
    assert coordinator.gpu_state == "idle"
    coordinator.close()


@virtual_time
async def test_the_startup_settle_without_slots_waits_one_access_log_flush() -> None:
    """Nothing can tell whether an earlier process's grant still runs, but Envoy reports a running
    exchange every leaseSeconds/3: the first grant waits that long, and an exchange reported
    meanwhile is adopted and holds the GPU."""
    flow = busy_flow(busy=None)
    flow.coordinator.begin_startup_settle()
    a = await flow.arrive("a", model="a")
    await flow.advance(LEASE_S / 3 - 0.01)
    assert a.waiting and flow.coordinator.gpu_state == "settling"
    await flow.advance(0.01)
    assert a.granted
    [settle] = flow.recorder.settles
    assert settle.result is SettleResult.UNSUPPORTED and settle.ended_ns == settle.started_ns + round(LEASE_S / 3 * S)

    flow = busy_flow(busy=None)
    flow.coordinator.begin_startup_settle()
    b = await flow.arrive("b", model="a")
    await flow.advance(0.5)
    await flow.renew("granted-by-the-earlier-process")
    await flow.advance(LEASE_S / 3)
    assert b.waiting and flow.coordinator.gpu_state == "adopted"
    await flow.end("granted-by-the-earlier-process", ExchangeEnd.COMPLETE, 200)
    assert b.granted


@virtual_time
async def test_the_startup_settle_asks_an_upstream_that_does_not_answer_yet() -> None:
    """A restart while llama-server's main loop is busy with a long prompt: /slots times out."""
    flow = busy_flow(busy=True, catalog=router("a", loaded="a"))
    flow.upstream.busy_failures = 4
    flow.coordinator.begin_startup_settle()
    a = await flow.arrive("a", model="a")
    await flow.advance(10)
    assert a.waiting and len(flow.upstream.busy_calls) > 4  # answered "busy" after the failures
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a.granted and flow.recorder.settles[0].result is SettleResult.IDLE


@virtual_time
async def test_gpu_state_and_wait_idle() -> None:
    flow = busy_flow(busy=True)
    assert flow.coordinator.gpu_state == "idle"
    assert flow.coordinator.view().gpu == "idle"
    done = asyncio.ensure_future(flow.coordinator.wait_idle(100))
    await flow.idle()
    assert done.done() and done.result() is True  # idle already
    assert await flow.coordinator.wait_idle(0) is True  # no grace period at all: idle is still idle

    a = await flow.arrive("a", model="a")
    assert flow.coordinator.gpu_state == "running" == flow.coordinator.view().gpu
    gives_up = asyncio.ensure_future(flow.coordinator.wait_idle(2))
    waits = asyncio.ensure_future(flow.coordinator.wait_idle(100))
    await flow.advance(2)
    assert gives_up.done() and gives_up.result() is False
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    assert flow.coordinator.gpu_state == "settling" == flow.coordinator.view().gpu
    assert not waits.done()
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert flow.coordinator.gpu_state == "idle"
    assert waits.done() and waits.result() is True

    await flow.renew("token-of-an-earlier-sidecar")
    assert flow.coordinator.gpu_state == "adopted" == flow.coordinator.view().gpu
    waits = asyncio.ensure_future(flow.coordinator.wait_idle(100))
    await flow.idle()
    assert not waits.done()
    await flow.end("token-of-an-earlier-sidecar", ExchangeEnd.COMPLETE, 200)
    assert flow.coordinator.gpu_state == "idle"
    assert waits.done() and waits.result() is True


# -- leases ------------------------------------------------------------------------------------


@virtual_time
async def test_periodic_reports_renew_the_lease() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    for _ in range(10):
        await flow.advance(2)
        await flow.renew(a)
    assert a.outcome is None and b.waiting
    last = flow.now_ns
    await flow.advance(LEASE_S - 0.001)
    assert a.outcome is None
    await flow.advance(0.001)
    assert a.outcome is Outcome.LEASE_EXPIRED
    assert a.ticket.finished_ns == last + round(LEASE_S * S)
    assert a.ticket.abandoned and flow.recorder.settles[0].reason is SettleReason.ABANDONED
    assert b.granted  # the fake upstream cannot tell: the settle ended at once


@virtual_time
async def test_peer_gone_releases_only_that_connections_grant() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a", peer="ipv4:10.0.0.1:1")
    b = await flow.arrive("b", model="a", peer="ipv4:10.0.0.2:2")
    c = await flow.arrive("c", model="a", peer="ipv4:10.0.0.3:3")
    await flow.peer_gone("ipv4:10.0.0.2:2")
    assert a.outcome is None and a.granted  # another connection's end leaves this grant alone
    assert b.outcome is Outcome.CANCELLED_WAITING  # its own Check went with its connection
    assert c.waiting and flow.recorder.settles == []
    await flow.peer_gone("ipv4:10.0.0.1:1")
    assert a.outcome is Outcome.PROXY_GONE and a.ticket.abandoned
    assert flow.recorder.settles[0].request_id == "a"
    assert c.granted


# -- adoption ----------------------------------------------------------------------------------


@virtual_time
async def test_an_exchange_granted_by_an_earlier_process_blocks_grants_until_its_end() -> None:
    flow = Flow()
    await flow.end("never-seen", ExchangeEnd.COMPLETE, 200)  # a final entry alone: nothing to adopt
    assert flow.coordinator.gpu_state == "idle"
    await flow.renew("old")
    assert flow.coordinator.gpu_state == "adopted"
    a = await flow.arrive("a", model="a")
    await flow.advance(2)
    await flow.renew("old")
    await flow.advance(2)
    assert a.waiting  # renewed: 4 s after it was first seen, still held
    await flow.end("old", ExchangeEnd.COMPLETE, 200)
    assert a.granted
    assert flow.coordinator.gpu_state == "running"


@virtual_time
async def test_an_adopted_lease_lapses() -> None:
    flow = Flow()
    await flow.renew("old")
    seen = flow.now_ns
    a = await flow.arrive("a", model="a")
    await flow.advance(LEASE_S - 0.001)
    assert a.waiting
    await flow.advance(0.001)
    assert a.granted and a.ticket.decision.granted_ns == seen + round(LEASE_S * S)
    (settle,) = [x for x in flow.recorder.settles if x.reason is SettleReason.ADOPTED]
    assert (settle.result, settle.started_ns, settle.ended_ns) == (SettleResult.LAPSED, seen, seen + round(LEASE_S * S))


@virtual_time
async def test_an_exchange_adopted_while_a_grant_runs_still_lapses() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    await flow.renew("old")  # an earlier sidecar's exchange, reported while ours runs
    seen = flow.now_ns
    b = await flow.arrive("b", model="a")
    await flow.complete(a)
    assert b.waiting and flow.coordinator.gpu_state == "adopted"
    await flow.advance(LEASE_S)  # its final entry never comes: its lease lapses all the same
    assert b.granted and b.ticket.decision.granted_ns == seen + round(LEASE_S * S)


@virtual_time
async def test_a_late_report_for_a_watchdog_released_grant_is_ignored() -> None:
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 5}}, "envoy": {"leaseSeconds": 100}})
    a = await flow.arrive("a", model="a")
    await flow.advance(5)
    assert a.outcome is Outcome.WATCHDOG
    await flow.renew(a.ticket.token)  # its exchange goes on in Envoy
    assert flow.coordinator.gpu_state == "idle"
    b = await flow.arrive("b", model="a")
    assert b.granted
    await flow.end(a.ticket.token, ExchangeEnd.COMPLETE, 200)
    assert a.outcome is Outcome.WATCHDOG and b.outcome is None


@virtual_time
async def test_a_late_report_for_a_served_grant_is_ignored() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    await flow.complete(a)
    await flow.renew(a.ticket.token)
    assert flow.coordinator.gpu_state == "idle"


@pytest.mark.parametrize("release", ["lease", "proxy_gone"])
@virtual_time
async def test_a_late_periodic_report_for_a_lapsed_grant_adopts_it_again(release: str) -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    if release == "lease":
        await flow.advance(LEASE_S)
        assert a.outcome is Outcome.LEASE_EXPIRED
    else:
        await flow.peer_gone(PEER)
        assert a.outcome is Outcome.PROXY_GONE
    assert flow.coordinator.gpu_state == "idle"
    await flow.renew(a.ticket.token)  # Envoy still runs it after all
    assert flow.coordinator.gpu_state == "adopted"
    b = await flow.arrive("b", model="a")
    assert b.waiting
    await flow.end(a.ticket.token, ExchangeEnd.COMPLETE, 200)
    assert b.granted
    # The first outcome stands: the adoption's end does not rewrite it.
    assert a.outcome is (Outcome.LEASE_EXPIRED if release == "lease" else Outcome.PROXY_GONE)
    assert flow.recorder.times_finished(a.ticket) == 1
    adopted = [x for x in flow.recorder.settles if x.reason is SettleReason.ADOPTED]
    assert [x.result for x in adopted] == [SettleResult.ENDED]  # the GPU time it held, counted


@virtual_time
async def test_a_settle_never_stops_the_generation_of_an_exchange_envoy_reports_again() -> None:
    """abandonedGeneration: stop after a lapsed lease; before the settle could stop it, Envoy
    reported the exchange again: it is alive, and stopping would cut it (issue 25)."""
    flow = busy_flow({"upstream": {"abandonedGeneration": "stop"}}, busy=True)
    flow.upstream.busy_failures = 1  # the settle's first ask gets no answer
    a = await flow.arrive("a", model="a")
    await flow.advance(LEASE_S)
    assert a.outcome is Outcome.LEASE_EXPIRED and flow.coordinator.gpu_state == "settling"
    await flow.renew(a.ticket.token)  # Envoy still runs it after all
    b = await flow.arrive("b", model="a")
    await flow.advance(SETTLE_POLL_MAX_S)
    assert flow.upstream.stop_calls == []
    assert flow.coordinator.gpu_state == "adopted" and b.waiting  # the one computing slot is the adopted exchange
    settle = [x for x in flow.recorder.settles if x.reason is SettleReason.ABANDONED]
    assert [x.result for x in settle] == [SettleResult.IDLE]
    await flow.end(a.ticket.token, ExchangeEnd.COMPLETE, 200)
    assert b.granted


async def serve_many(flow: Flow, count: int) -> None:
    for i in range(count):
        other = await flow.arrive(f"other-{i}", model="a")
        await flow.complete(other)


@virtual_time
async def test_a_watchdog_released_grant_is_ignored_however_many_grants_finished_since() -> None:
    """Ours, finished, needs no memory: the token's epoch says it is ours, and no live ticket holds it."""
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 5}}, "envoy": {"leaseSeconds": 100}})
    a = await flow.arrive("a", model="a")
    await flow.advance(5)
    assert a.outcome is Outcome.WATCHDOG
    await serve_many(flow, FINISHED_MEMORY_ON_MAIN + 1)
    await flow.renew(a.ticket.token)  # its exchange still goes on in Envoy
    assert flow.coordinator.gpu_state == "idle"
    b = await flow.arrive("b", model="a")
    assert b.granted


@pytest.mark.parametrize("release", ["lease", "proxy_gone"])
@virtual_time
async def test_a_lapsed_grant_is_adopted_however_many_grants_finished_since(release: str) -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    if release == "lease":
        await flow.advance(LEASE_S)
    else:
        await flow.peer_gone(PEER)
    await serve_many(flow, FINISHED_MEMORY_ON_MAIN + 1)
    await flow.renew(a.ticket.token)  # Envoy still runs it after all
    assert flow.coordinator.gpu_state == "adopted"
    b = await flow.arrive("b", model="a")
    assert b.waiting
    await flow.complete(a.ticket.token)
    assert b.granted
    await flow.complete(b)
    await flow.renew(a.ticket.token)  # after its final entry it is forgotten: ours, finished
    assert flow.coordinator.gpu_state == "idle"


def test_tokens_say_which_process_issued_them() -> None:
    ours, earlier = Tokens(), Tokens()
    token = ours.next()
    assert ours.issued(token) and not earlier.issued(token)
    assert ours.epoch != earlier.epoch and token.startswith(ours.epoch + ".")
    assert len({ours.next() for _ in range(1000)}) == 1000
    assert not ours.issued(ours.epoch) and not ours.issued("guessed") and not ours.issued(earlier.next())


@pytest.mark.parametrize("elapsed_s", [None, 20.0])
@virtual_time
async def test_the_watchdog_lets_an_adopted_exchange_go_at_max_run_seconds_from_its_start(
        elapsed_s: float | None) -> None:
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 30}}, "envoy": {"leaseSeconds": 100}})
    await flow.renew("old", elapsed_s=elapsed_s)  # an earlier process's exchange, started 20 s ago (or unknown)
    a = await flow.arrive("a", model="a")
    left_s = 30 - (elapsed_s or 0)
    await flow.advance(left_s - 0.001)
    await flow.renew("old", elapsed_s=None if elapsed_s is None else elapsed_s + left_s - 0.001)
    assert a.waiting and flow.coordinator.gpu_state == "adopted"
    await flow.advance(0.001)
    assert a.granted  # no settle: abandonedGeneration is wait, as for a grant of ours
    adopted = [x for x in flow.recorder.settles if x.reason is SettleReason.ADOPTED]
    assert [x.result for x in adopted] == [SettleResult.WATCHDOG]
    assert [x.reason for x in flow.recorder.settles] == [SettleReason.ADOPTED]
    await flow.complete(a)
    # Let go on purpose: later entries do not adopt it again.
    await flow.renew("old", elapsed_s=None if elapsed_s is None else 31.0)
    assert flow.coordinator.gpu_state == "idle"


@virtual_time
async def test_an_exchange_already_past_max_run_seconds_is_not_adopted() -> None:
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 30}}})
    await flow.renew("old", elapsed_s=30.0)
    assert flow.coordinator.gpu_state == "idle"
    await flow.renew("younger", elapsed_s=29.0)
    assert flow.coordinator.gpu_state == "adopted"


@virtual_time
async def test_a_lapsed_grant_adopted_again_is_let_go_at_max_run_seconds_from_its_grant() -> None:
    flow = Flow({"routing": {"scheduler": {"maxRunSeconds": 10}}})
    a = await flow.arrive("a", model="a")
    granted_ns = a.ticket.decision.granted_ns
    await flow.advance(LEASE_S)
    assert a.outcome is Outcome.LEASE_EXPIRED
    await flow.renew(a.ticket.token, elapsed_s=0.0)  # its own grant's time counts, not what the entry says
    assert flow.coordinator.gpu_state == "adopted"
    b = await flow.arrive("b", model="a")
    for _ in range(3):
        await flow.advance(2)
        await flow.renew(a.ticket.token)
    await flow.advance_to(granted_ns + 10 * S - 1)
    assert b.waiting
    await flow.advance_to(granted_ns + 10 * S)
    assert b.granted
    await flow.complete(b)
    await flow.renew(a.ticket.token)  # let go: ours, finished
    assert flow.coordinator.gpu_state == "idle"


@virtual_time
async def test_a_changed_max_run_seconds_applies_to_an_adopted_exchange() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 100}})
    await flow.renew("old", elapsed_s=50.0)
    a = await flow.arrive("a", model="a")
    await flow.advance(10)
    assert a.waiting  # no watchdog
    flow.coordinator.reconfigure(parse_config({"envoy": {"leaseSeconds": 100},
                                               "routing": {"scheduler": {"maxRunSeconds": 70}}}))
    await flow.advance(9.999)
    assert a.waiting
    await flow.advance(0.001)  # 70 s after the exchange started
    assert a.granted


@pytest.mark.parametrize(("end", "settles"), [(ExchangeEnd.CLIENT_LEFT, True), (ExchangeEnd.UPSTREAM_FAILED, True),
                                              (None, True), (ExchangeEnd.COMPLETE, False)])
@virtual_time
async def test_an_adopted_exchange_that_may_leave_the_upstream_computing_is_followed_by_a_settle(
        end: ExchangeEnd | None, settles: bool) -> None:
    flow = busy_flow(busy=True)
    await flow.renew("old")
    a = await flow.arrive("a", model="a")
    await flow.report("old", ExchangeReport(final=True, end=end, status=0 if settles else 200, first_byte_s=None))
    if not settles:
        assert a.granted and flow.upstream.busy_calls == []
        return
    ended_ns = flow.now_ns
    assert flow.coordinator.gpu_state == "settling"
    await flow.advance(20)
    assert a.waiting and flow.upstream.busy_calls and set(flow.upstream.busy_calls) == {None}
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a.granted
    adopted, settle = flow.recorder.settles
    assert (adopted.reason, adopted.result) == (SettleReason.ADOPTED, SettleResult.ENDED)
    assert (settle.reason, settle.result, settle.started_ns) == (SettleReason.ABANDONED, SettleResult.IDLE, ended_ns)
    assert a.ticket.decision.granted_ns == settle.ended_ns


@virtual_time
async def test_an_adopted_lease_that_lapses_is_followed_by_a_settle() -> None:
    flow = busy_flow(busy=True)
    await flow.renew("old")
    a = await flow.arrive("a", model="a")
    await flow.advance(LEASE_S)
    assert flow.coordinator.gpu_state == "settling" and a.waiting
    flow.upstream.busy_answer = False
    await flow.advance(SETTLE_POLL_MAX_S)
    assert a.granted
    assert [(x.reason, x.result) for x in flow.recorder.settles] == [
        (SettleReason.ADOPTED, SettleResult.LAPSED), (SettleReason.ABANDONED, SettleResult.IDLE)]


@virtual_time
async def test_the_watchdog_stops_an_adopted_generation_with_abandoned_generation_stop() -> None:
    flow = busy_flow({"routing": {"scheduler": {"maxRunSeconds": 30}}, "envoy": {"leaseSeconds": 100},
                      "upstream": {"abandonedGeneration": "stop"}}, busy=True)
    await flow.renew("old", elapsed_s=25.0)
    a = await flow.arrive("a", model="a")
    await flow.advance(5)
    assert a.granted
    assert flow.upstream.stop_calls == [None]  # its model is unknown: every loaded one
    assert [(x.reason, x.result) for x in flow.recorder.settles] == [
        (SettleReason.ADOPTED, SettleResult.WATCHDOG), (SettleReason.ABANDONED, SettleResult.STOPPED)]


# -- the client leaves while waiting -----------------------------------------------------------


@virtual_time
async def test_a_client_leaving_while_waiting_leaves_the_queue() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", "interactive", model="a")
    c = await flow.arrive("c", model="a")
    await flow.advance(2)
    await flow.cancel(b)
    assert b.task.cancelled()
    assert b.outcome is Outcome.CANCELLED_WAITING
    assert b.ticket.finished_ns - b.ticket.arrival_ns == 2 * S
    assert flow.waiting_ids() == ["c"]
    assert flow.coordinator.status_of("b") is None
    await flow.complete(a)
    assert c.granted
    assert flow.recorder.grant_order() == ["a", "c"]


@virtual_time
async def test_a_waiter_cancelled_before_its_handler_ran_is_skipped() -> None:
    """Envoy cancelled b's Check and, before b's handler runs, a's release picks b."""
    flow = Flow()
    a = await flow.arrive("a", model="a")
    await flow.complete(a)
    x = await flow.arrive("x", model="a")
    b = await flow.arrive("b", "interactive", model="b")
    c = await flow.arrive("c", model="a")
    b.task.cancel()  # the waiter is cancelled now; the handler runs on a later turn
    flow.coordinator.report(x.ticket.token, ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200,
                                                           first_byte_s=None))
    assert b.outcome is Outcome.CANCELLED_WAITING and b.ticket.decision is None
    assert c.ticket.state is TicketState.RUNNING
    await flow.idle()
    assert c.granted and b.task.cancelled()
    assert flow.recorder.grant_order() == ["a", "x", "c"]
    assert flow.recorder.times_finished(b.ticket) == 1
    # b's grant never reached the upstream: model a is still loaded for c.
    assert not c.ticket.decision.load and not c.ticket.decision.swap
    assert c.ticket.decision.swap_affinity and c.ticket.decision.residents_before == {"a"}


@virtual_time
async def test_a_client_leaving_just_as_it_is_granted() -> None:
    """b is granted (its waiter resolved) and cancelled before its handler resumes."""
    flow = Flow()
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", "interactive", model="b")
    c = await flow.arrive("c", model="a")
    flow.coordinator.report(a.ticket.token, ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200,
                                                           first_byte_s=None))
    assert b.ticket.state is TicketState.RUNNING
    b.task.cancel()
    await flow.idle()
    assert b.task.cancelled()
    assert b.outcome is Outcome.CANCELLED_WAITING and not b.ticket.abandoned
    assert c.granted
    assert flow.recorder.settles == []  # nothing reached the upstream: nothing to settle
    assert not c.ticket.decision.load and not c.ticket.decision.swap  # model a still loaded
    assert c.ticket.decision.residents_before == {"a"}


@virtual_time
async def test_a_client_leaving_while_the_catalog_is_asked() -> None:
    upstream = FakeUpstream(router("a"))
    upstream.catalog_gate = asyncio.Event()
    flow = Flow(upstream=upstream)
    a = await flow.arrive("a", model="a")
    assert a.waiting and upstream.catalog_calls == 1
    await flow.advance(0.5)
    await flow.cancel(a)
    assert a.task.cancelled()
    [ticket] = flow.recorder.ended
    assert ticket.request_id == "a" and ticket.outcome is Outcome.CANCELLED_WAITING
    assert ticket.finished_ns - ticket.arrival_ns == round(0.5 * S)
    upstream.catalog_gate.set()
    await flow.idle()
    assert flow.coordinator.live_tickets() == 0 and flow.waiting_ids() == []
    assert flow.recorder.times_finished(ticket) == 1


# -- the model catalog -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [UpstreamKind.ROUTER, UpstreamKind.LLAMA_SWAP])
@virtual_time
async def test_a_catalog_that_routes_by_name_refuses_unknown_models(kind: UpstreamKind) -> None:
    upstream = FakeUpstream(Catalog(kind, frozenset({"a", "b"})))
    flow = Flow(upstream=upstream)
    a = await flow.arrive("a", model="a")
    assert a.granted and upstream.catalog_calls == 1
    z = await flow.arrive("z", model="zzz")
    assert z.refusal == Refusal(Outcome.REJECTED_UNKNOWN_MODEL, model="zzz")
    assert upstream.catalog_calls == 2  # a miss asks the upstream again, once
    assert [name for name, t in flow.recorder.events if t.request_id == "z"] == ["finished"]  # never queued
    none = await flow.arrive("none", model=None)  # no model: nothing to check
    assert none.waiting and upstream.catalog_calls == 2
    upstream.catalog_answer = Catalog(kind, frozenset({"a", "b", "new"}))
    new = await flow.arrive("new", model="new")
    assert new.waiting and upstream.catalog_calls == 3  # added later: accepted on its first request
    known = await flow.arrive("b", model="b")
    assert known.waiting and upstream.catalog_calls == 3  # a hit asks nothing


@virtual_time
async def test_concurrent_misses_share_one_question() -> None:
    upstream = FakeUpstream(router("a"))
    upstream.catalog_gate = asyncio.Event()
    flow = Flow(upstream=upstream)
    first = await flow.arrive("first", model="a")
    second = await flow.arrive("second", model="zzz")
    assert upstream.catalog_calls == 1 and first.waiting and second.waiting
    upstream.catalog_gate.set()
    await flow.idle()
    assert first.granted and second.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL
    assert upstream.catalog_calls == 1


@pytest.mark.parametrize(("check", "model", "accepted"), [
    ("auto", "anything", True), ("auto", "x", True),
    ("strict", "anything", False), ("strict", "x", True),
])
@virtual_time
async def test_a_single_model_catalog(check: str, model: str, accepted: bool) -> None:
    flow = Flow({"upstream": {"modelCheck": check}}, upstream=FakeUpstream(single("x")))
    request = await flow.arrive("r", model=model)
    assert request.granted is accepted
    if not accepted:
        assert request.refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL


@virtual_time
async def test_model_check_off_asks_nothing() -> None:
    flow = Flow({"upstream": {"modelCheck": "off"}}, upstream=FakeUpstream(router("a")))
    request = await flow.arrive("r", model="zzz")
    assert request.granted and flow.upstream.catalog_calls == 0


@pytest.mark.parametrize("failure", ["none", "raises"])
@virtual_time
async def test_no_catalog_refuses_nothing(failure: str) -> None:
    upstream = FakeUpstream(None)
    upstream.fail_catalog = failure == "raises"
    flow = Flow(upstream=upstream)
    request = await flow.arrive("r", model="zzz")
    assert request.granted and upstream.catalog_calls == 1


@virtual_time
async def test_the_reconcile_applies_the_loaded_model_only_if_no_grant_happened_since() -> None:
    flow = Flow({"upstream": {"modelCheck": "off"}})
    coordinator = flow.coordinator
    as_of = coordinator.scheduler.dispatches_on("gpu0")
    coordinator.observe_catalog(router("a", "b", loaded="b"), as_of, "gpu0")
    assert coordinator.view().resident_models == ("b",)
    a = await flow.arrive("a", model="a")  # a grant: the model becomes a
    assert a.ticket.decision.swap and a.ticket.decision.residents_before == {"b"}
    stale = coordinator.scheduler.dispatches_on("gpu0")
    coordinator.observe_catalog(router("a", "b", loaded="b"), stale, "gpu0")  # while a runs
    assert coordinator.view().resident_models == ("a",)
    await flow.complete(a)
    coordinator.observe_catalog(router("a", "b", loaded="b"), stale - 1, "gpu0")  # asked before a's grant
    assert coordinator.view().resident_models == ("a",)
    coordinator.observe_catalog(router("a", "b", loaded=None), coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    assert coordinator.view().resident_models == ()
    coordinator.observe_catalog(Catalog(UpstreamKind.ROUTER, frozenset({"a"}), frozenset({"a"}), residents_known=False),
                                coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    assert coordinator.view().resident_models == ()  # says nothing about what is loaded
    b = await flow.arrive("b", model="b")
    assert b.ticket.decision.load


# -- Retry-After -------------------------------------------------------------------------------


@virtual_time
async def test_retry_after_for_a_full_queue_is_the_running_requests_expected_rest() -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1}}, **LONG_LEASE})
    a = await flow.arrive("a", model="a")  # a load: expected 10 + 5 s
    await flow.arrive("b", model="a")
    await flow.advance(2.5)
    full = await flow.arrive("c", model="a")
    assert full.refusal == Refusal(Outcome.REJECTED_FULL, 13, queue_depth=1, queue_limit=1)
    await flow.advance(10)
    assert (await flow.arrive("d", model="a")).refusal.retry_after_s == 3
    await flow.advance(100)
    assert (await flow.arrive("e", model="a")).refusal.retry_after_s == 1  # overdue: at least 1
    await flow.complete(a)  # a ran 112.5 s with a load: model a's run is now expected to take 107.5 s
    assert flow.coordinator.estimator.expected_run_s("a") == 112.5 - SWAP_S
    await flow.arrive("g", model="a")  # b runs (no load), g waits
    await flow.advance(0.5)
    assert (await flow.arrive("f", model="a")).refusal.retry_after_s == math.ceil(107.5 - 0.5)


@virtual_time
async def test_retry_after_is_at_most_an_hour() -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1}}, "estimates": {"defaultRunSeconds": 100_000}})
    await flow.arrive("a", model="a")
    await flow.arrive("b", model="a")
    assert (await flow.arrive("c", model="a")).refusal.retry_after_s == RETRY_AFTER_MAX_S


@virtual_time
async def test_retry_after_while_settling_counts_the_abandoned_grant() -> None:
    flow = busy_flow({"routing": {"scheduler": {"maxQueued": 1}}}, busy=True)
    a = await flow.arrive("a", model="a")
    await flow.arrive("b", model="a")
    await flow.advance(4)
    await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    await flow.advance(1)
    # The settle's own estimate: a's expected run (10 s, no load counted) minus its 5 s so far.
    assert (await flow.arrive("c", model="a")).refusal.retry_after_s == 5


@virtual_time
async def test_retry_after_for_an_expired_request() -> None:
    flow = Flow({"routing": {"scheduler": {"maxWaitSeconds": 5}}, **LONG_LEASE})
    await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.advance(4.999)
    assert b.waiting
    await flow.advance(0.001)
    assert b.refusal == Refusal(Outcome.EXPIRED, 10, max_wait_s=5.0)
    assert b.ticket.finished_ns - b.ticket.arrival_ns == 5 * S
    assert flow.waiting_ids() == []


@virtual_time
async def test_an_empty_gpu_gives_the_least_retry_after() -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1, "maxWaitSeconds": 1}}})
    await flow.arrive("a", model="a")
    await flow.arrive("b", model="a")
    flow.coordinator.abandon_running()  # a leaves; b runs
    await flow.idle()
    c = await flow.arrive("c", model="a")
    await flow.arrive("d", model="a")
    assert c.waiting and flow.requests["d"].refusal.retry_after_s == math.ceil(RUN_S)


@virtual_time
async def test_shutdown_refusals_say_retry_after_five_seconds() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    c = await flow.arrive("c", "interactive", model="b")
    flow.coordinator.stop_admitting()
    await flow.idle()
    assert not flow.coordinator.admitting
    for request in (b, c):
        assert request.refusal == Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S)
    late = await flow.arrive("late", model="a")
    assert late.refusal == Refusal(Outcome.SHUTDOWN, SHUTDOWN_RETRY_AFTER_S) and SHUTDOWN_RETRY_AFTER_S == 5
    assert a.outcome is None  # the running one goes on
    idle = asyncio.ensure_future(flow.coordinator.wait_idle(30))
    await flow.advance(1)
    assert not idle.done()
    await flow.complete(a)
    assert idle.result() is True and a.outcome is Outcome.SERVED


@virtual_time
async def test_abandon_running_cuts_the_running_request_off_without_a_settle() -> None:
    flow = busy_flow(LONG_LEASE, busy=True)
    a = await flow.arrive("a", model="a")
    flow.coordinator.stop_admitting()
    idle = asyncio.ensure_future(flow.coordinator.wait_idle(10))
    await flow.advance(10)
    assert idle.result() is False
    flow.coordinator.abandon_running()
    await flow.idle()
    assert a.outcome is Outcome.SHUTDOWN and not a.ticket.abandoned
    assert flow.recorder.settles == [] and flow.coordinator.gpu_state == "idle"
    flow.coordinator.abandon_running()  # nothing runs: nothing happens
    assert flow.recorder.times_finished(a.ticket) == 1


# -- estimates and the queue view --------------------------------------------------------------


async def estimate_scene(flow: Flow) -> dict[str, Request]:
    """a (model a, a load: 15 s expected) runs; e (interactive, b), c (b), b (a), d (none) wait."""
    requests = {"a": await flow.arrive("a", model="a")}
    for name, priority, model in [("b", None, "a"), ("c", None, "b"), ("d", None, None), ("e", "interactive", "b")]:
        requests[name] = await flow.arrive(name, priority, model)
    return requests


@virtual_time
async def test_every_queued_request_gets_an_estimate_after_the_batch() -> None:
    flow = Flow()
    requests = await estimate_scene(flow)
    assert [requests[n].ticket.estimated_wait_s for n in "bcde"] == [None] * 4
    await flow.advance(0.05)  # ESTIMATE_BATCH_S
    # Starts at the batch (a has 14.95 s left): e 14.95 (b: swap 5 + run 10), c 29.95, b 39.95 (swap),
    # d 54.95; plus the 0.05 s each has already waited.
    estimates = {n: requests[n].ticket.estimated_wait_s for n in "ecbd"}
    assert estimates == pytest.approx({"e": 15.0, "c": 30.0, "b": 40.0, "d": 55.0}, abs=1e-9)
    assert requests["a"].ticket.estimated_wait_s is None  # granted at once, never estimated


@virtual_time
async def test_the_view_rows_agree_with_the_estimator_over_the_snapshot_order() -> None:
    flow = Flow(LONG_LEASE)
    await estimate_scene(flow)
    await flow.advance(2)
    view = flow.coordinator.view()
    assert view.policy == "serial" and view.resident_models == ("a",) and view.gpu == "running"
    assert [row.request_id for row in view.waiting] == ["e", "c", "b", "d"]
    assert [row.position for row in view.waiting] == [1, 2, 3, 4]
    assert [row.model for row in view.waiting] == ["b", "b", "a", None]
    assert [row.swap_affinity for row in view.waiting] == [False, True, False, False]
    assert [row.score for row in view.waiting] == pytest.approx([100 + 2 / 60, 10 + 2 / 60, 2 / 60, 2 / 60])
    assert [row.waited_s for row in view.waiting] == [2.0] * 4
    # By hand: a has 15 - 2 = 13 s left; e swaps to b (5 + 10), c runs 10, b swaps back (5 + 10).
    starts = [row.estimated_start_s for row in view.waiting]
    assert starts == pytest.approx([13, 28, 38, 53])
    [running] = view.running
    assert running is not None and running.request_id == "a" and running.model == "a"
    assert (running.running_s, running.queue_wait_s) == (2.0, 0.0)
    assert (running.expected_end_s, running.expected_remaining_s) == (RUN_S + SWAP_S, RUN_S + SWAP_S - 2)
    assert {band: depth for band, depth, _ in view.bands} == {Band.INTERACTIVE: 1, Band.NORMAL: 3, Band.BATCH: 0}
    assert {band: oldest for band, _, oldest in view.bands} == {Band.INTERACTIVE: 2.0, Band.NORMAL: 2.0,
                                                                Band.BATCH: 0.0}
    await flow.advance(20)
    # Overdue: how much longer it runs is unknown, and so is when the requests behind it start;
    # never "0 s", a time known to be wrong (issue 25).
    overdue = flow.coordinator.view()
    assert overdue.running[0].expected_remaining_s is None
    assert [row.estimated_start_s for row in overdue.waiting] == [None] * 4
    document = queue_document(overdue)
    assert document["running"]["expected_remaining_s"] is None and document["waiting"][0]["estimated_start_s"] is None
    text = render(document)
    assert "unknown" in text and "+0:00" not in text
    found = flow.coordinator.status_of("e")
    assert found is not None and found[1].estimated_start_s is None


@virtual_time
async def test_a_start_that_came_while_the_view_was_reused_is_unknown_not_now() -> None:
    """The walk is reused for a moment while nothing changes; a start that passes meanwhile
    waited for a grant that outran its estimate (nothing ended): unknown, never "0 s"."""
    flow = Flow({**LONG_LEASE, "estimates": {"defaultRunSeconds": 1, "defaultSwapSeconds": 0}})
    a = await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    assert a.granted and b.waiting
    await flow.advance(0.9)
    assert flow.coordinator.view().waiting[0].estimated_start_s == pytest.approx(0.1)
    await flow.advance(0.15)  # the walk is younger than VIEW_MAX_AGE_S: reused
    assert flow.coordinator.view().waiting[0].estimated_start_s is None
    found = flow.coordinator.status_of("b")
    assert found is not None and found[1].estimated_start_s is None


@virtual_time
async def test_status_of_finds_a_waiting_or_running_request_and_nothing_else() -> None:
    flow = Flow()
    await estimate_scene(flow)
    await flow.advance(1)
    found = flow.coordinator.status_of("b")
    assert found is not None
    ticket, row = found
    assert ticket is flow.requests["b"].ticket and isinstance(row, WaitingRow)
    assert (row.request_id, row.position, row.estimated_start_s) == ("b", 3, pytest.approx(39))
    ticket, row = flow.coordinator.status_of("a")
    assert isinstance(row, RunningRow) and row.request_id == "a" and ticket.state is TicketState.RUNNING
    assert flow.coordinator.status_of("nobody") is None
    assert flow.coordinator.status_of(flow.requests["b"].ticket.token) is None  # by request id only
    await flow.complete(flow.requests["a"])
    assert flow.coordinator.status_of("a") is None
    assert isinstance(flow.coordinator.status_of("e")[1], RunningRow)


@virtual_time
async def test_reconfigure_applies_to_the_waiting_requests() -> None:
    flow = Flow(LONG_LEASE)
    await flow.arrive("a", model="a")
    b = await flow.arrive("b", model="a")
    await flow.advance(10)
    flow.coordinator.reconfigure(parse_config({"routing": {"scheduler": {"maxWaitSeconds": 5}}, **LONG_LEASE}))
    await flow.idle()
    assert b.refusal.outcome is Outcome.EXPIRED  # already past the new limit
    assert [p.max_wait_s for p in flow.recorder.settings] == [0.0, 5.0]


@virtual_time
async def test_the_trusted_header_and_the_priority_policy_apply_at_arrival() -> None:
    flow = Flow({"security": {"priority": {"mode": "clamp", "min": -10, "max": 10, "trustedHeader": "x-tier"}}})
    await flow.arrive("a", model="a")
    high = await flow.arrive("high", "interactive", model="a")
    trusted = await flow.arrive("trusted", "batch", model="a", trusted="500")
    assert high.ticket.priority.value == 10
    assert trusted.ticket.priority.value == 500
    assert flow.waiting_ids() == ["trusted", "high"]


@virtual_time
async def test_a_reload_s_priority_policy_applies_to_the_next_arrival() -> None:
    # The coordinator keeps the policy built once per configuration (LiveConfig): a reload rebuilds it.
    flow = Flow(LONG_LEASE)
    await flow.arrive("a", model="a")
    before = await flow.arrive("before", "interactive", model="a")
    flow.coordinator.reconfigure(parse_config({"security": {"priority": {"mode": "clamp", "max": 3}}, **LONG_LEASE}))
    after = await flow.arrive("after", "interactive", model="a")
    assert (before.ticket.priority.value, after.ticket.priority.value) == (100, 3)


def test_arrival_has_the_fields_the_transport_fills() -> None:
    arrival = Arrival("id", "5", None, "m", "peer", None, None)
    ticket = Ticket("token", arrival, parse_config({}).priority_policy().resolve("5"), 7)
    assert (ticket.request_id, ticket.model, ticket.peer, ticket.arrival_ns, ticket.priority.value) == (
        "id", "m", "peer", 7, 5)
    assert Ticket("t", Arrival("", None, None, None, "p", None, None), ticket.priority, 0).request_id == "-"


@virtual_time
async def test_peer_gone_ends_that_connections_waiting_checks_before_the_gpu_is_granted_again() -> None:
    # Envoy died: its access-log stream ended before the cancellations of its waiting Checks
    # arrived. None of them may get the GPU meanwhile; another connection's request does.
    flow = Flow()
    running = await flow.arrive("running", model="a", peer="ipv4:10.0.0.1:1")
    gone = [await flow.arrive(f"gone-{i}", model="a", peer="ipv4:10.0.0.1:1") for i in range(2)]
    other = await flow.arrive("other", model="a", peer="ipv4:10.0.0.2:2")
    assert running.granted and all(request.waiting for request in gone) and other.waiting
    await flow.peer_gone("ipv4:10.0.0.1:1")
    assert running.outcome is Outcome.PROXY_GONE
    assert [request.outcome for request in gone] == [Outcome.CANCELLED_WAITING] * 2
    assert other.granted
    assert flow.recorder.grant_order() == ["running", "other"]
    # Their Checks were answered here, so their own cancellations have nothing left to end.
    assert all(request.task.done() and flow.recorder.times_finished(request.ticket) == 1 for request in gone)
