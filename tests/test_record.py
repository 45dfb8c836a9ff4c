"""The record tells the truth (issue 17): what the runtime learns from and counts, on a fake clock.

- one rule for what each outcome does to the loaded model, followed alike by the runtime (a real
  Coordinator, tests/flow.py) and the replay (the simulator's engine fed the runtime's activity log);
- only generations (a POST to a generation path answered 2xx) teach the run-time estimates;
- only a streamed first byte times a model load (swap cost, llamaswap_model_swap_seconds);
- a single-model upstream: every request is on the loaded model;
- estimates scale with the output tokens a request asks for;
- a client's status is its row of the queue walk, the same as the live view's.
"""

from __future__ import annotations

import pytest
from flow import PEER, FakeUpstream, Flow, Request, clock, router, single, virtual_time
from llamaswap.core import Outcome, Policy
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.ticket import ExchangeEnd, is_generation
from llamaswap.simulate.engine import FixedCosts, prepare, simulate
from llamaswap.simulate.records import format_line, parse_activity

RUN_S = 10.0
SWAP_S = 5.0
LONG_LEASE = {"envoy": {"leaseSeconds": 1000}}


# -- one rule for the loaded model -----------------------------------------------------------

async def _end_granted(flow: Flow, a: Request, outcome: Outcome) -> None:
    """End the granted request `a` the way the runtime reaches `outcome`."""
    if outcome is Outcome.SERVED:
        await flow.complete(a, 200, first_byte_s=0.5)
    elif outcome is Outcome.CANCELLED_RUNNING:
        await flow.end(a, ExchangeEnd.CLIENT_LEFT)
    elif outcome is Outcome.UPSTREAM_ERROR:
        await flow.complete(a, 503)
    elif outcome is Outcome.WATCHDOG:
        await flow.advance(30)  # maxRunSeconds
    elif outcome is Outcome.LEASE_EXPIRED:
        await flow.advance(30)  # past envoy.leaseSeconds, never renewed
    elif outcome is Outcome.PROXY_GONE:
        await flow.peer_gone(PEER)
    elif outcome is Outcome.SHUTDOWN:
        flow.coordinator.stop_admitting()
        flow.coordinator.abandon_running()
        await flow.idle()
    else:
        raise AssertionError(outcome)


# The outcomes a granted request can end with; the others never hold a grant (refused at arrival,
# left or expired while waiting), so they say nothing about what is loaded.
_GRANTED = (Outcome.SERVED, Outcome.CANCELLED_RUNNING, Outcome.UPSTREAM_ERROR, Outcome.WATCHDOG,
            Outcome.LEASE_EXPIRED, Outcome.PROXY_GONE, Outcome.SHUTDOWN)
_NEVER_RAN = (Outcome.CANCELLED_WAITING, Outcome.REJECTED_FULL, Outcome.REJECTED_UNKNOWN_MODEL, Outcome.EXPIRED,
              Outcome.INTERNAL_ERROR)
# A stopped Batch API line's part: its model stays loaded (tests/test_line_stops.py, as the runtime
# has it; the replay's `_RAN` counts it as one that ran).
_STOPPED_PART = (Outcome.STOPPED,)


def test_every_outcome_is_covered_by_the_agreement_test() -> None:
    assert set(_GRANTED) | set(_NEVER_RAN) | set(_STOPPED_PART) == set(Outcome)
    assert not set(_GRANTED) & set(_NEVER_RAN)


