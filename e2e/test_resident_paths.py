"""Several resident models (issue 37) on every path that is not a plain generation, through the
real Envoy and sidecar in front of the fake llama-server router with `--models-max 2` and
`maxLoaded: 2` (three models): loads by query, the management API on the public port, error
answers, clients that leave while waiting for an eviction's unload or while running, the settle
after an abandoned generation, and a reload. (A restart and a refused unload:
e2e/test_resident_models.py.)

On each path the router never evicts by itself (`evicted` stays empty: llamaswap made room
first), never holds more than two models, and never gets an unload of a model that computes;
llamaswap's own unloads are the fake's `unloads`.
"""

from __future__ import annotations

import asyncio
import pathlib
import signal
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from client import chat, start_blocker
from fake_llama import LOADED, FakeLlamaServer, UpstreamHit
from harness import activity_records, async_wait_for, merge, running_stack
from test_gpus_paths import _send
from test_resident_models import MODELS, config, loads, resident

MAX_LOADED = 2


class WatchedRouter(FakeLlamaServer):
    """The router with `--models-max 2` that also records the most models it ever held and each
    unload that reached it while its model computed (it ends that model's work)."""

    def __init__(self) -> None:
        super().__init__(router=True, models=MODELS, models_max=MAX_LOADED)
        self.most_resident = 0
        self.busy_unloads: list[tuple[str, int]] = []

    def _load(self, model: str, state: str = LOADED) -> None:
        super()._load(model, state)
        self.most_resident = max(self.most_resident, len(resident(self)))

    async def _unload_request(self, request: web.Request) -> web.Response:
        computing = {name: count for name, count in self.computing.items() if count}
        before = len(self.unloads)
        response = await super()._unload_request(request)
        for model in self.unloads[before:]:
            if model in computing:
                self.busy_unloads.append((model, computing[model]))
        return response


def invariants(fake: WatchedRouter) -> None:
    assert fake.evicted == [], "the router evicted by itself"
    assert fake.most_resident <= MAX_LOADED
    assert fake.busy_unloads == [], "a model that computed was unloaded"


def hits(fake: FakeLlamaServer) -> dict[str, UpstreamHit]:
    with fake.lock:
        return {hit.test_id: hit for hit in fake.hits}


async def waiting(stack: Any, test_id: str) -> None:
    await async_wait_for(lambda: test_id in {w["request_id"] for w in stack.sidecar.queue()["waiting"]},
                         what=f"{test_id} waiting in the sidecar")


async def a_and_b_resident(stack: Any, session: aiohttp.ClientSession) -> None:
    """model-a then model-b served: both resident, idle, model-a the least recently used."""
    for name, model in (("a0", "model-a"), ("b0", "model-b")):
        assert (await chat(session, stack.url, name, model=model)).status == 200
    assert resident(stack.upstream) == {"model-a", "model-b"}


async def gpu_view(stack: Any) -> dict[str, Any]:
    return stack.sidecar.queue()["gpus"][0]


