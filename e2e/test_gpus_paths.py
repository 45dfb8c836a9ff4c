"""Over two GPUs (issue 27), the requests that load or unload a model without a generation's
body, through the real Envoy and the real sidecar, with two router-mode fakes as `upstreams:`
gpu0 and gpu1 (e2e/test_slots_invariants.py has the same paths on one upstream):

- a query that names a model (`GET /props?model=X`, `/slots?model=X`) or a `POST /models/load`
  is scheduled as a request for X: it goes to exactly the GPU its grant names, only once that
  GPU has drained (never beside another model's work), X then counts as loaded there, and X's
  next generation goes there without a load; `autoload=false` names no model;
- `POST /models/unload` (`managementApi: schedule`) goes to the GPU that has the model, though
  the other one is idle, runs alone there while the other serves, and leaves that GPU empty.

What ran where is read from the fakes' own records; requests are held at the fakes
(`x-test-hold`) while a test looks.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp
import pytest

from client import Reply, chat
from fake_llama import FakeLlamaServer, UpstreamHit
from gpu_stack import running_node
from harness import activity_records, async_wait_for
from test_gpus import CHEAP_SWAPS, _at, _waiting, completions, entries, one_model_at_a_time, two_fakes

SCHEDULED_MANAGEMENT = {**CHEAP_SWAPS, "upstream": {**CHEAP_SWAPS["upstream"], "managementApi": "schedule"}}


async def _send(session: aiohttp.ClientSession, method: str, url: str, test_id: str,
                document: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Reply:
    sent = {"x-test-id": test_id, "x-request-id": test_id, **(headers or {})}
    async with session.request(method, url, json=document, headers=sent) as response:
        return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, await response.read())


def _hits(fake: FakeLlamaServer) -> dict[str, UpstreamHit]:
    with fake.lock:
        return {hit.test_id: hit for hit in fake.hits}


QUERIES = {
    "props": ("GET", "/props?model=model-c", None),
    "slots": ("GET", "/slots?model=model-c", None),
    "load": ("POST", "/models/load", {"model": "model-c"}),
}


@pytest.mark.parametrize("kind", list(QUERIES))
async def test_a_query_that_loads_a_model_goes_to_the_gpu_that_drained_for_it(tmp_path: pathlib.Path,
                                                                             kind: str) -> None:
    """gpu0 has model-a and runs a1, gpu1 has model-b and runs b1 (one slot each). A query for
    model-c waits; when a1 ends, gpu0 is idle and takes it, loading model-c there and only there,
    while b1 still runs on gpu1. Its client's own x-llamaswap-upstream: gpu1 changes nothing.
    Then model-c counts as loaded on gpu0, and c2 (model-c) goes there without a load."""
    method, path, document = QUERIES[kind]
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1), SCHEDULED_MANAGEMENT) as node:
        async with aiohttp.ClientSession() as session:
            a1 = asyncio.create_task(chat(session, node.url, "a1", model="model-a", hold=True))
            b1 = asyncio.create_task(chat(session, node.url, "b1", model="model-b", hold=True))
            await _at(gpu0, "a1")
            await _at(gpu1, "b1")
            query = asyncio.create_task(_send(session, method, node.url + path, "query", document,
                                              {"x-llamaswap-upstream": "gpu1"}))
            await _waiting(node, "query")
            assert "query" not in gpu0.order() + gpu1.order()  # not beside a1 or b1
            gpu0.release("a1")
            assert (await a1).status == 200
            reply = await query
            assert reply.status == 200, reply.body
            assert not gpu1.finished("b1") and gpu1.active == 1  # gpu1 served on meanwhile
            assert node.gpus("resident_models") == {"gpu0": ["model-c"], "gpu1": ["model-b"]}

            c2 = await chat(session, node.url, "c2", model="model-c")
            gpu1.release("b1")
            assert [c2.status, (await b1).status] == [200, 200]
            records = await async_wait_for(
                lambda: activity_records(node.sidecar.admin_url, {"query", "c2"}), what="the records")
        hits = _hits(gpu0)
        assert "query" not in gpu1.order() and "c2" not in gpu1.order()
        assert hits["query"].loaded and hits["query"].start_ns >= hits["a1"].end_ns
        # A POST /models/load answers at once and leaves the model loading: c2 is the first
        # completion to find it ready (the fake says it waited for a load), but no other load ran.
        assert hits["c2"].loaded is (kind == "load") and hits["c2"].start_ns >= hits["query"].end_ns
        assert gpu0.states["model-c"] == "loaded"
        assert (records["query"]["model"], records["query"]["upstream"]) == ("model-c", "gpu0")
        assert (records["c2"]["upstream"], records["c2"]["swap"]) == ("gpu0", False)
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)


async def test_a_query_with_autoload_false_names_no_model_and_starts_beside_the_work(
        tmp_path: pathlib.Path) -> None:
    """Two slots each; a1 runs on gpu0 (model-a), b1 on gpu1 (model-b). `GET /slots?model=model-c
    &autoload=false` loads nothing, so it is scheduled on no model: it starts at once in a free
    slot, beside the running work, and nothing loads anywhere. (`GET /props` in that form skips
    the queue altogether: Envoy's route sends it to the first upstream, as before there were
    several.)"""
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, slots=2), CHEAP_SWAPS) as node:
        async with aiohttp.ClientSession() as session:
            a1 = asyncio.create_task(chat(session, node.url, "a1", model="model-a", hold=True))
            b1 = asyncio.create_task(chat(session, node.url, "b1", model="model-b", hold=True))
            await _at(gpu0, "a1")
            await _at(gpu1, "b1")
            reply = await _send(session, "GET", node.url + "/slots?model=model-c&autoload=false", "query")
            # Answered while a1 and b1 still run: it waited for neither.
            assert gpu0.active == 1 and gpu1.active == 1
            gpu0.release("a1")
            gpu1.release("b1")
            assert [(await a1).status, (await b1).status] == [200, 200]
            records = await async_wait_for(lambda: activity_records(node.sidecar.admin_url, {"query"}),
                                           what="the query's record")
        # The fake answers a model it has not loaded with an error, as llama-server does; what
        # matters is that nothing loaded and nothing waited.
        assert reply.status in (200, 400, 404), reply.body
        assert records["query"]["model"] is None and not records["query"]["swap"]
        assert gpu0.states["model-c"] == gpu1.states["model-c"] == "unloaded"
        assert (gpu0.states["model-a"], gpu1.states["model-b"]) == ("loaded", "loaded")
        assert not any(hit.loaded for fake in (gpu0, gpu1) for hit in _hits(fake).values())


async def test_an_unload_goes_to_the_gpu_with_the_model_and_runs_alone_while_the_other_serves(
        tmp_path: pathlib.Path) -> None:
    """gpu0 has model-a and runs a1; gpu1 has model-b and is idle. `POST /models/unload
    {"model": "model-a"}` waits for a1 on gpu0 (not on the idle gpu1, which has no model-a to
    unload); b1 meanwhile runs on gpu1 at once. a2 (model-a), sent while the unload waits, runs
    after it, loading model-a again on gpu0."""
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1), SCHEDULED_MANAGEMENT) as node:
        async with aiohttp.ClientSession() as session:
            a1 = asyncio.create_task(chat(session, node.url, "a1", model="model-a", hold=True))
            await _at(gpu0, "a1")
            unload = asyncio.create_task(_send(session, "POST", f"{node.url}/models/unload", "unload",
                                               {"model": "model-a"}))
            await _waiting(node, "unload")
            b1 = asyncio.create_task(chat(session, node.url, "b1", model="model-b", hold=True))
            await _at(gpu1, "b1")  # the other GPU serves while gpu0 drains for the unload
            a2 = asyncio.create_task(chat(session, node.url, "a2", model="model-a"))
            await _waiting(node, "a2")
            assert "unload" not in gpu0.order() + gpu1.order()
            gpu0.release("a1")
            replies = [await a1, await unload, await a2]
            assert [reply.status for reply in replies] == [200, 200, 200]
            assert not gpu1.finished("b1")
            gpu1.release("b1")
            assert (await b1).status == 200
            records = await async_wait_for(
                lambda: activity_records(node.sidecar.admin_url, {"unload", "a2"}), what="the records")
            loaded_after = node.gpus("resident_models")
        hits = _hits(gpu0)
        assert "unload" not in gpu1.order() and "a2" not in gpu1.order()
        assert hits["a1"].end_ns <= hits["unload"].start_ns and hits["unload"].end_ns <= hits["a2"].start_ns
        assert hits["a2"].loaded and records["a2"]["load"]  # model-a was gone from gpu0: a2 loaded it
        assert (records["unload"]["upstream"], records["a2"]["upstream"]) == ("gpu0", "gpu0")
        assert loaded_after == {"gpu0": ["model-a"], "gpu1": ["model-b"]}
        assert _hits(gpu1)["b1"].start_ns < hits["unload"].start_ns  # b1 did not wait for the unload
        assert list(completions(gpu1)) == ["b1"]
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
