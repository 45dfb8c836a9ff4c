"""The router's own sleep (issue 48, `runtime/asleep.py`): llama-server's `--sleep-idle-seconds`
lists an idle model `sleeping`. What GET /v1/models says of it (the fake router over HTTP, shapes
as llama-server b11434 answers), and what the runtime makes of it on the fake clock (tests/flow.py):
not resident, so its next request is a load; read again before such a request is queued; and,
where the GPU keeps several models, unloaded, since it still holds one of the router's places."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from fake_llama import LOADED, SLEEPING, UNLOADED, FakeLlamaServer
from flow import FakeUpstream, Flow, virtual_time
from llamaswap.adapters.upstream_http import HttpUpstream, catalog_from
from llamaswap.core import Outcome
from llamaswap.core.residency import Residency
from llamaswap.runtime.upstream import Catalog, UpstreamKind

MODELS = ("a", "b", "c")
SLEEP_S = 30.0  # the router's --sleep-idle-seconds in the runtime's tests
LONG_LEASE = {"envoy": {"leaseSeconds": 600}}  # no lease lapses while the clock is moved past SLEEP_S


def listed(*states: tuple[str, str], args: list[str] | None = None) -> dict:
    """A router's GET /v1/models: each model with its status and its child's arguments."""
    return {"data": [{"id": name, "object": "model", "owned_by": "llamacpp",
                      "status": {"value": value, "args": ["llama-server", "--alias", name, *(args or [])]}}
                     for name, value in states]}


def router(*, loaded: tuple[str, ...] = (), asleep: tuple[str, ...] = (), sleep_after_s: float | None = SLEEP_S,
           ) -> Catalog:
    return Catalog(UpstreamKind.ROUTER, frozenset(MODELS), frozenset(loaded), True, asleep=frozenset(asleep),
                   sleep_after_s=sleep_after_s)


# -- what GET /v1/models says ------------------------------------------------------------------


def test_a_sleeping_model_is_listed_but_not_resident() -> None:
    catalog = catalog_from(listed(("a", "sleeping"), ("b", "loaded"), ("c", "unloaded"),
                                  args=["--sleep-idle-seconds", "2"]))
    assert catalog is not None and catalog.kind is UpstreamKind.ROUTER
    assert catalog.models == {"a", "b", "c"}
    assert (catalog.residents, catalog.asleep, catalog.sleep_after_s) == (frozenset({"b"}), frozenset({"a"}), 2.0)


def test_the_sleep_time_is_the_shortest_the_models_arguments_give() -> None:
    document = listed(("a", "loaded"), args=["--sleep-idle-seconds", "120"])
    document["data"] += listed(("b", "unloaded"), args=["--sleep-idle-seconds", "45.5"])["data"]
    document["data"] += listed(("c", "unloaded"), args=["--sleep-idle-seconds", "-1"])["data"]  # off for c
    assert catalog_from(document).sleep_after_s == 45.5  # type: ignore[union-attr]


def test_a_router_without_sleep_has_no_sleep_time() -> None:
    for args in ([], ["--sleep-idle-seconds", "-1"], ["--sleep-idle-seconds", "soon"], ["--sleep-idle-seconds"]):
        catalog = catalog_from(listed(("a", "loaded"), args=args))
        assert catalog is not None and catalog.sleep_after_s is None and catalog.asleep == frozenset(), args


async def test_the_fake_router_says_sleeping_and_the_sidecars_asks_never_wake_it() -> None:
    """What the port reads of a sleeping model, from the fake router over HTTP: not resident, its
    sleep time from the arguments; asking whether the router is busy never asks the sleeping model
    (a query naming it would wake it, as llama-server does); an unload unloads it."""
    upstream = FakeLlamaServer(router=True, models=("model-a", "model-b"), loaded="model-a", models_max=2).started()
    upstream.sleep_idle_seconds = 2
    client = HttpUpstream(upstream.url)
    try:
        upstream.put_to_sleep("model-a")
        catalog = await client.catalog()
        assert catalog is not None
        assert (catalog.residents, catalog.asleep, catalog.sleep_after_s) == (frozenset(), {"model-a"}, 2.0)
        assert await client.busy(None) == 0 and await client.busy("model-a") == 0
        assert upstream.slots_asked == [] and upstream.autoloaded == []
        assert await client.total_slots("model-a") is None  # asking /props would wake it
        assert upstream.props_asked == [] and upstream.states["model-a"] == SLEEPING
        assert await client.unload("model-a", timeout_s=5.0)
        assert upstream.unloads == ["model-a"] and upstream.states["model-a"] == UNLOADED
    finally:
        await client.close()
        upstream.close()


async def test_the_fake_router_wakes_a_sleeping_model_as_llama_server_does() -> None:
    """The fake's own rules (measured on llama-server b11434): a query with autoload=false wakes a
    sleeping model, a load of it is refused as already running, and it keeps its place under
    --models-max: a load beyond it evicts it."""
    upstream = FakeLlamaServer(router=True, models=("model-a", "model-b"), loaded="model-a").started()
    client = HttpUpstream(upstream.url)
    try:
        upstream.put_to_sleep("model-a")
        session = client._client()
        async with session.post(f"{upstream.url}/models/load", json={"model": "model-a"}) as response:
            assert response.status == 400
        async with session.get(f"{upstream.url}/slots?model=model-a&autoload=false") as response:
            assert response.status == 200
        assert upstream.states["model-a"] == LOADED and upstream.autoloaded == ["model-a"]
        upstream.put_to_sleep("model-a")
        async with session.post(f"{upstream.url}/v1/completions", json={"model": "model-b"}) as response:
            assert response.status == 200
        assert upstream.evicted == ["model-a"] and upstream.states == {"model-a": UNLOADED, "model-b": LOADED}
    finally:
        await client.close()
        upstream.close()


# -- not resident, read before the next request --------------------------------------------


@virtual_time
async def test_the_next_request_of_a_model_put_to_sleep_is_a_load() -> None:
    upstream = FakeUpstream(router(loaded=("a",)))
    flow = Flow(LONG_LEASE, upstream=upstream)
    first = await flow.arrive("a1", model="a")
    assert first.granted and not first.ticket.decision.load  # type: ignore[union-attr]
    await flow.complete(first)
    asked = upstream.catalog_calls
    await flow.advance(SLEEP_S - 1)
    soon = await flow.arrive("a2", model="a")  # granted less than the sleep time ago: not asked
    assert soon.granted and not soon.ticket.decision.load and upstream.catalog_calls == asked  # type: ignore[union-attr]
    await flow.complete(soon)
    upstream.catalog_answer = router(asleep=("a",))  # the router put it to sleep
    await flow.advance(SLEEP_S)
    woken = await flow.arrive("a3", model="a")
    assert upstream.catalog_calls == asked + 1  # read before it was queued
    decision = woken.ticket.decision
    assert woken.granted and decision is not None and decision.load
    assert decision.ready_at is not None and decision.ready_at[0] == "a"  # its expected end counts the load
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a"}  # the load makes it resident again
    await flow.complete(woken)
    assert flow.recorder.outcomes() == {"a1": Outcome.SERVED, "a2": Outcome.SERVED, "a3": Outcome.SERVED}


@virtual_time
async def test_a_router_that_puts_nothing_to_sleep_is_not_asked() -> None:
    upstream = FakeUpstream(router(loaded=("a",), sleep_after_s=None))
    flow = Flow(LONG_LEASE, upstream=upstream)
    await flow.complete(await flow.arrive("a1", model="a"))
    asked = upstream.catalog_calls
    await flow.advance(10 * SLEEP_S)
    later = await flow.arrive("a2", model="a")
    assert later.granted and not later.ticket.decision.load and upstream.catalog_calls == asked  # type: ignore[union-attr]


@virtual_time
async def test_a_model_that_runs_is_not_asked_about() -> None:
    upstream = FakeUpstream(router(loaded=("a",)))
    flow = Flow({"upstream": {"slots": 2}, **LONG_LEASE}, upstream=upstream)
    running = await flow.arrive("a1", model="a")
    asked = upstream.catalog_calls
    await flow.advance(2 * SLEEP_S)
    beside = await flow.arrive("a2", model="a")  # its model computes: it cannot be asleep
    assert running.granted and beside.granted and upstream.catalog_calls == asked


@virtual_time
async def test_a_model_the_router_unloaded_by_itself_is_a_load_again() -> None:
    """Status `unloaded` while the scheduler counts it resident and nothing runs: gone, once read."""
    upstream = FakeUpstream(router(loaded=("a",), sleep_after_s=None))
    flow = Flow(LONG_LEASE, upstream=upstream)
    await flow.complete(await flow.arrive("a1", model="a"))
    coordinator = flow.coordinator
    coordinator.observe_catalog(router(sleep_after_s=None), coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    assert coordinator.scheduler.residents_on("gpu0") == frozenset()
    again = await flow.arrive("a2", model="a")
    assert again.granted and again.ticket.decision.load  # type: ignore[union-attr]


# -- a place of the router's: unloaded where the GPU keeps several --------------------------


def keeping(upstream: FakeUpstream, max_loaded: int, pinned: frozenset[str] = frozenset()) -> Flow:
    """A node of one GPU that keeps up to ``max_loaded`` models (the scheduler told so directly),
    with what the upstream's catalog says loaded accepted."""
    flow = Flow({"upstream": {"slots": 1}, **LONG_LEASE}, upstream=upstream)
    scheduler = flow.coordinator.scheduler
    policy = scheduler.policy
    scheduler.reconfigure(policy.with_gpus(tuple(dataclasses.replace(gpu, residency=Residency(max_loaded, pinned))
                                                 for gpu in policy.gpus)))
    flow.coordinator.observe_catalog(upstream.catalog_answer, scheduler.dispatches_on("gpu0"), "gpu0")  # type: ignore[arg-type]
    return flow


