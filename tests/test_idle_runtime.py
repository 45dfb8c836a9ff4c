"""Idle unloads in the runtime (issue 48, `runtime/idle.py`) on the fake clock (tests/flow.py): one
timer for the next due time, the unload through the upstream, a request during it, a pinned model
kept, a failed unload tried again an idle time later, and the eviction seen with the reason idle."""

from __future__ import annotations

import asyncio

from flow import FakeUpstream, Flow, virtual_time
from test_evictions_seen import POLICY
from test_telemetry import by_label, parse_text

from llamaswap.adapters.admin import queue_document
from llamaswap.commands.queue import render
from llamaswap.core import ManualClock, Outcome
from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.observer import IdleUnloaded
from llamaswap.telemetry import Telemetry
from llamaswap.telemetry import instruments as names
from llamaswap.runtime.upstream import Catalog, UpstreamKind

MODELS = ("a", "b", "p")


def router(*loaded: str, kind: UpstreamKind = UpstreamKind.ROUTER) -> Catalog:
    return Catalog(kind, frozenset(MODELS), frozenset(loaded), True)


def idle_flow(upstream: FakeUpstream, *, ttl_s: float = 30.0, **models: dict) -> Flow:
    """One GPU keeping up to three models, idle unloads after ``ttl_s``, with what the
    upstream says loaded accepted."""
    flow = Flow({"upstream": {"maxLoaded": 3, "idleUnloadSeconds": ttl_s}, "envoy": {"leaseSeconds": 1000},
                 "models": dict(models)}, upstream=upstream)
    scheduler = flow.coordinator.scheduler
    assert upstream.catalog_answer is not None
    flow.coordinator.observe_catalog(upstream.catalog_answer, scheduler.dispatches_on("gpu0"), "gpu0")
    return flow


def idle_unloads(flow: Flow) -> list[tuple[str, str, float]]:
    return [(event.gpu, event.model, event.after_s) for name, event in flow.recorder.events
            if name == "idle_unloaded" and isinstance(event, IdleUnloaded)]


@virtual_time
async def test_a_model_idle_past_its_ttl_is_unloaded_and_its_next_request_loads_it() -> None:
    upstream = FakeUpstream(router("a"))
    flow = idle_flow(upstream, ttl_s=30.0)
    a1 = await flow.arrive("a1", model="a")
    assert a1.granted and not a1.ticket.decision.model_load  # type: ignore[union-attr]
    await flow.advance(5.0)
    await flow.complete(a1)  # idle from here: due 30 s later
    await flow.advance(29.9)
    assert upstream.unload_calls == [] and flow.coordinator.scheduler.residents_on("gpu0") == {"a"}
    await flow.advance(0.1)
    assert upstream.unload_calls == ["a"]
    assert idle_unloads(flow) == [("gpu0", "a", 30.0)]
    assert flow.coordinator.scheduler.residents_on("gpu0") == frozenset()
    a2 = await flow.arrive("a2", model="a")
    assert a2.granted and a2.ticket.decision.model_load  # type: ignore[union-attr]
    await flow.complete(a2)
    assert flow.recorder.outcomes() == {"a1": Outcome.SERVED, "a2": Outcome.SERVED}


@virtual_time
async def test_a_request_during_the_unload_waits_for_it_then_loads() -> None:
    upstream = FakeUpstream(router("a"))
    upstream.unload_gate = asyncio.Event()
    flow = idle_flow(upstream, ttl_s=10.0)
    await flow.advance(10.0)  # counted resident at 0, never used: due at 10
    assert upstream.unload_calls == ["a"]
    a1 = await flow.arrive("a1", model="a")
    assert a1.waiting  # granted as a load, held until the unload under way has ended
    upstream.unload_gate.set()
    await flow.idle()
    assert a1.granted and a1.ticket.decision.model_load  # type: ignore[union-attr]
    await flow.complete(a1)
    assert flow.recorder.outcomes() == {"a1": Outcome.SERVED}


@virtual_time
async def test_a_request_waiting_or_arriving_before_due_keeps_the_model() -> None:
    upstream = FakeUpstream(router("a", "b"))
    flow = idle_flow(upstream, ttl_s=10.0)
    a1 = await flow.arrive("a1", model="a")
    await flow.advance(9.0)
    a2 = await flow.arrive("a2", model="a")  # waits behind a1 (one slot)
    await flow.advance(20.0)
    assert upstream.unload_calls == ["b"]  # b sat idle; a ran, then was waited for
    await flow.complete(a1)
    assert a2.granted
    await flow.advance(9.0)
    await flow.complete(a2)
    await flow.advance(9.9)
    assert upstream.unload_calls == ["b"]
    await flow.advance(0.1)
    assert upstream.unload_calls == ["b", "a"]