# -- 1. a load by query ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/props?model=model-c", "/slots?model=model-c"])
async def test_a_query_that_loads_a_third_model_evicts_the_idle_lru_one_first(tmp_path: pathlib.Path,
                                                                              path: str) -> None:
    """A client's `GET /props?model=model-c` (or `/slots`), without autoload=false, loads model-c
    in the router: with model-a and model-b resident and idle, llamaswap unloads model-a (the
    least recently used) explicitly before the query reaches the router."""
    fake = WatchedRouter()
    with running_stack(tmp_path, config(MAX_LOADED), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            reply = await _send(session, "GET", stack.url + path, "query")
            after = await chat(session, stack.url, "c1", model="model-c")
            b1 = await chat(session, stack.url, "b1", model="model-b")
            gpu = await gpu_view(stack)
        assert reply.status == 200, reply.body
        assert hits(fake)["query"].loaded  # the query itself loaded model-c
        assert fake.unloads == ["model-a"]
        assert (after.status, b1.status) == (200, 200)
        assert not hits(fake)["c1"].loaded and not hits(fake)["b1"].loaded  # both stayed resident
        assert resident(fake) == {"model-b", "model-c"}
        assert gpu["resident_models"] == ["model-b", "model-c"]
        invariants(fake)


# -- 2. the management API through the public port -----------------------------------------------

SCHEDULED = merge(config(MAX_LOADED), {"upstream": {"managementApi": "schedule"}})


async def test_a_management_load_of_a_third_model_evicts_the_idle_lru_one_first(tmp_path: pathlib.Path) -> None:
    fake = WatchedRouter()
    fake.load_takes_looks = 1  # listed `loading` until the next GET /v1/models
    with running_stack(tmp_path, SCHEDULED, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            reply = await _send(session, "POST", f"{stack.url}/models/load", "load", {"model": "model-c"})
            c1 = await chat(session, stack.url, "c1", model="model-c")
            b1 = await chat(session, stack.url, "b1", model="model-b")
        assert reply.status == 200, reply.body
        assert fake.loads == ["model-c"] and fake.unloads == ["model-a"]
        assert hits(fake)["load"].start_ns < hits(fake)["c1"].start_ns
        assert (c1.status, b1.status) == (200, 200) and not hits(fake)["b1"].loaded
        assert resident(fake) == {"model-b", "model-c"}
        invariants(fake)


async def test_a_management_unload_does_not_cut_the_stream_of_another_resident_model(
        tmp_path: pathlib.Path) -> None:
    """`POST /models/unload {"model": "model-a"}` while model-b streams. What the product does
    today: an unload runs alone (`managementApi: schedule`), so with several resident it waits for
    the whole GPU to drain, model-b's stream included, though model-a runs nothing; it never cuts
    model-b's stream, and it unloads only model-a."""
    fake = WatchedRouter()
    with running_stack(tmp_path, SCHEDULED, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            stream = await start_blocker(stack, session, "b-stream", model="model-b", stream=True,
                                         extra_headers={"x-test-chunks": "5", "x-test-chunk-ms": "30"})
            unload = asyncio.create_task(_send(session, "POST", f"{stack.url}/models/unload", "unload",
                                               {"model": "model-a"}))
            await waiting(stack, "unload")  # it waits for the GPU to drain (model-b's stream)
            await asyncio.sleep(0.3)
            assert not unload.done() and fake.unloads == [] and "unload" not in fake.order()
            fake.release("b-stream")
            streamed = await stream
            unloaded = await unload
            b1 = await chat(session, stack.url, "b1", model="model-b")
        assert streamed.status == 200
        assert streamed.body.count(b"data: {") == 5 and streamed.body.rstrip().endswith(b"data: [DONE]")
        assert unloaded.status == 200, unloaded.body
        assert hits(fake)["unload"].start_ns >= hits(fake)["b-stream"].end_ns  # after the drain
        assert fake.unloads == ["model-a"]
        assert b1.status == 200 and not hits(fake)["b1"].loaded  # model-b stayed resident
        assert resident(fake) == {"model-b"}
        invariants(fake)


# -- 3. error answers ------------------------------------------------------------------------------


async def test_an_error_answer_for_one_model_leaves_the_other_resident_and_serving(tmp_path: pathlib.Path) -> None:
    """model-a's requests fail (a 500 after computing, a refused 400 at once) while model-b runs
    (two slots a model): model-b's request runs on, model-b stays resident and serves beside it
    without a load, model-a serves again, and nothing is unloaded."""
    fake = WatchedRouter()
    with running_stack(tmp_path, merge(config(MAX_LOADED), {"upstream": {"slots": 2}}), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            held = await start_blocker(stack, session, "b-held", model="model-b")
            failed = await chat(session, stack.url, "a-fail", model="model-a", extra_headers={"x-test-fail": "1"})
            refused = await chat(session, stack.url, "a-400", model="model-a", extra_headers={"x-test-status": "400"})
            assert not held.done()
            b1 = await asyncio.wait_for(chat(session, stack.url, "b1", model="model-b"), 10)
            a1 = await asyncio.wait_for(chat(session, stack.url, "a1", model="model-a"), 10)
            fake.release("b-held")
            assert (await held).status == 200
            gpu = await gpu_view(stack)
        assert (failed.status, refused.status) == (500, 400)
        assert (b1.status, a1.status) == (200, 200)
        assert not hits(fake)["b1"].loaded and not hits(fake)["a1"].loaded
        assert fake.unloads == [] and loads(fake) == ["a0", "b0"]
        assert gpu["resident_models"] == ["model-a", "model-b"]
        invariants(fake)


# -- 4. clients that leave -------------------------------------------------------------------------


async def test_a_client_that_leaves_while_its_grant_waits_for_an_unload_leaves_nothing_held(
        tmp_path: pathlib.Path) -> None:
    """c1 (model-c) evicts model-a; the router takes its time to list model-a unloaded, and c1's
    client leaves meanwhile. model-b serves at once through it all; the unload runs to its end,
    c1 never reaches the router, and c2 (model-c) then loads beside model-b."""
    fake = WatchedRouter()
    with running_stack(tmp_path, config(MAX_LOADED), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            fake.unload_takes_looks = 10**6  # model-a's process does not exit until the test says
            async with aiohttp.ClientSession() as doomed:
                c1 = asyncio.create_task(chat(doomed, stack.url, "c1", model="model-c"))
                await async_wait_for(lambda: fake.unloads == ["model-a"], what="model-a's unload")
                b1 = await chat(session, stack.url, "b1", model="model-b")  # a resident model that stays
                c1.cancel()
                await asyncio.gather(c1, return_exceptions=True)
            c2 = asyncio.create_task(chat(session, stack.url, "c2", model="model-c"))
            await asyncio.sleep(0.3)
            assert not c2.done(), c2.result()
            assert "c2" not in fake.order()  # it waits for model-a to be gone
            fake.unload_takes_looks = 0  # the process exits: the next GET /v1/models lists it unloaded
            second = await c2
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"c1", "c2"}),
                                           what="the records")
            queue = stack.sidecar.queue()
        assert b1.status == 200 and not hits(fake)["b1"].loaded
        assert second.status == 200 and hits(fake)["c2"].loaded
        assert "c1" not in fake.order()
        assert records["c1"]["outcome"] != "served" and records["c2"]["outcome"] == "served"
        assert fake.unloads == ["model-a"]
        assert resident(fake) == {"model-b", "model-c"}
        assert queue["waiting"] == [] and not queue["running"] and queue["gpus"][0]["slots_busy"] == 0
        invariants(fake)


async def test_a_client_that_leaves_while_running_leaves_its_model_free_to_go(tmp_path: pathlib.Path) -> None:
    """a1's client leaves while it runs; the router finishes it. Nothing of it stays held: model-a
    (then the least recently used) is the one a third model evicts, and model-a's next request
    goes."""
    fake = WatchedRouter()
    with running_stack(tmp_path, config(MAX_LOADED), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            async with aiohttp.ClientSession() as doomed:
                a1 = await start_blocker(stack, doomed, "a1", model="model-a")
                a1.cancel()
                await asyncio.gather(a1, return_exceptions=True)
            fake.release("a1")  # the abandoned generation ends at the router
            await async_wait_for(lambda: fake.finished("a1"), what="a1 finished at the router")
            b1 = await chat(session, stack.url, "b1", model="model-b")
            c1 = await chat(session, stack.url, "c1", model="model-c")
            a2 = await chat(session, stack.url, "a2", model="model-a")
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"a1", "a2"}),
                                           what="the records")
            queue = stack.sidecar.queue()
        assert (b1.status, c1.status, a2.status) == (200, 200, 200)
        assert records["a1"]["outcome"] == "cancelled_running"
        assert fake.unloads == ["model-a", "model-b"]  # each the idle least recently used one
        assert resident(fake) == {"model-a", "model-c"}
        assert queue["waiting"] == [] and not queue["running"] and queue["gpus"][0]["slots_busy"] == 0
        invariants(fake)