@virtual_time
async def test_with_several_kept_a_sleeping_model_is_unloaded_and_a_load_waits_for_it() -> None:
    upstream = FakeUpstream(router(loaded=("a", "b")))
    upstream.unload_gate = asyncio.Event()
    flow = keeping(upstream, 2)
    coordinator = flow.coordinator
    upstream.catalog_answer = router(loaded=("b",), asleep=("a",))
    coordinator.observe_catalog(upstream.catalog_answer, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert coordinator.scheduler.residents_on("gpu0") == {"b"} and upstream.unload_calls == ["a"]
    c = await flow.arrive("c1", model="c")  # room by the scheduler's count: goes once "a" is gone
    decision = coordinator.scheduler.running_grants[0]
    assert c.waiting and decision.load and decision.evicts == ()
    upstream.unload_gate.set()
    await flow.idle()
    assert c.granted and upstream.unload_calls == ["a"]
    coordinator.observe_catalog(upstream.catalog_answer, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert upstream.unload_calls == ["a"]  # gone: nothing more to unload


@virtual_time
async def test_a_sleeping_model_that_would_not_unload_stays_counted_and_is_not_tried_again() -> None:
    upstream = FakeUpstream(router(loaded=("a", "b")))
    upstream.unloads = False
    flow = keeping(upstream, 2)
    coordinator = flow.coordinator
    upstream.catalog_answer = router(loaded=("b",), asleep=("a",))
    coordinator.observe_catalog(upstream.catalog_answer, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert upstream.unload_calls == ["a"]
    assert coordinator.scheduler.residents_on("gpu0") == {"a", "b"}  # it still holds its place
    coordinator.observe_catalog(upstream.catalog_answer, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert upstream.unload_calls == ["a"]  # not again while it sleeps
    awake = router(loaded=("a", "b"))
    coordinator.observe_catalog(awake, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    coordinator.observe_catalog(upstream.catalog_answer, coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert upstream.unload_calls == ["a", "a"]  # asleep anew: tried anew


@virtual_time
async def test_with_room_for_one_a_sleeping_model_is_left_to_the_router() -> None:
    """At --models-max 1 the router replaces its model by itself: nothing is unloaded."""
    upstream = FakeUpstream(router(loaded=("a",)))
    flow = keeping(upstream, 1)
    coordinator = flow.coordinator
    coordinator.observe_catalog(router(asleep=("a",)), coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    await flow.idle()
    assert coordinator.scheduler.residents_on("gpu0") == frozenset() and upstream.unload_calls == []
    b = await flow.arrive("b1", model="b")
    assert b.granted and b.ticket.decision.load and b.ticket.decision.evicts == ()  # type: ignore[union-attr]


@virtual_time
async def test_a_sleeping_model_the_scheduler_still_counts_is_not_unloaded() -> None:
    """A report a grant overtook is dropped: the scheduler counts the model still, and nothing is unloaded."""
    upstream = FakeUpstream(router(loaded=("a", "b")))
    flow = keeping(upstream, 2)
    coordinator = flow.coordinator
    stale = coordinator.scheduler.dispatches_on("gpu0")
    b = await flow.arrive("b1", model="b")
    assert b.granted
    coordinator.observe_catalog(router(loaded=("b",), asleep=("a",)), stale, "gpu0")
    await flow.idle()
    assert coordinator.scheduler.residents_on("gpu0") == {"a", "b"} and upstream.unload_calls == []


@virtual_time
async def test_a_pinned_model_asleep_stays_counted_and_is_never_unloaded(caplog: pytest.LogCaptureFixture) -> None:
    upstream = FakeUpstream(router(loaded=("a", "b")))
    flow = keeping(upstream, 2, pinned=frozenset({"a"}))
    coordinator = flow.coordinator
    for _ in range(2):
        coordinator.observe_catalog(router(loaded=("b",), asleep=("a",)), coordinator.scheduler.dispatches_on("gpu0"),
                                    "gpu0")
        await flow.idle()
    assert coordinator.scheduler.residents_on("gpu0") == {"a", "b"} and upstream.unload_calls == []
    said = [record.getMessage() for record in caplog.records if "models.a.pinned" in record.getMessage()]
    assert len(said) == 1 and "sleep-idle-seconds = -1" in said[0]  # once
