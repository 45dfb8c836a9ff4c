"""The loaded model is a fact to ask for, not an assumption: requests for a model the upstream
does not serve are refused at once, through the real Envoy and sidecar."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp

from client import chat, start_blocker
from fake_llama import FakeLlamaServer
from harness import activity_records, async_wait_for, http_get, metric_samples, running_stack, wait_for


async def test_an_unknown_model_is_refused_at_once_without_queueing(tmp_path: pathlib.Path) -> None:
    """Router mode lists what it serves: a request for anything else gets 404 model_not_found
    while the GPU is busy, instead of waiting its turn to get llama-server's 400."""
    fake = FakeLlamaServer(router=True, models=("model-a", "model-b"))
    with running_stack(tmp_path, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            refused = await chat(session, stack.url, "bogus", model="no-such-model")
            assert stack.sidecar.queue()["waiting"] == []
            # A model added to the upstream later is served: a miss asks the upstream again.
            fake.states["model-new"] = "unloaded"
            later = asyncio.create_task(chat(session, stack.url, "new", model="model-new"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="the new model queued")
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, later)
            samples = await async_wait_for(lambda: _counted(stack), what="the refusal counted")
        assert refused.status == 404
        error = refused.json()["error"]
        assert (error["code"], error["type"], error["param"]) == ("model_not_found", "invalid_request_error", "model")
        assert "no-such-model" in error["message"]
        assert refused.headers["x-llamaswap-outcome"] == "rejected_unknown_model"
        assert [r.status for r in replies] == [200, 200]
        assert stack.upstream.order() == ["blocker", "new"]
        assert samples['llamaswap_requests_total{outcome="rejected_unknown_model"}'] == 1.0


def _counted(stack) -> dict[str, float] | None:
    samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
    return samples if samples.get('llamaswap_requests_total{outcome="served"}') == 2.0 else None


async def test_a_single_model_server_serves_any_name(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:  # the fake in single-model mode, like plain llama-server
        async with aiohttp.ClientSession() as session:
            reply = await chat(session, stack.url, "any", model="whatever-the-client-says")
        assert reply.status == 200
        assert stack.upstream.order() == ["any"]


async def test_strict_refuses_what_a_single_model_server_does_not_list(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"upstream": {"modelCheck": "strict"}}) as stack:
        async with aiohttp.ClientSession() as session:
            listed = await chat(session, stack.url, "listed", model="fake.gguf")
            other = await chat(session, stack.url, "other", model="whatever")
        assert (listed.status, other.status) == (200, 404)


async def test_a_failed_dispatch_does_not_leave_its_model_loaded(tmp_path: pathlib.Path) -> None:
    """With the check off, a bogus model reaches router-mode llama-server (400): afterwards the
    sidecar does not believe the bogus name is loaded."""
    fake = FakeLlamaServer(router=True, models=("model-a",))
    with running_stack(tmp_path, {"upstream": {"modelCheck": "off"}}, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            good = await chat(session, stack.url, "good", model="model-a")
            await async_wait_for(lambda: stack.sidecar.queue()["gpu"] == "idle", what="good released")
            bogus = await chat(session, stack.url, "bogus", model="nope")
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"good", "bogus"}),
                                           what="two records")
            loaded = stack.sidecar.queue()["resident_models"]
        assert (good.status, bogus.status) == (200, 400)
        assert records["bogus"]["outcome"] == "served"  # the upstream answered (a 4xx is the client's)
        assert records["bogus"]["status"] == 400
        assert loaded == []  # not "nope", and not known until the upstream says


def test_a_model_setting_for_a_model_the_upstream_does_not_serve_is_logged(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(router=True)
    config = {"routing": {"scheduler": {"use": "fifo"}}, "models": {"model-a": {"priority": 5},
                                                                    "qwen3-8b": {"priority": 10}},
              "upstream": {"modelsPollSeconds": 0.1}}
    with running_stack(tmp_path, config, fake=fake) as stack:
        wait_for(lambda: "models.qwen3-8b: the upstream does not serve qwen3-8b" in stack.sidecar.log_path.read_text()
                 or None, what="the warning")
        wait_for(lambda: fake.looks >= 5 or None, what="more polls")
        log = stack.sidecar.log_path.read_text()
    assert log.count("models.qwen3-8b: the upstream does not serve") == 1  # once, not every poll
    assert "(it lists model-a, model-b, model-c)" in log and "models.model-a:" not in log