@pytest.mark.parametrize("outcome", _GRANTED, ids=str)
@virtual_time
async def test_runtime_and_replay_agree_on_the_loaded_model_after_a_granted_outcome(outcome: Outcome) -> None:
    """a (model m) ends with `outcome`; then b (model m) is granted. Whether b had to load m is
    what the runtime decided and what the replay of the runtime's own activity log decides."""
    activity = ActivityLog(clock())
    config: dict[str, object] = {"envoy": {"leaseSeconds": 20}}
    if outcome is Outcome.WATCHDOG:
        config = {"envoy": {"leaseSeconds": 1000}, "routing": {"scheduler": {"maxRunSeconds": 30}}}
    flow = Flow(config, observers=[activity])
    a = await flow.arrive("a", model="m")
    assert a.granted
    await flow.advance(2)
    await _end_granted(flow, a, outcome)
    assert a.outcome is outcome
    runtime_keeps = flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"m"})
    if outcome is not Outcome.SHUTDOWN:  # nothing is admitted after a shutdown
        await flow.advance(100)  # past any settle
        b = await flow.arrive("b", model="m")
        assert b.granted
        assert b.ticket.decision is not None
        assert b.ticket.decision.model_load is not runtime_keeps
        await flow.complete(b, 200)
    activity.close()
    records = parse_activity(format_line(r) for r in activity.recent()).requests
    assert [r.outcome for r in records][0] is outcome
    replay = prepare(records)
    if outcome is Outcome.SHUTDOWN:
        # A shutdown ends the process: the replay drops the record, and nothing follows it.
        assert replay.not_replayed == {"shutdown": 1}
        assert runtime_keeps  # the model was still generating when the grace ended
        return
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10)
    results = simulate(replay, policy, FixedCosts({}, {}, RUN_S, SWAP_S)).results
    assert [r.request.record.request_id for r in results] == ["a", "b"]
    assert results[1].model_load is not runtime_keeps, f"{outcome}: runtime keeps m loaded: {runtime_keeps}"


@pytest.mark.parametrize("outcome", _NEVER_RAN, ids=str)
@virtual_time
async def test_an_outcome_without_a_run_leaves_the_loaded_model_as_it_was(outcome: Outcome) -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1, "maxWaitSeconds": 5}}, **LONG_LEASE},
                upstream=FakeUpstream(router("m", "n", loaded="m")))
    first = await flow.arrive("first", model="m")
    await flow.advance(1)
    await flow.complete(first, 200)
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"m"})
    run = await flow.arrive("run", model="m")  # holds the GPU while the other one ends
    assert run.granted
    if outcome is Outcome.REJECTED_UNKNOWN_MODEL:
        other = await flow.arrive("other", model="nope")
    elif outcome is Outcome.INTERNAL_ERROR:
        # Admission fails after the grant (a bug): the grant never reached the upstream.
        await flow.complete(run, 200)
        original = flow.coordinator._grants.pump

        def failing() -> None:
            original()
            raise RuntimeError("a bug")
        flow.coordinator._grants.pump = failing  # type: ignore[method-assign]
        other = await flow.arrive("other", model="n")
        flow.coordinator._grants.pump = original  # type: ignore[method-assign]
    else:
        other = await flow.arrive("other", model="n")
        if outcome is Outcome.REJECTED_FULL:
            other = await flow.arrive("other2", model="n")
        elif outcome is Outcome.CANCELLED_WAITING:
            await flow.cancel(other)
        else:
            await flow.advance(6)
    assert other.outcome is outcome
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"m"})


# -- what teaches the estimates --------------------------------------------------------------

def test_a_generation_is_a_post_to_a_generation_path_answered_2xx() -> None:
    assert is_generation("POST", "/v1/chat/completions", 200)
    assert is_generation("POST", "/completion?x=1", 200)
    assert is_generation("POST", "/v1/embeddings", 201)
    assert not is_generation("POST", "/v1/chat/completions", 400)
    assert not is_generation("POST", "/v1/chat/completions", 500)
    assert not is_generation("GET", "/v1/chat/completions", 200)
    assert not is_generation("GET", "/slots", 200)
    assert not is_generation("POST", "/models/load", 200)
    # The path is looked up as sent first, then without its query: the same answer either way.
    assert is_generation("POST", "/v1/chat/completions?", 200)
    assert not is_generation("POST", "/models/load?next=/v1/completions", 200)
    assert not is_generation("POST", "/v1/chat/completions/extra", 200)


@virtual_time
async def test_only_generations_teach_the_run_time() -> None:
    flow = Flow(LONG_LEASE)
    estimator = flow.coordinator.estimator
    for name, method, path, status in (("bad", "POST", "/v1/chat/completions", 400),
                                       ("get", "GET", "/slots", 200),
                                       ("other", "POST", "/tokenize", 200)):
        r = await flow.arrive(name, model="m", method=method, path=path)
        await flow.advance(0.5)
        await flow.complete(r, status)
        assert estimator.expected_run_s("m") == RUN_S, name
    g = await flow.arrive("gen", model="m")
    await flow.advance(3)
    await flow.complete(g, 200)
    assert estimator.expected_run_s("m") == 3.0


