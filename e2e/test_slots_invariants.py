"""Slots keep one model at the upstream whatever happens, through the real Envoy and sidecar with
the fake upstream (issue 25): a request that loads or unloads a model by its query or its
management body is scheduled as what it loads or unloads; a refused request leaves its model
loaded; a waiting request that leaves or expires lets the work it held back start at once."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp
import pytest

from client import Reply, chat, start_blocker
from fake_llama import FakeLlamaServer
from harness import activity_records, async_wait_for, http_get, running_stack

# No lease timer fires during a test: only the event under test can re-run the grant decision.
LONG_LEASE = {"leaseSeconds": 600}
SLOTS_2 = {"upstream": {"slots": 2}, "envoy": LONG_LEASE}


async def _send(session: aiohttp.ClientSession, method: str, url: str, test_id: str,
                document: dict[str, Any] | None = None) -> Reply:
    headers = {"x-test-id": test_id, "x-request-id": test_id}
    async with session.request(method, url, json=document, headers=headers) as response:
        return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, await response.read())


def _waiting(stack: Any) -> list[str]:
    return [row["request_id"] for row in stack.sidecar.queue()["waiting"]]


def _running(stack: Any) -> list[str]:
    return [row["request_id"] for row in stack.sidecar.queue()["running_all"]]


async def _seen(stack: Any, test_id: str) -> None:
    """Until `test_id` is either waiting in the sidecar or at the upstream (whichever it is)."""
    await async_wait_for(lambda: test_id in _waiting(stack) or test_id in stack.upstream.order(),
                         what=f"{test_id} waiting or at the upstream")


@pytest.mark.parametrize("path", ["/props?model=model-b", "/slots?model=model-b"])
async def test_a_query_that_loads_a_model_is_scheduled_as_that_model(tmp_path: pathlib.Path, path: str) -> None:
    """Router-mode llama-server loads the model a GET's ?model= names: it waits for model-a's
    generations like a request for model-b, and runs alone there."""
    fake = FakeLlamaServer(router=True, loaded="model-a", slots=2)
    with running_stack(tmp_path, SLOTS_2, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            a1 = await start_blocker(stack, session, "a1", model="model-a")
            query = asyncio.create_task(_send(session, "GET", stack.url + path, "query"))
            await _seen(stack, "query")
            assert "query" not in fake.order()  # not beside a1: it would load model-b under it
            assert _waiting(stack) == ["query"]
            fake.release("a1")
            replies = [await a1, await query]
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"a1", "query"}),
                                           what="both records")
        assert [reply.status for reply in replies] == [200, 200]
        hits = {hit.test_id: hit for hit in fake.hits}
        assert hits["query"].loaded and hits["query"].start_ns >= hits["a1"].end_ns
        assert (records["query"]["model"], records["query"]["swap"]) == ("model-b", True)


async def test_metrics_with_a_model_query_is_the_schedulers_own(tmp_path: pathlib.Path) -> None:
    """`/metrics?model=X` on Envoy's port is the sidecar's metrics: it never reaches (or loads at)
    the upstream, so it has nothing to be scheduled as."""
    fake = FakeLlamaServer(router=True, loaded="model-a", slots=2)
    with running_stack(tmp_path, SLOTS_2, fake=fake) as stack:
        status, body = http_get(f"{stack.url}/metrics?model=model-b")
        assert status == 200 and b"llamaswap_" in body
        assert fake.metrics_asked == [] and fake.states["model-b"] == "unloaded"


async def test_an_unload_waits_for_its_models_generations_and_runs_alone(tmp_path: pathlib.Path) -> None:
    """upstream.managementApi: schedule. `POST /models/unload {"model": "model-a"}` would end
    model-a's running generation: it waits until that has ended, and the model-a request behind
    it waits for the unload."""
    fake = FakeLlamaServer(router=True, loaded="model-a", slots=2)
    config = {**SLOTS_2, "upstream": {"slots": 2, "managementApi": "schedule"}}
    with running_stack(tmp_path, config, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            a1 = await start_blocker(stack, session, "a1", model="model-a")
            unload = asyncio.create_task(_send(session, "POST", f"{stack.url}/models/unload", "unload",
                                               {"model": "model-a"}))
            await _seen(stack, "unload")
            assert "unload" not in fake.order()
            a2 = asyncio.create_task(chat(session, stack.url, "a2", model="model-a"))
            await _seen(stack, "a2")
            assert _waiting(stack) == ["unload", "a2"] and _running(stack) == ["a1"]
            fake.release("a1")
            replies = [await a1, await unload, await a2]
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"unload", "a2"}),
                                           what="the records")
        assert [reply.status for reply in replies] == [200, 200, 200]  # a1 was not cut by the unload
        hits = {hit.test_id: hit for hit in fake.hits}
        assert hits["a1"].end_ns <= hits["unload"].start_ns
        assert hits["unload"].end_ns <= hits["a2"].start_ns
        assert records["a2"]["load"]  # model-a was unloaded: a2 loaded it again


async def test_a_load_of_another_model_waits_like_a_swap(tmp_path: pathlib.Path) -> None:
    """upstream.managementApi: schedule. `POST /models/load {"model": "model-b"}` is a request
    for model-b: it waits for model-a's generations (this one held already on main: the body
    names the model)."""
    fake = FakeLlamaServer(router=True, loaded="model-a", slots=2)
    config = {**SLOTS_2, "upstream": {"slots": 2, "managementApi": "schedule"}}
    with running_stack(tmp_path, config, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            a1 = await start_blocker(stack, session, "a1", model="model-a")
            load = asyncio.create_task(_send(session, "POST", f"{stack.url}/models/load", "load", {"model": "model-b"}))
            await _seen(stack, "load")
            assert "load" not in fake.order()
            fake.release("a1")
            replies = [await a1, await load]
        assert [reply.status for reply in replies] == [200, 200]
        hits = {hit.test_id: hit for hit in fake.hits}
        assert hits["load"].loaded and hits["a1"].end_ns <= hits["load"].start_ns


@pytest.mark.parametrize(("router", "status"), [(True, 400), (True, 404), (False, 400), (False, 500)])
async def test_a_refused_request_leaves_its_model_loaded(tmp_path: pathlib.Path, router: bool, status: int) -> None:
    """A 4xx says nothing about the model, and a single-model upstream's one model stays loaded
    even after a 5xx: the next same-model request takes the free slot beside the running one,
    and its record does not call it a load (the swap-cost estimates learn from that)."""
    fake = FakeLlamaServer(router=router, loaded="model-a" if router else None, slots=2)
    with running_stack(tmp_path, SLOTS_2, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            a1 = await start_blocker(stack, session, "a1", model="model-a")
            refused = await chat(session, stack.url, "refused", model="model-a",
                                 extra_headers={"x-test-status": str(status)})
            assert refused.status == status
            # Its release reached the sidecar (the record is written at the end of the exchange).
            await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"refused"}), what="its record")
            a2 = asyncio.create_task(chat(session, stack.url, "a2", model="model-a", hold=True))
            await _seen(stack, "a2")
            assert "a2" in fake.order() and _running(stack) == ["a1", "a2"]
            fake.release("a1")
            fake.release("a2")
            replies = [await a1, await a2]
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"a2"}),
                                           what="a2's record")
        assert [reply.status for reply in replies] == [200, 200]
        assert (records["a2"]["load"], records["a2"]["swap"]) == (False, False)


@pytest.mark.parametrize("leaves", ["cancelled", "expired"])
async def test_a_waiting_swap_that_leaves_lets_the_loaded_models_work_start(tmp_path: pathlib.Path,
                                                                            leaves: str) -> None:
    """The best waiting request needs a swap, so model-a's request behind it waits; when the
    swap's client leaves (or its maxWaitSeconds passes), a2 takes the free slot at once, not at
    the next release or lease tick."""
    fake = FakeLlamaServer(router=True, loaded="model-a", slots=2)
    config = {**SLOTS_2, "routing": {"scheduler": {"maxWaitSeconds": 3 if leaves == "expired" else 0}}}
    with running_stack(tmp_path, config, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            a1 = await start_blocker(stack, session, "a1", model="model-a")
            b = asyncio.create_task(chat(session, stack.url, "b", priority="interactive", model="model-b"))
            await async_wait_for(lambda: _waiting(stack) == ["b"], what="b waits for a swap")
            a2 = asyncio.create_task(chat(session, stack.url, "a2", model="model-a", hold=True))
            await async_wait_for(lambda: _waiting(stack) == ["b", "a2"], what="a2 waits behind b")
            if leaves == "cancelled":
                b.cancel()
            else:
                assert (await b).status == 503
            record = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"b"}), what="b's end")
            assert record["b"]["outcome"] == ("cancelled_waiting" if leaves == "cancelled" else "expired")
            # b's end re-ran the grant decision before its record was written.
            assert _running(stack) == ["a1", "a2"]
            await async_wait_for(lambda: "a2" in fake.order(), what="a2 at the upstream")
            assert not fake.finished("a1")
            fake.release("a1")
            fake.release("a2")
            replies = [await a1, await a2]
        assert [reply.status for reply in replies] == [200, 200]
        assert "b" not in fake.order()
