"""Ollama's keep_alive in the runtime (issue 48) on the fake clock (tests/flow.py): the body's
field read by the ext_authz servicer, the model's unload begun as its request ends (keep_alive 0),
nothing with routing.keepAlive.honour off, a bad value served as if absent."""

from __future__ import annotations

import logging

import pytest

from flow import FakeUpstream, Flow, Request, check_request, virtual_time
from test_idle_runtime import idle_unloads, router

from llamaswap.core import Outcome


def keep_alive_flow(upstream: FakeUpstream, *, honour: bool, ttl_s: float = 600.0,
                    max_seconds: float | None = None) -> Flow:
    flow = Flow({"upstream": {"maxLoaded": 3, "idleUnloadSeconds": ttl_s}, "envoy": {"leaseSeconds": 1000},
                 "routing": {"keepAlive": {"honour": honour, "maxSeconds": max_seconds}}}, upstream=upstream)
    assert upstream.catalog_answer is not None
    flow.coordinator.observe_catalog(upstream.catalog_answer, flow.coordinator.scheduler.dispatches_on("gpu0"), "gpu0")
    return flow


async def arrive(flow: Flow, request_id: str, model: str, keep_alive: str | float | None) -> Request:
    """A held Check whose body has ``model`` and ``keep_alive`` (None: no such field)."""
    request = check_request({"x-request-id": request_id}, model=model)
    if keep_alive is not None:
        value = request.attributes.metadata_context.filter_metadata["llamaswap"].fields["keep_alive"]
        if isinstance(keep_alive, str):
            value.string_value = keep_alive
        else:
            value.number_value = keep_alive
    return await flow.check(request)


@virtual_time
async def test_keep_alive_zero_unloads_the_model_as_its_request_ends() -> None:
    upstream = FakeUpstream(router("a", "b"))
    flow = keep_alive_flow(upstream, honour=True, ttl_s=60.0)
    a1 = await arrive(flow, "a1", "a", 0)
    assert a1.granted and a1.ticket.keep_alive_s == 0.0
    await flow.advance(5.0)
    assert upstream.unload_calls == []  # it runs: not idle
    await flow.complete(a1)
    assert upstream.unload_calls == ["a"]  # at its end, no time passing
    assert idle_unloads(flow) == [("gpu0", "a", 0.0)]
    assert flow.coordinator.scheduler.residents_on("gpu0") == {"b"}  # b, idle 5 s of its 60, stays
    a2 = await arrive(flow, "a2", "a", None)
    assert a2.granted and a2.ticket.decision.model_load  # type: ignore[union-attr]  # the next is a load
    await flow.advance(10.0)
    await flow.complete(a2)  # at 15 s
    await flow.advance(45.0)
    assert upstream.unload_calls == ["a", "b"]  # b's 60 s since the start
    await flow.advance(14.0)
    assert upstream.unload_calls == ["a", "b"]  # a request without keep_alive: the configured 60 s again
    await flow.advance(1.0)
    assert upstream.unload_calls == ["a", "b", "a"]
    assert flow.recorder.outcomes() == {"a1": Outcome.SERVED, "a2": Outcome.SERVED}


@virtual_time
async def test_keep_alive_zero_waits_while_a_request_waits_for_the_model() -> None:
    upstream = FakeUpstream(router("a"))
    flow = keep_alive_flow(upstream, honour=True, ttl_s=60.0)
    a1 = await arrive(flow, "a1", "a", "0s")
    a2 = await arrive(flow, "a2", "a", "10m")  # waits behind a1 (one slot)
    assert a1.granted and a2.waiting
    await flow.complete(a1)
    assert a2.granted and upstream.unload_calls == []  # a2 took it over: its 10 minutes say now
    await flow.complete(a2)
    await flow.advance(599.0)
    assert upstream.unload_calls == []  # (past the configured 60 s)
    await flow.advance(1.0)
    assert upstream.unload_calls == ["a"]


@virtual_time
async def test_with_honour_off_keep_alive_changes_nothing() -> None:
    upstream = FakeUpstream(router("a"))
    flow = keep_alive_flow(upstream, honour=False)
    a1 = await arrive(flow, "a1", "a", 0)
    assert a1.granted and a1.ticket.keep_alive_s is None  # not even read
    await flow.complete(a1)
    await flow.advance(599.0)
    assert upstream.unload_calls == []
    await flow.advance(1.0)
    assert upstream.unload_calls == ["a"]  # the configured idle time


@virtual_time
async def test_a_negative_keep_alive_keeps_the_model_up_to_max_seconds() -> None:
    upstream = FakeUpstream(router("a"))
    flow = keep_alive_flow(upstream, honour=True, ttl_s=60.0, max_seconds=3600.0)
    a1 = await arrive(flow, "a1", "a", -1)
    await flow.complete(a1)
    await flow.advance(3599.0)
    assert upstream.unload_calls == []  # kept past its 60 s
    await flow.advance(1.0)
    assert upstream.unload_calls == ["a"]
    assert idle_unloads(flow) == [("gpu0", "a", 3600.0)]


@virtual_time
async def test_a_bad_keep_alive_is_served_as_if_absent_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    upstream = FakeUpstream(router("a"))
    flow = keep_alive_flow(upstream, honour=True, ttl_s=60.0)
    caplog.set_level(logging.DEBUG, logger="llamaswap.adapters.ext_authz")
    a1 = await arrive(flow, "a1", "a", "five minutes")
    assert a1.granted and a1.ticket.keep_alive_s is None
    await flow.complete(a1)
    await flow.advance(59.0)
    assert upstream.unload_calls == []
    await flow.advance(1.0)
    assert upstream.unload_calls == ["a"]
    assert flow.recorder.outcomes() == {"a1": Outcome.SERVED}
    [warning] = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert "'five minutes' is not a duration" in warning.getMessage() and "a1" in warning.getMessage()