@virtual_time
async def test_only_a_streamed_first_byte_times_a_model_load() -> None:
    flow = Flow(LONG_LEASE)
    estimator = flow.coordinator.estimator
    # Not streamed: the first byte (9 s) is the end of the generation, not of the load.
    a = await flow.arrive("a", model="m", streamed=False)
    await flow.advance(9)
    await flow.complete(a, 200, first_byte_s=9.0)
    assert a.ticket.decision is not None and a.ticket.decision.model_load
    assert estimator.expected_swap_s("m") == SWAP_S
    assert estimator.expected_run_s("m") == 9.0 - SWAP_S
    # Streamed: its first byte (2 s) is the load plus the prompt.
    scheduler = flow.coordinator.scheduler
    scheduler.set_residents(frozenset(), as_of=scheduler.dispatches_on("gpu0"), gpu="gpu0")
    b = await flow.arrive("b", model="m", streamed=True)
    await flow.advance(6)
    await flow.complete(b, 200, first_byte_s=2.0)
    assert estimator.expected_swap_s("m") == 2.0


# -- one model whatever the name -------------------------------------------------------------

@virtual_time
async def test_a_single_model_upstream_counts_no_swap_and_gives_affinity_to_all() -> None:
    flow = Flow(LONG_LEASE,
                upstream=FakeUpstream(single("the-model")))
    names = ["gpt-4", "qwen3", "anything", "gpt-4"]
    requests = [await flow.arrive(f"r{i}", model=name) for i, name in enumerate(names)]
    for request in requests:
        assert request.granted
        await flow.advance(1)
        await flow.complete(request, 200, first_byte_s=0.1)
    decisions = [r.ticket.decision for r in requests]
    assert all(d is not None for d in decisions)
    assert [d.swap for d in decisions if d is not None] == [False] * 4
    # Its one model is loaded whenever it answers (the catalog said so): not even the first loads it.
    assert [d.load for d in decisions if d is not None] == [False] * 4
    assert [d.swap_affinity for d in decisions if d is not None] == [True] * 4
    assert requests[1].ticket.model == "qwen3"  # the client's name is still what it sent


@virtual_time
async def test_a_router_still_swaps_between_named_models() -> None:
    flow = Flow(LONG_LEASE, upstream=FakeUpstream(router("a", "b")))
    a = await flow.arrive("a", model="a")
    await flow.advance(1)
    await flow.complete(a, 200)
    b = await flow.arrive("b", model="b")
    assert b.ticket.decision is not None and b.ticket.decision.swap


# -- the request's size ----------------------------------------------------------------------

async def _learn_64_token_runs(flow: Flow, run_s: float = 4.0) -> None:
    for i in range(3):
        r = await flow.arrive(f"warm{i}", model="m", max_tokens=64)
        await flow.advance(run_s)
        await flow.complete(r, 200)


@virtual_time
async def test_a_200_token_request_is_estimated_200_64ths_of_a_64_token_one() -> None:
    flow = Flow(LONG_LEASE)
    await _learn_64_token_runs(flow)
    estimator = flow.coordinator.estimator
    assert estimator.expected_request_run_s("m", 64) == 4.0
    assert estimator.expected_request_run_s("m", 200) == pytest.approx(4.0 * 200 / 64)
    assert estimator.expected_request_run_s("m", None) == 4.0  # not said: the model's median run
    assert estimator.expected_request_run_s("new", 200) == RUN_S  # no measurement: the default
    # In the queue: behind a running 200-token request, a 64-token one and then another.
    big = await flow.arrive("big", model="m", max_tokens=200)
    small = await flow.arrive("small", model="m", max_tokens=64)
    after = await flow.arrive("after", model="m", max_tokens=64)
    assert big.granted
    await flow.advance(1)
    view = flow.coordinator.view()
    assert len(view.running) == 1
    assert view.running[0].expected_end_s == pytest.approx(4.0 * 200 / 64)
    starts = {row.request_id: row.estimated_start_s for row in view.waiting}
    assert starts["small"] == pytest.approx(4.0 * 200 / 64 - 1)
    assert starts["after"] == pytest.approx(4.0 * 200 / 64 - 1 + 4.0)
    # The estimate made at arrival (the batch after 50 ms) used the size too.
    assert small.ticket.estimated_wait_s == pytest.approx(4.0 * 200 / 64)
    assert after.ticket.estimated_wait_s == pytest.approx(4.0 * 200 / 64 + 4.0)


