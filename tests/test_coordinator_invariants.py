"""The coordinator keeps one model at the upstream whatever a request's path or end (issue 25),
on the fake clock (tests/flow.py): a request is scheduled as what it loads or unloads (a query's
?model=, a management body), a 4xx leaves the model loaded (and a single-model upstream's one
model always is), and whatever can free a slot or change the best request re-runs the grant
decision (a waiting request that leaves or expires, an Envoy connection that goes, a reload)."""

from __future__ import annotations

from flow import FakeUpstream, Flow, Request, check_request, router, single, virtual_time

from llamaswap.adapters.ext_authz import Scheduled, query_model, scheduled_as
from llamaswap.config import parse_config
from llamaswap.core import Outcome
from llamaswap.runtime.ticket import ExchangeEnd

LONG_LEASE = {"leaseSeconds": 1000}
OTHER_PEER = "ipv4:127.0.0.1:40002"


def slots_flow(slots: int = 2, upstream: FakeUpstream | None = None, **scheduler: object) -> Flow:
    return Flow({"upstream": {"slots": slots}, "envoy": LONG_LEASE, "routing": {"scheduler": scheduler}},
                upstream=upstream or FakeUpstream(router("a", "b", loaded="a")))


async def via_envoy(flow: Flow, request_id: str, method: str, path: str, model: str | None = None) -> Request:
    """A Check as the adapter reads it, for `method path` with the body's `model`."""
    check = check_request({"x-request-id": request_id}, model=model)
    check.attributes.request.http.method = method
    check.attributes.request.http.path = path
    return await flow.check(check)


def test_what_a_request_is_scheduled_as() -> None:
    assert scheduled_as("GET", "/props?model=b", None) == Scheduled("b")
    assert scheduled_as("GET", "/slots?model=b%2Dx&fields=1", None) == Scheduled("b-x")
    assert scheduled_as("GET", "/metrics?model=b&model=c", None) == Scheduled("b")  # the first, as llama-server reads
    assert scheduled_as("GET", "/slots?model=b&autoload=false", None) == Scheduled(None)  # loads nothing
    assert scheduled_as("GET", "/props?autoload=0&model=b", None) == Scheduled(None)
    assert scheduled_as("POST", "/v1/chat/completions?model=b", "a") == Scheduled("a")  # the body's wins
    assert scheduled_as("POST", "/models/unload", "a") == Scheduled("a", alone=True)
    assert scheduled_as("POST", "/models/load", "b") == Scheduled("b")  # a load of b is a request for b
    assert scheduled_as("GET", "/models/unload", None) == Scheduled(None)
    assert query_model("/props") is None and query_model("/props?model=") is None
    assert query_model("/props?model=" + "x" * 513) is None


@virtual_time
async def test_a_query_that_loads_a_model_waits_for_the_running_generations() -> None:
    flow = slots_flow()
    a1 = await flow.arrive("a1", model="a")
    reads = await via_envoy(flow, "reads", "GET", "/slots?model=b&autoload=false")
    props = await via_envoy(flow, "props", "GET", "/props?model=b")
    assert a1.granted and reads.granted and props.waiting  # a read that loads nothing runs beside
    await flow.complete(reads)
    await flow.complete(a1)
    assert props.granted and props.ticket.decision.swap and props.ticket.model == "b"
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"b"})


@virtual_time
async def test_an_unload_waits_for_its_models_generations_and_runs_alone() -> None:
    flow = slots_flow()
    a1 = await flow.arrive("a1", model="a")
    unload = await via_envoy(flow, "unload", "POST", "/models/unload", model="a")
    a2 = await flow.arrive("a2", model="a")
    assert a1.granted and unload.waiting and a2.waiting  # not beside a1: it would end a1's generation
    await flow.complete(a1)
    assert unload.granted and a2.waiting  # alone: a free slot, but nothing beside an unload
    decision = unload.ticket.decision
    assert decision.alone and not decision.model_load
    await flow.complete(unload)
    assert a2.granted and a2.ticket.decision.load  # model a was unloaded: a2 loads it again


@virtual_time
async def test_a_refusal_leaves_the_model_loaded_and_the_next_grant_is_no_load() -> None:
    flow = slots_flow()
    a1 = await flow.arrive("a1", model="a")
    refused = await flow.arrive("refused", model="a")
    await flow.complete(refused, 400)
    assert refused.outcome is Outcome.SERVED and flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"a"})
    a2 = await flow.arrive("a2", model="a")
    assert a1.granted and a2.granted  # the free slot, beside a1
    assert not a2.ticket.decision.model_load
    await flow.complete(a2, 500)  # a failure does say the model is not known to be loaded
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset()


