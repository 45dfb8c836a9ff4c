"""Several models resident on one GPU (issue 37), through the real Envoy and sidecar in front of
the fake llama-server in router mode with `--models-max` as llamaswap's `maxLoaded`: two models
alternate with no unload and no drain, a third evicts the idle one the queue needs least by an
explicit unload that llamaswap waits for (the router never evicts by itself: its `evicted` stays
empty), a busy model is never unloaded, a failed unload answers 503, and a restarted sidecar
adopts every model the router has loaded."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import aiohttp

from client import chat, start_blocker
from fake_llama import LOADED, UNLOADED, FakeLlamaServer
from harness import activity_records, async_wait_for, running_stack

MODELS = ("model-a", "model-b", "model-c")


def router(max_loaded: int) -> FakeLlamaServer:
    """The router as `llamaswap up --max-loaded N` starts it: `--models-max N`."""
    return FakeLlamaServer(router=True, models=MODELS, models_max=max_loaded)


def config(max_loaded: int) -> dict[str, Any]:
    return {"upstream": {"maxLoaded": max_loaded}}


def loads(fake: FakeLlamaServer) -> list[str]:
    """The requests that loaded their model, in order."""
    with fake.lock:
        return [hit.test_id for hit in fake.hits if hit.loaded]


def resident(fake: FakeLlamaServer) -> set[str]:
    return {name for name, state in fake.states.items() if state != UNLOADED}


async def test_two_resident_models_alternate_without_an_unload_or_a_drain(tmp_path: pathlib.Path) -> None:
    fake = router(2)
    with running_stack(tmp_path, config(2), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            first = await chat(session, stack.url, "a1", model="model-a")
            held = await start_blocker(stack, session, "a-held", model="model-a")
            # model-b loads and runs beside model-a's running request: no drain, no unload.
            beside = [await chat(session, stack.url, f"b{index}", model="model-b") for index in range(3)]
            assert not held.done()
            stack.upstream.release("a-held")  # type: ignore[union-attr]
            alternating = [await chat(session, stack.url, f"x{index}", model=MODELS[index % 2]) for index in range(6)]
            gpu = stack.sidecar.queue()["gpus"][0]
            assert (await held).status == 200
        assert [reply.status for reply in (first, *beside, *alternating)] == [200] * 10
        assert loads(fake) == ["a1", "b0"]  # each model loaded once, then resident
        assert fake.unloads == [] and fake.evicted == []
        assert gpu["resident_models"] == ["model-a", "model-b"] and gpu["max_loaded"] == 2


async def test_a_third_model_evicts_the_idle_one_by_an_unload_llamaswap_waits_for(tmp_path: pathlib.Path) -> None:
    fake = router(2)
    fake.unload_takes_looks = 3  # the unloaded model's process takes a while to exit
    with running_stack(tmp_path, config(2), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            assert (await chat(session, stack.url, "b1", model="model-b")).status == 200
            held = await start_blocker(stack, session, "a-held", model="model-a")  # model-a busy
            third = await chat(session, stack.url, "c1", model="model-c")
            assert not held.done()  # model-a ran on through the eviction
            stack.upstream.release("a-held")  # type: ignore[union-attr]
            assert (await held).status == 200
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"c1"}),
                                           what="c1's record")
        assert third.status == 200
        assert fake.unloads == ["model-b"]  # llamaswap's explicit unload of the idle model
        assert fake.evicted == []  # the router never chose one itself
        assert resident(fake) == {"model-a", "model-c"}
        assert records["c1"]["outcome"] == "served"


async def test_a_busy_model_is_never_unloaded(tmp_path: pathlib.Path) -> None:
    fake = router(2)
    with running_stack(tmp_path, config(2), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            held_b = await start_blocker(stack, session, "b-held", model="model-b")  # used first: it goes first
            held_a = await start_blocker(stack, session, "a-held", model="model-a")
            third = asyncio.create_task(chat(session, stack.url, "c1", model="model-c"))
            await async_wait_for(lambda: stack.sidecar.queue()["waiting"], what="c1 waiting")
            await asyncio.sleep(0.3)
            assert not third.done() and fake.unloads == []  # both resident models run: nothing goes
            stack.upstream.release("b-held")  # type: ignore[union-attr]
            assert (await held_b).status == 200
            assert (await third).status == 200  # model-b drained and went; model-a still runs
            assert not held_a.done()
            stack.upstream.release("a-held")  # type: ignore[union-attr]
            assert (await held_a).status == 200
        assert fake.unloads == ["model-b"] and fake.evicted == []
        assert resident(fake) == {"model-a", "model-c"}


async def test_a_failed_unload_answers_503_and_never_lets_the_load_through(tmp_path: pathlib.Path) -> None:
    fake = router(2)
    fake.unload_refused = {"model-b"}
    with running_stack(tmp_path, config(2), fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            assert (await chat(session, stack.url, "b1", model="model-b")).status == 200
            held = await start_blocker(stack, session, "a-held", model="model-a")
            refused = await chat(session, stack.url, "c1", model="model-c")
            stack.upstream.release("a-held")  # type: ignore[union-attr]
            assert (await held).status == 200
        assert refused.status == 503
        assert refused.headers["x-llamaswap-outcome"] == "upstream_error"
        error = refused.json()["error"]
        assert error["code"] == "model_unload_failed" and "model-b" in error["message"]
        assert "c1" not in fake.order()  # the load never reached the router
        assert fake.states["model-c"] == UNLOADED and fake.evicted == []


async def test_a_restarted_sidecar_adopts_every_loaded_model(tmp_path: pathlib.Path) -> None:
    fake = router(3)
    fake.states.update({"model-a": LOADED, "model-b": LOADED})  # loaded before this sidecar started
    with running_stack(tmp_path, config(3), fake=fake) as stack:
        gpu = await async_wait_for(lambda: _with_residents(stack), what="the resident set adopted")
        async with aiohttp.ClientSession() as session:
            replies = [await chat(session, stack.url, name, model=model)
                       for name, model in (("a1", "model-a"), ("b1", "model-b"), ("c1", "model-c"))]
        assert gpu["resident_models"] == ["model-a", "model-b"]
        assert [reply.status for reply in replies] == [200, 200, 200]
        assert loads(fake) == ["c1"]  # a and b were resident already: no swap, no reload
        assert fake.unloads == [] and fake.evicted == []  # three fit


def _with_residents(stack: Any) -> dict[str, Any] | None:
    gpu = stack.sidecar.queue()["gpus"][0]
    return gpu if gpu["resident_models"] else None