# -- a client's status -------------------------------------------------------------------------

@virtual_time
async def test_a_clients_status_is_its_row_of_the_live_view() -> None:
    flow = Flow(LONG_LEASE)
    await flow.arrive("run", model="a")
    for i, (priority, model) in enumerate([("batch", "a"), ("interactive", "b"), ("0", "a"), ("0", None)]):
        await flow.arrive(f"w{i}", priority, model, max_tokens=10 * (i + 1))
    await flow.advance(2)
    view = flow.coordinator.view()
    rows = {row.request_id: row for row in view.waiting}
    for request_id, row in rows.items():
        found = flow.coordinator.status_of(request_id)
        assert found is not None
        assert found[1] == row
    running = flow.coordinator.status_of("run")
    assert running is not None and running[1] == view.running[0]
    assert flow.coordinator.status_of("nobody") is None


@virtual_time
async def test_polling_a_status_walks_the_queue_once_per_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each poll builds its own row only (not the whole view), from a walk made once per change."""
    from llamaswap.runtime import views

    rows = 0
    row_type = views.WaitingRow

    def counted_row(*args: object) -> object:
        nonlocal rows
        rows += 1
        return row_type(*args)  # type: ignore[arg-type]
    monkeypatch.setattr(views, "WaitingRow", counted_row)
    flow = Flow(LONG_LEASE)
    await flow.arrive("run", model="a")
    for i in range(50):
        await flow.arrive(f"w{i}", model="a")
    await flow.advance(1)
    walks = 0
    snapshot = flow.coordinator.scheduler.snapshot

    def counted() -> object:
        nonlocal walks
        walks += 1
        return snapshot()
    flow.coordinator.scheduler.snapshot = counted  # type: ignore[method-assign,assignment]
    for _ in range(100):
        for i in (0, 25, 49):
            assert flow.coordinator.status_of(f"w{i}") is not None
    assert walks == 1
    assert rows == 300  # one per poll, whatever the depth
    await flow.arrive("new", model="a")  # a change
    assert flow.coordinator.status_of("w0") is not None
    assert walks == 2



# -- the replay learns and keys as the runtime does ------------------------------------------

@virtual_time
async def test_the_replay_of_a_single_model_upstream_counts_no_swap() -> None:
    activity = ActivityLog(clock())
    flow = Flow(LONG_LEASE, upstream=FakeUpstream(single("the-model")), observers=[activity])
    for i, name in enumerate(["gpt-4", "qwen3", "gpt-4", "qwen3"]):
        r = await flow.arrive(f"r{i}", model=name)
        await flow.advance(1)
        await flow.complete(r, 200)
    records = parse_activity(format_line(r) for r in activity.recent()).requests
    assert [r["model"] for r in activity.recent()] == ["gpt-4", "qwen3", "gpt-4", "qwen3"]  # what clients sent
    policy = Policy.serial(aging_divisor_s=60, swap_affinity_bonus=10)
    metrics = simulate(prepare(records), policy, FixedCosts({}, {}, RUN_S, SWAP_S)).metrics
    assert metrics.swaps == 0  # its one model was loaded from the start (the catalog said): no load, no swap


@virtual_time
async def test_the_replay_learns_costs_only_from_streamed_generations() -> None:
    from llamaswap.simulate.engine import measure_costs

    activity = ActivityLog(clock())
    flow = Flow(LONG_LEASE, observers=[activity])
    bad = await flow.arrive("bad", model="m")  # a 400: no generation
    await flow.advance(1)
    await flow.complete(bad, 400)
    plain = await flow.arrive("plain", model="m", streamed=False)  # a load, but not streamed
    await flow.advance(9)
    await flow.complete(plain, 200, first_byte_s=9.0)
    records = parse_activity(format_line(r) for r in activity.recent()).requests
    assert [(r.generation, r.streamed) for r in records] == [(False, True), (True, False)]
    costs = measure_costs(records, default_run_s=RUN_S, default_swap_s=SWAP_S, samples=20)
    live = flow.coordinator.estimator
    assert costs.expected_swap_s("m") == live.expected_swap_s("m") == SWAP_S
    assert costs.expected_run_s("m") == live.expected_run_s("m") == 9.0 - SWAP_S