@virtual_time
async def test_a_refusal_beside_the_grant_that_loads_the_model_does_not_undo_the_load() -> None:
    """Nothing loaded: a1 loads model a, a2 runs on that load and is refused. a1 still runs on
    it, so the model stays believed loaded and a3 takes the free slot."""
    flow = slots_flow(3, upstream=FakeUpstream(router("a", "b", loaded=None)))
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    assert a1.ticket.decision.load and a2.granted
    await flow.complete(a2, 400)
    a3 = await flow.arrive("a3", model="a")
    assert a3.granted and not a3.ticket.decision.model_load
    await flow.complete(a1)
    await flow.complete(a3)
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"a"})


@virtual_time
async def test_a_refused_load_leaves_nothing_known_loaded() -> None:
    """A 4xx to the grant that loaded its model says nothing about whether the load happened."""
    flow = slots_flow(upstream=FakeUpstream(router("a", "b", loaded="a")))
    b = await flow.arrive("b", model="b")
    assert b.granted and b.ticket.decision.swap
    await flow.complete(b, 404)
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset()


@virtual_time
async def test_a_single_model_upstreams_model_stays_loaded_after_a_failure() -> None:
    flow = slots_flow(upstream=FakeUpstream(single("m")))
    a1 = await flow.arrive("a1", model="m")
    assert not a1.ticket.decision.model_load  # the catalog said which model is loaded
    failed = await flow.arrive("failed", model="m")
    await flow.complete(failed, 500)
    assert failed.outcome is Outcome.UPSTREAM_ERROR
    a2 = await flow.arrive("a2", model="m")
    assert a2.granted and not a2.ticket.decision.model_load
    unload = await via_envoy(flow, "unload", "POST", "/models/unload", model="m")  # (llama-server: 404)
    await flow.complete(a1)
    await flow.complete(a2)
    assert unload.granted
    await flow.complete(unload, 404)
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset({"m"})


async def _swap_holds_back_a2(flow: Flow) -> tuple[Request, Request, Request]:
    a1 = await flow.arrive("a1", "normal", "a")
    b = await flow.arrive("b", "interactive", "b")
    await flow.advance(1)
    a2 = await flow.arrive("a2", "normal", "a")
    assert a1.granted and b.waiting and a2.waiting  # b is the best and needs a swap
    return a1, b, a2


@virtual_time
async def test_a_cancelled_swap_lets_the_loaded_models_work_start_at_once() -> None:
    flow = slots_flow()
    _, b, a2 = await _swap_holds_back_a2(flow)
    await flow.cancel(b)
    assert b.outcome is Outcome.CANCELLED_WAITING and a2.granted


@virtual_time
async def test_an_expired_swap_lets_the_loaded_models_work_start_at_once() -> None:
    flow = slots_flow(maxWaitSeconds=10)
    _, b, a2 = await _swap_holds_back_a2(flow)
    await flow.advance(10)
    assert b.outcome is Outcome.EXPIRED and a2.granted


@virtual_time
async def test_a_gone_envoy_connection_ends_its_waiting_checks_before_the_next_grant() -> None:
    """Its waiting swap leaves: the next best goes, but never one of the same connection's Checks."""
    flow = slots_flow()
    a1 = await flow.arrive("a1", "normal", "a")
    b = await flow.arrive("b", "interactive", "b", peer=OTHER_PEER)
    gone = await flow.arrive("gone", "normal", "a", peer=OTHER_PEER)
    a2 = await flow.arrive("a2", "batch", "a")
    assert a1.granted and b.waiting and gone.waiting and a2.waiting
    await flow.peer_gone(OTHER_PEER)
    assert b.outcome is gone.outcome is Outcome.CANCELLED_WAITING
    assert a2.granted and gone.ticket.decision is None
    await flow.end(a1, ExchangeEnd.COMPLETE, 200)


@virtual_time
async def test_a_reload_that_adds_slots_grants_at_once() -> None:
    flow = slots_flow(1)
    a1 = await flow.arrive("a1", model="a")
    a2 = await flow.arrive("a2", model="a")
    assert a1.granted and a2.waiting
    flow.coordinator.reconfigure(parse_config({"upstream": {"slots": 2}, "envoy": LONG_LEASE}))
    await flow.idle()
    assert a2.granted and a1.outcome is None


@virtual_time
async def test_a_reload_that_makes_the_swap_no_longer_the_best_grants_at_once() -> None:
    """fifo: b (a swap) is ahead by arrival until a reload lowers model b's priority."""
    fifo = {"upstream": {"slots": 2}, "envoy": LONG_LEASE, "routing": {"scheduler": {"use": "fifo"}}}
    flow = Flow(fifo, upstream=FakeUpstream(router("a", "b", loaded="a")))
    a1 = await flow.arrive("a1", model="a")
    b = await flow.arrive("b", model="b")
    a2 = await flow.arrive("a2", model="a")
    assert a1.granted and b.waiting and a2.waiting
    flow.coordinator.reconfigure(parse_config({**fifo, "models": {"b": {"priority": -100}}}))
    await flow.idle()
    assert a2.granted and b.waiting