@virtual_time
async def test_a_pinned_model_stays() -> None:
    upstream = FakeUpstream(router("a", "p"))
    flow = idle_flow(upstream, ttl_s=5.0, p={"pinned": True})
    await flow.advance(3600.0)
    assert upstream.unload_calls == ["a"]
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"p"}


@virtual_time
async def test_a_failed_unload_is_tried_again_an_idle_time_later() -> None:
    upstream = FakeUpstream(router("a"))
    upstream.unloads = False
    flow = idle_flow(upstream, ttl_s=10.0)
    await flow.advance(10.0)
    assert upstream.unload_calls == ["a"]
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"a"}  # counted again
    await flow.advance(9.9)
    assert upstream.unload_calls == ["a"]
    await flow.advance(0.1)
    assert upstream.unload_calls == ["a", "a"]


@virtual_time
async def test_an_upstream_that_cannot_unload_is_never_asked() -> None:
    upstream = FakeUpstream(router("a", kind=UpstreamKind.LLAMA_SWAP))
    flow = idle_flow(upstream, ttl_s=1.0)
    await flow.advance(100.0)
    assert upstream.unload_calls == [] and idle_unloads(flow) == []
    found = flow.coordinator.scheduler.idle_unloads(frozenset())
    assert [(idle.model, idle.due_ns) for idle in found.idle] == [("a", None)]


@virtual_time
async def test_no_idle_time_arms_nothing() -> None:
    upstream = FakeUpstream(router("a"))
    flow = idle_flow(upstream, ttl_s=0.0)
    await flow.advance(10**6)
    assert upstream.unload_calls == [] and idle_unloads(flow) == []
    found = flow.coordinator.scheduler.idle_unloads()
    assert [(idle.model, idle.due_ns) for idle in found.idle] == [("a", None)] and found.next_ns is None


def test_an_idle_unload_is_an_eviction_with_the_reason_idle_in_the_log_and_the_metric() -> None:
    clock = ManualClock()
    unload = IdleUnloaded("big", "a", 42.5, 30.0, clock.now_ns())
    activity = ActivityLog(clock)
    activity.idle_unloaded(unload)
    [record] = activity.recent(event="eviction")
    assert {key: record[key] for key in ("event", "upstream", "model", "reason", "idle_s", "idle_unload_s")} == {
        "event": "eviction", "upstream": "big", "model": "a", "reason": "idle", "idle_s": 42.5, "idle_unload_s": 30.0}
    telemetry = Telemetry(clock=clock)
    telemetry.settings_changed(POLICY)
    telemetry.idle_unloaded(unload)
    samples = parse_text(telemetry.prometheus_text()[0].decode())
    counts = by_label(samples, names.MODEL_EVICTIONS, "reason", upstream="big")
    assert counts["idle"] == 1 and sum(counts.values()) == 1


@virtual_time
async def test_the_queue_shows_each_idle_models_idle_time_and_when_it_is_unloaded() -> None:
    upstream = FakeUpstream(router("a", "p"))
    flow = idle_flow(upstream, ttl_s=30.0, p={"pinned": True})
    a1 = await flow.arrive("a1", model="a")
    await flow.complete(a1)
    await flow.advance(12.0)
    document = queue_document(flow.coordinator.view())
    assert document["idle"] == [{"upstream": "gpu0", "model": "a", "idle_s": 12.0, "unload_in_s": 18.0},
                                {"upstream": "gpu0", "model": "p", "idle_s": 12.0, "unload_in_s": None}]
    lines = render(document).splitlines()
    assert "  idle a for 0:12, unloaded in 0:18" in lines and "  idle p for 0:12, kept" in lines
    a2 = await flow.arrive("a2", model="a")  # running: not idle
    assert a2.granted
    await flow.advance(1.0)
    assert [row["model"] for row in queue_document(flow.coordinator.view())["idle"]] == ["p"]


@virtual_time
async def test_with_room_for_one_model_the_routers_one_model_is_unloaded_too() -> None:
    upstream = FakeUpstream(router("a"))
    flow = Flow({"upstream": {"idleUnloadSeconds": 5.0}, "envoy": {"leaseSeconds": 1000}}, upstream=upstream)
    flow.coordinator.observe_catalog(router("a"), flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    b1 = await flow.arrive("b1", model="b")  # replaces a (room for one): nothing unloaded first
    assert b1.granted and upstream.unload_calls == []
    await flow.complete(b1)
    await flow.advance(5.0)
    assert upstream.unload_calls == ["b"] and flow.coordinator.scheduler.residents_on("gpu0") == frozenset()
    b2 = await flow.arrive("b2", model="b")
    assert b2.granted and b2.ticket.decision.model_load  # type: ignore[union-attr]
