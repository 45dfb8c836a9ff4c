"""Scheduling order through the real Envoy and the real sidecar, against a fake upstream."""

from __future__ import annotations

import asyncio
import pathlib

import aiohttp

from client import chat
from fake_llama import FakeLlamaServer
from harness import async_wait_for, running_stack


async def _queue_behind_blocker(stack, session, requests, blocker_id="blocker"):
    """Start a held request for model-a, then queue `requests` (test_id, priority, model) in order."""
    blocker = asyncio.create_task(chat(session, stack.url, blocker_id, hold=True, model="model-a"))
    await async_wait_for(lambda: stack.upstream.order()[-1:] == [blocker_id], what="blocker at the upstream")
    tasks = {}
    for index, (test_id, priority, model) in enumerate(requests):
        tasks[test_id] = asyncio.create_task(chat(session, stack.url, test_id, priority=priority, model=model))
        # Arrival order matters for ties: wait until each one is in the queue.
        await async_wait_for(lambda n=index + 1: len(stack.sidecar.queue()["waiting"]) == n,
                             what=f"{test_id} in the queue")
    return blocker, tasks


async def test_priority_order(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker, tasks = await _queue_behind_blocker(stack, session, [
                ("batch", "batch", "model-a"),
                ("normal", "0", "model-a"),
                ("batch-plus-2", "-98", "model-a"),
                ("interactive", "interactive", "model-a"),
                ("unparseable", "soon please", "model-a"),
            ])
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *tasks.values())
        assert all(reply.status == 200 for reply in replies), [r.status for r in replies]
        assert stack.upstream.order() == ["blocker", "interactive", "normal", "unparseable", "batch-plus-2", "batch"]
        assert stack.upstream.max_active == 1
        by_id = dict(zip(["blocker", *tasks], replies))
        assert by_id["interactive"].headers["x-llamaswap-priority"] == "100"
        assert by_id["interactive"].headers["x-llamaswap-band"] == "interactive"
        assert by_id["batch-plus-2"].headers["x-llamaswap-band"] == "batch"
        assert by_id["unparseable"].headers["x-llamaswap-priority"] == "0"
        assert float(by_id["batch"].headers["x-llamaswap-queue-wait-ms"]) > 0
        assert "x-llamaswap-ticket" not in stack.upstream.hits[0].headers


async def test_swap_affinity(tmp_path: pathlib.Path) -> None:
    """With model A loaded, normal A overtakes an earlier normal B, never an interactive B."""
    with running_stack(tmp_path, fake=FakeLlamaServer(router=True)) as stack:  # models swap by name
        async with aiohttp.ClientSession() as session:
            blocker, tasks = await _queue_behind_blocker(stack, session, [
                ("normal-b", "normal", "model-b"),
                ("normal-a", "normal", "model-a"),
            ], blocker_id="blocker-1")
            stack.upstream.release("blocker-1")
            first_round = await asyncio.gather(blocker, *tasks.values())
            blocker, tasks = await _queue_behind_blocker(stack, session, [
                ("interactive-b", "interactive", "model-b"),
                ("normal-a-2", "normal", "model-a"),
            ], blocker_id="blocker-2")
            stack.upstream.release("blocker-2")
            second_round = await asyncio.gather(blocker, *tasks.values())
        assert [r.status for r in first_round + second_round] == [200] * 6
        assert stack.upstream.order() == [
            "blocker-1", "normal-a", "normal-b",
            "blocker-2", "interactive-b", "normal-a-2",
        ]
        by_id = dict(zip(["blocker-1", "normal-b", "normal-a"], first_round))
        assert float(by_id["normal-a"].headers["x-llamaswap-score"]) >= 10.0


async def test_fifo_with_model_priority(tmp_path: pathlib.Path) -> None:
    """fifo: the model's priority plus the header, then arrival; a model at 10 with batch is -90."""
    config = {"routing": {"scheduler": {"use": "fifo"}},
              "models": {"model-hi": {"priority": 10}, "model-lo": {"priority": -5}}}
    # A router serves each model by name (a single-model upstream keys every request on its one model).
    fake = FakeLlamaServer(router=True, models=("model-a", "model-hi", "model-lo"))
    with running_stack(tmp_path, config, fake=fake) as stack:
        async with aiohttp.ClientSession() as session:
            blocker, tasks = await _queue_behind_blocker(stack, session, [
                ("lo-normal", None, "model-lo"),       # -5
                ("hi-batch", "batch", "model-hi"),     # -90
                ("plain-normal", None, "model-a"),     # 0
                ("hi-normal", None, "model-hi"),       # 10
                ("plain-normal-2", None, "model-a"),   # 0, after plain-normal
            ])
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *tasks.values())
        assert [r.status for r in replies] == [200] * 6
        assert stack.upstream.order() == ["blocker", "hi-normal", "plain-normal", "plain-normal-2", "lo-normal",
                                          "hi-batch"]
        by_id = dict(zip(["blocker", *tasks], replies))
        assert by_id["hi-batch"].headers["x-llamaswap-score"].startswith("-90")
