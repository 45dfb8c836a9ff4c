"""Slots through the real Envoy and the real sidecar, against the fake upstream: same-model
requests run side by side up to upstream.slots, a request for another model waits until every
slot has drained, and `upstream.slots: auto` reads the upstream's /props."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp

from client import chat
from fake_llama import FakeLlamaServer
from harness import async_wait_for, running_stack


async def test_two_at_once_and_a_swap_waits_for_both(tmp_path: pathlib.Path) -> None:
    # A router: its models swap by name (a single-model upstream puts every request on its one model).
    with running_stack(tmp_path, {"upstream": {"slots": 2}}, fake=FakeLlamaServer(slots=2, router=True)) as stack:
        upstream = stack.upstream
        assert upstream is not None
        async with aiohttp.ClientSession() as session:
            a1 = asyncio.create_task(chat(session, stack.url, "a1", hold=True, model="model-a"))
            await async_wait_for(lambda: upstream.active == 1, what="a1 at the upstream")
            a2 = asyncio.create_task(chat(session, stack.url, "a2", hold=True, model="model-a"))
            await async_wait_for(lambda: upstream.active == 2, what="a1 and a2 at the upstream at once")
            b = asyncio.create_task(chat(session, stack.url, "b", priority="interactive", model="model-b"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="b in the queue")
            a3 = asyncio.create_task(chat(session, stack.url, "a3", model="model-a"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="a3 in the queue")
            queue = stack.sidecar.queue()
            assert [row["request_id"] for row in queue["running_all"]] == ["a1", "a2"]
            assert (queue["slots_busy"], queue["slots_total"]) == (2, 2)
            upstream.release("a1")
            assert (await a1).status == 200
            await async_wait_for(lambda: len(stack.sidecar.queue()["running_all"]) == 1, what="a1's grant released")
            # A slot is free, but the best request needs another model: nothing more starts.
            assert upstream.order() == ["a1", "a2"]
            upstream.release("a2")
            replies = [await a2, await b, await a3]
        assert [reply.status for reply in replies] == [200] * 3
        assert upstream.order() == ["a1", "a2", "b", "a3"]
        assert upstream.max_active == 2
        hits = {hit.test_id: hit for hit in upstream.hits}
        assert hits["b"].start_ns >= max(hits["a1"].end_ns, hits["a2"].end_ns)
        assert replies[1].headers["x-llamaswap-band"] == "interactive"


async def test_at_most_slots_at_the_upstream(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"upstream": {"slots": 2}}, fake=FakeLlamaServer(slots=2)) as stack:
        upstream = stack.upstream
        assert upstream is not None
        async with aiohttp.ClientSession() as session:
            replies = await asyncio.gather(*(chat(session, stack.url, f"r{i}", sleep_ms=150, model="model-a")
                                             for i in range(6)))
        assert [reply.status for reply in replies] == [200] * 6
        assert upstream.max_active == 2


async def test_auto_reads_the_upstreams_slots(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"upstream": {"slots": "auto"}}, fake=FakeLlamaServer(slots=3)) as stack:
        await async_wait_for(lambda: stack.sidecar.queue()["slots_total"] == 3, what="3 slots learnt from /props")
        upstream = stack.upstream
        assert upstream is not None
        async with aiohttp.ClientSession() as session:
            held = [asyncio.create_task(chat(session, stack.url, f"h{i}", hold=True, model="model-a"))
                    for i in range(4)]
            await async_wait_for(lambda: upstream.active == 3 and len(stack.sidecar.queue()["waiting"]) == 1,
                                 what="three at the upstream, one waiting")
            for i in range(4):
                upstream.release(f"h{i}")
            replies = await asyncio.gather(*held)
        assert [reply.status for reply in replies] == [200] * 4
        assert upstream.max_active == 3


async def test_an_abandoned_generation_holds_only_its_own_slot(tmp_path: pathlib.Path) -> None:
    """Four slots, two long generations and a short one whose client leaves (the upstream computes
    it on): nothing new starts while it computes, and once it ended the next request goes beside
    the long ones still running. Issue 25: the settle waited until every slot was idle."""
    # A settle that would wait for the whole upstream never ends by its deadline in this test.
    config = {"upstream": {"slots": 4, "settleTimeoutSeconds": 3600}}
    with running_stack(tmp_path, config, fake=FakeLlamaServer(slots=4)) as stack:
        upstream = stack.upstream
        assert upstream is not None
        async with aiohttp.ClientSession() as session:
            long = [asyncio.create_task(chat(session, stack.url, f"long{i}", hold=True)) for i in range(2)]
            await async_wait_for(lambda: upstream.active == 2, what="the two long generations at the upstream")
            short = asyncio.create_task(chat(session, stack.url, "short", hold=True))
            await async_wait_for(lambda: upstream.active == 3, what="the short one at the upstream")
            short.cancel()  # its client leaves; the upstream computes it on
            await async_wait_for(lambda: len(stack.sidecar.queue()["running_all"]) == 2,
                                 what="the short one's grant released (its settle begins)")
            new = asyncio.create_task(chat(session, stack.url, "new"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="new waiting")
            assert "new" not in upstream.order()  # the abandoned generation still takes a slot
            upstream.release("short")
            await async_wait_for(lambda: "new" in upstream.order(), what="new granted beside the long ones")
            assert not any(task.done() for task in long) and not upstream.finished("long0")
            reply = await new
            for i in range(2):
                upstream.release(f"long{i}")
            replies = await asyncio.gather(*long)
        assert reply.status == 200 and [r.status for r in replies] == [200, 200]
        assert upstream.max_active == 3


async def test_auto_learns_the_slots_of_a_model_swapped_in_while_it_runs(tmp_path: pathlib.Path) -> None:
    """Router mode, slots: auto: the model swapped in gets its own slots while its first grant
    runs, without the GPU ever being idle (issue 25: it kept the last model's until then)."""
    fake = FakeLlamaServer(router=True, loaded="model-a")
    fake.model_slots = {"model-a": 2, "model-b": 4}
    with running_stack(tmp_path, {"upstream": {"slots": "auto"}}, fake=fake) as stack:
        await async_wait_for(lambda: stack.sidecar.queue()["slots_total"] == 2, what="model-a's 2 slots learnt")
        async with aiohttp.ClientSession() as session:
            a = asyncio.create_task(chat(session, stack.url, "a", hold=True, model="model-a"))
            await async_wait_for(lambda: "a" in fake.order(), what="a at the upstream")
            b = [asyncio.create_task(chat(session, stack.url, f"b{i}", hold=True, model="model-b")) for i in range(4)]
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 4, what="the b requests waiting")
            fake.release("a")
            assert (await a).status == 200
            # Four of model-b at once, while they run: its own slots, learnt from /props.
            await async_wait_for(lambda: fake.active == 4, what="four of model-b at the upstream")
            queue = stack.sidecar.queue()
            assert (queue["slots_busy"], queue["slots_total"], queue["resident_models"]) == (4, 4, ["model-b"])
            for i in range(4):
                fake.release(f"b{i}")
            replies = await asyncio.gather(*b)
        assert [reply.status for reply in replies] == [200] * 4
        assert fake.props_asked.count("model-b") >= 1 and fake.max_active == 4