# -- 5. the settle after an abandoned generation ---------------------------------------------------


async def test_a_settle_after_an_abandoned_generation_holds_only_its_models_slot(tmp_path: pathlib.Path) -> None:
    """a1's client leaves mid-stream (held before its first event); the router keeps computing it,
    as llama-server does. The settle holds model-a only: a2 (model-a) waits, but b1 (model-b,
    resident) starts at once beside it."""
    fake = WatchedRouter()
    fake.model_slots = {"model-a": 1, "model-b": 1}
    with running_stack(tmp_path, merge(config(MAX_LOADED), {"upstream": {"abandonedGeneration": "wait"}}),
                       fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            async with aiohttp.ClientSession() as doomed:
                a1 = await start_blocker(stack, doomed, "a1", model="model-a", stream=True)
                a1.cancel()
                await asyncio.gather(a1, return_exceptions=True)
            await async_wait_for(lambda: stack.sidecar.queue()["gpus"][0]["state"] == "settling", what="the settle")
            a2 = asyncio.create_task(chat(session, stack.url, "a2", model="model-a"))
            try:
                await waiting(stack, "a2")
                b1 = await asyncio.wait_for(chat(session, stack.url, "b1", model="model-b"), 5)
                assert not a2.done() and "a2" not in fake.order()
                fake.release("a1")
                assert (await a2).status == 200
            finally:  # a2 ends here whatever happened (an exception never retrieved is logged late)
                a2.cancel()
                await asyncio.gather(a2, return_exceptions=True)
        assert b1.status == 200 and not hits(fake)["b1"].loaded
        assert hits(fake)["b1"].start_ns < hits(fake)["a1"].end_ns  # beside the abandoned generation
        assert hits(fake)["a2"].start_ns >= hits(fake)["a1"].end_ns
        assert fake.unloads == []
        invariants(fake)


# -- 6. a reload -----------------------------------------------------------------------------------

SIZED = merge(config(MAX_LOADED), {"upstream": {"memory": "20GiB"},
                                   "models": {model: {"memory": "8GiB"} for model in MODELS}})


async def test_a_reload_that_shrinks_the_budget_keeps_serving_and_never_unloads_a_busy_model(
        tmp_path: pathlib.Path) -> None:
    """model-a runs and model-b is resident when the file changes to `memory: 12GiB` (one model of
    8 GiB fits) and `maxLoaded: 3` (kept until a restart). model-a's request runs on to its end,
    model-b's requests are served, and model-c waits for room: it goes once model-a is idle, and
    then no more than the budget is resident."""
    fake = WatchedRouter()
    with running_stack(tmp_path, SIZED, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            await a_and_b_resident(stack, session)
            held = await start_blocker(stack, session, "a-held", model="model-a")
            document = yaml.safe_load(stack.config_path.read_text())
            stack.config_path.write_text(yaml.safe_dump(merge(document, {"upstream": {"memory": "12GiB",
                                                                                      "maxLoaded": 3}})))
            stack.sidecar.signal(signal.SIGHUP)
            await async_wait_for(lambda: "configuration reloaded" in stack.sidecar.log(), what="the reload")
            b1 = await chat(session, stack.url, "b1", model="model-b")
            c1 = asyncio.create_task(chat(session, stack.url, "c1", model="model-c"))
            await waiting(stack, "c1")
            await asyncio.sleep(0.3)
            assert not held.done() and not c1.done() and "c1" not in fake.order()
            assert "model-a" not in fake.unloads
            fake.release("a-held")
            assert (await held).status == 200
            assert (await c1).status == 200
            gpu = await gpu_view(stack)
        assert b1.status == 200
        assert "upstream.maxLoaded" in stack.sidecar.log()  # named as kept until a restart
        assert sorted(fake.unloads) == ["model-a", "model-b"]
        assert resident(fake) == {"model-c"} and gpu["resident_models"] == ["model-c"]
        assert gpu["max_loaded"] == MAX_LOADED
        invariants(fake)
