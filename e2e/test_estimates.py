"""The GPU's time, through the real Envoy and sidecar: a client asks where its own request stands,
the queue shows estimated starts, every response names its request, and recorded traffic
replayed by `llamaswap simulate` through the real core matches what happened."""

from __future__ import annotations

import asyncio
import heapq
import json
import pathlib
import subprocess
import sys
import uuid

import aiohttp
import pytest

from client import chat, start_blocker
from fake_llama import FakeLlamaServer
from harness import async_wait_for, running_stack

STATUS = "/llamaswap/v1/requests/"


async def test_a_client_asks_where_its_own_request_stands(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            first = asyncio.create_task(chat(session, stack.url, "first", priority="interactive"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="first queued")
            mine = asyncio.create_task(chat(session, stack.url, "mine", priority="batch", model="model-b"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="mine queued")
            hits_before = len(stack.upstream.hits)

            async def status(request_id: str) -> tuple[int, dict, str]:
                async with session.get(f"{stack.url}{STATUS}{request_id}") as response:
                    text = await response.text()
                    return response.status, json.loads(text), response.headers.get("content-type", "")

            waiting_status, waiting, _ = await status("mine")
            running_status, running, _ = await status("blocker")
            missing_status, missing, missing_type = await status("nobody-has-this-id")
            assert stack.sidecar.queue()["waiting"][1]["request_id"] == "mine"  # the queue is as it was
            hits_after = len(stack.upstream.hits)
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, first, mine)
        assert [r.status for r in replies] == [200, 200, 200]
        assert waiting_status == 200
        assert waiting["state"] == "waiting" and waiting["position"] == 2
        assert set(waiting) == {"request_id", "state", "position", "estimated_start_s"}  # what its client needs
        assert waiting["estimated_start_s"] > 0
        assert "first" not in json.dumps(waiting) and "blocker" not in json.dumps(waiting)  # nothing of others
        assert running_status == 200 and running["state"] == "running" and running["position"] == 0
        assert missing_status == 404 and missing_type.startswith("application/json")
        assert missing["error"]["code"] == "request_not_found"
        # The status route never reached the upstream nor the GPU queue.
        assert hits_after == hits_before and all(STATUS not in h.path for h in stack.upstream.hits)
        assert stack.upstream.order() == ["blocker", "first", "mine"]


async def test_the_queue_shows_estimated_starts(tmp_path: pathlib.Path) -> None:
    config = {"estimates": {"defaultRunSeconds": 30, "defaultSwapSeconds": 4}}
    # A router: it serves each model by name, so changing model is a swap (a single-model
    # upstream serves every request with its one model: no swap, tests/test_record.py).
    with running_stack(tmp_path, config, fake=FakeLlamaServer(router=True)) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            tasks = []
            for index, (name, model) in enumerate((("a1", "model-a"), ("b1", "model-b"), ("b2", "model-b"))):
                tasks.append(asyncio.create_task(chat(session, stack.url, name, model=model)))
                await async_wait_for(lambda n=index + 1: len(stack.sidecar.queue()["waiting"]) == n,
                                     what=f"{name} queued")
            document = stack.sidecar.queue()
            table = subprocess.run([sys.executable, "-m", "llamaswap", "queue", "--admin", stack.sidecar.admin_url],
                                   capture_output=True, text=True, timeout=60)
            stack.upstream.release("blocker")
            await asyncio.gather(blocker, *tasks)
        running = document["running"]
        assert running["expected_end_s"] == 34  # nothing measured yet: the default run + a load
        a1, b1, b2 = document["waiting"]
        # a1 after the blocker's expected remainder, b1 after a1's run; b1 swaps to model-b, so
        # b2 waits for that swap and b1's run. (As of one instant: approx for the float sums only.)
        assert a1["estimated_start_s"] == pytest.approx(running["expected_remaining_s"], abs=1e-9)
        assert b1["estimated_start_s"] == pytest.approx(a1["estimated_start_s"] + 30, abs=1e-6)
        assert b2["estimated_start_s"] == pytest.approx(b1["estimated_start_s"] + 4 + 30, abs=1e-6)
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()[1:]
        assert header.split() == ["POS", "ST", "REQUEST_ID", "PRIORITY", "BAND", "SCORE", "WAIT", "TIME", "START",
                                  "MODEL"]
        assert [row.split()[2] for row in rows] == ["blocker", "a1", "b1", "b2"]
        assert all("+" in row.split()[-2] for row in rows[1:])


async def test_every_response_carries_its_request_id(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"routing": {"scheduler": {"maxQueued": 1}}}) as stack:
        async with aiohttp.ClientSession() as session:
            own = await chat(session, stack.url, "mine")
            body = json.dumps({"model": "model-a", "messages": []})
            async with session.post(f"{stack.url}/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as response:
                generated = response.headers.get("x-request-id")
                assert response.status == 200
            blocker = await start_blocker(stack, session)
            queued = asyncio.create_task(chat(session, stack.url, "queued"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="one queued")
            full = await chat(session, stack.url, "refused")
            async with session.get(f"{stack.url}/health") as response:
                health = response.headers.get("x-request-id")
            stack.upstream.release("blocker")
            await asyncio.gather(blocker, queued)
        assert own.headers["x-request-id"] == "mine"
        assert generated is not None and uuid.UUID(generated)  # made by Envoy, still returned
        assert full.status == 429 and full.headers["x-request-id"] == "refused"
        assert health is not None


async def test_recorded_traffic_replays_as_it_happened(tmp_path: pathlib.Path) -> None:
    """Fidelity: traffic recorded through the real stack (a fake upstream with known run times),
    replayed by `llamaswap simulate` with the recorded settings, grants in the same order with
    the waits the recorded arrivals and run times make (`_replayed_by_hand`), to the microsecond."""
    activity = tmp_path / "activity.jsonl"
    config = {"activity": {"path": str(activity)}}
    # (request id, priority, model, run ms): behind a blocker, then more while they run.
    first_wave = [("i1", "interactive", "model-b", 120), ("n1", "normal", "model-a", 80),
                  ("b1", "batch", "model-a", 60), ("n2", "normal", "model-b", 100),
                  ("i2", "interactive", "model-a", 90)]
    second_wave = [("n3", "normal", "model-a", 70), ("b2", "batch", "model-b", 50),
                   ("i3", "interactive", "model-b", 60)]
    with running_stack(tmp_path, config, fake=FakeLlamaServer(router=True)) as stack:  # models swap by name
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session, model="model-a")
            tasks = []
            for index, (request_id, priority, model, run_ms) in enumerate(first_wave):
                tasks.append(asyncio.create_task(chat(session, stack.url, request_id, priority=priority, model=model,
                                                      sleep_ms=run_ms)))
                await async_wait_for(lambda n=index + 1: len(stack.sidecar.queue()["waiting"]) == n,
                                     what=f"{request_id} queued")
            stack.upstream.release("blocker")
            await async_wait_for(lambda: len(stack.upstream.order()) >= 3, what="two of the first wave running")
            for request_id, priority, model, run_ms in second_wave:
                tasks.append(asyncio.create_task(chat(session, stack.url, request_id, priority=priority, model=model,
                                                      sleep_ms=run_ms)))
                await async_wait_for(lambda rid=request_id: any(w["request_id"] == rid
                                                                for w in stack.sidecar.queue()["waiting"])
                                     or rid in stack.upstream.order(), what=f"{request_id} arrived")
            replies = await asyncio.gather(blocker, *tasks)
            await async_wait_for(lambda: len(_lines(activity)) >= 1 + len(first_wave) + len(second_wave) + 1,
                                 what="every request recorded")
    assert {r.status for r in replies} == {200}
    actual_order = stack.upstream.order()
    recorded = {r["request_id"]: r for r in _lines(activity) if r.get("event") == "request"}

    result = subprocess.run([sys.executable, "-m", "llamaswap", "simulate", "--activity", str(activity),
                             "--requests", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    simulated = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    per_request = {r["request_id"]: r for r in simulated if "request_id" in r}
    simulated_order = [r["request_id"] for r in sorted(per_request.values(), key=lambda r: r["start_ms"])]
    assert simulated_order == actual_order
    _assert_waits_replayed(recorded, per_request, slots=1)


def _us(ms: float) -> int:
    """A recorded time in milliseconds (three decimals) as whole microseconds."""
    return round(ms * 1000)


def _replayed_by_hand(recorded: dict[str, dict], slots: int) -> dict[str, int]:
    """Each request's wait in microseconds were every recorded run replayed as recorded, in the
    recorded order of grants, on ``slots`` slots each taking the next grant at the instant it
    frees: the recorded arrivals (from the first), run and settle times, and nothing else. The
    log's own waits add the sidecar's handoff from a release to the next grant."""
    origin = min(_us(record["arrival_unix_ms"]) for record in recorded.values())
    free = [0] * slots  # when each slot frees
    last = 0  # grants go in order: none before the one granted before it
    waits = {}
    for record in sorted(recorded.values(), key=lambda record: record["granted_unix_ms"]):
        arrival = _us(record["arrival_unix_ms"]) - origin
        start = max(arrival, last, heapq.heappop(free))
        heapq.heappush(free, start + _us(record["run_ms"]) + _us(record["settle_ms"] or 0))
        last = start
        waits[record["request_id"]] = start - arrival
    return waits


def _assert_waits_replayed(recorded: dict[str, dict], replayed: dict[str, dict], *, slots: int) -> None:
    """The replay grants in the recorded order (each one's place among the grants) and each wait is
    the one the recorded times make, to the microsecond; the recorded wait is that and the
    sidecar's own handoffs (never less)."""
    order = sorted(recorded, key=lambda request_id: recorded[request_id]["granted_unix_ms"])
    assert {request_id: replayed[request_id]["grant"] for request_id in recorded} == {
        request_id: place for place, request_id in enumerate(order)}
    by_hand = _replayed_by_hand(recorded, slots)
    assert {request_id: _us(replayed[request_id]["wait_ms"]) for request_id in recorded} == by_hand
    assert all(_us(recorded[request_id]["serial_queue_wait_ms"]) >= wait for request_id, wait in by_hand.items())


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _sized(model: str, **fields: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


async def test_the_size_a_request_asks_for_reaches_the_estimates(tmp_path: pathlib.Path) -> None:
    """Envoy's json_to_metadata reads `max_tokens` (or `n_predict`) from the body into the Check:
    the running request's expected run and each waiting one's share of the walk scale with it."""
    config = {"estimates": {"defaultRunSeconds": 30, "defaultSwapSeconds": 0}}
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession() as session:
            for index in range(3):  # teach the run time per token asked
                reply = await chat(session, stack.url, f"warm{index}", sleep_ms=100,
                                   body=_sized("model-a", max_tokens=64))
                assert reply.status == 200
            blocker = await start_blocker(stack, session, body=_sized("model-a", max_tokens=200))
            small = asyncio.create_task(chat(session, stack.url, "small", body=_sized("model-a", max_tokens=64)))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="small queued")
            after = asyncio.create_task(chat(session, stack.url, "after", body=_sized("model-a", n_predict=64)))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="after queued")
            document = stack.sidecar.queue()
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, small, after)
        assert [r.status for r in replies] == [200, 200, 200]
        running = document["running"]
        first, second = document["waiting"]
        assert (running["request_id"], first["request_id"], second["request_id"]) == ("blocker", "small", "after")
        per_token = running["expected_end_s"] / 200
        assert 0 < per_token < 30 / 200  # learnt from the warm runs, not the default
        # The 64-token request between them is expected to take 64/200 of the 200-token one.
        assert second["estimated_start_s"] - first["estimated_start_s"] == pytest.approx(per_token * 64, rel=1e-6)


async def test_recorded_traffic_with_two_slots_replays_as_it_happened(tmp_path: pathlib.Path) -> None:
    """Fidelity with `upstream.slots: 2`: recorded through the real stack, replayed by
    `llamaswap simulate --slots 2`. The fake upstream runs two at once as fast as one each and
    each request asks for as many tokens as it sleeps milliseconds: the replay measures that
    speed from the log, and given it as stated (`--concurrency-speed 1:1,2:2`) grants in the
    recorded order, every request waiting what the recorded times make, to the microsecond."""
    activity = tmp_path / "activity.jsonl"
    config = {"activity": {"path": str(activity)}, "upstream": {"slots": 2}}
    wave = [("i1", "interactive", 120), ("n1", "normal", 80), ("b1", "batch", 60), ("n2", "normal", 100),
            ("i2", "interactive", 90), ("n3", "normal", 70)]
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession() as session:
            # Alone first (the first one loads the model): runs that time one at a time.
            for request_id, run_ms in (("w1", 50), ("w2", 60), ("w3", 110)):
                reply = await chat(session, stack.url, request_id, sleep_ms=run_ms,
                                   body=_sized("model-a", max_tokens=run_ms))
                assert reply.status == 200
            blocker = await start_blocker(stack, session, model="model-a")
            tasks = []
            for request_id, priority, run_ms in wave:
                tasks.append(asyncio.create_task(chat(session, stack.url, request_id, priority=priority,
                                                      sleep_ms=run_ms, body=_sized("model-a", max_tokens=run_ms))))
                await async_wait_for(lambda rid=request_id: any(w["request_id"] == rid
                                                                for w in stack.sidecar.queue()["waiting"])
                                     or rid in stack.upstream.order(), what=f"{request_id} arrived")
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *tasks)
            await async_wait_for(lambda: len(_lines(activity)) >= 1 + 3 + len(wave) + 1, what="every request recorded")
    assert {r.status for r in replies} == {200}
    assert stack.upstream.max_active == 2
    recorded = {r["request_id"]: r for r in _lines(activity) if r.get("event") == "request"}
    assert max(r["serial_slots_busy"] for r in recorded.values()) == 2
    result = subprocess.run([sys.executable, "-m", "llamaswap", "simulate", "--activity", str(activity), "--slots", "2",
                             "--requests", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in filter(str.strip, result.stdout.splitlines())]
    assert {r["request_id"] for r in lines if "request_id" in r} == set(recorded)
    stated = subprocess.run([sys.executable, "-m", "llamaswap", "simulate", "--activity", str(activity), "--slots",
                             "2", "--concurrency-speed", "1:1,2:2", "--requests", "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert stated.returncode == 0, stated.stderr
    replayed = [json.loads(line) for line in filter(str.strip, stated.stdout.splitlines())]
    _assert_waits_replayed(recorded, {r["request_id"]: r for r in replayed if "request_id" in r}, slots=2)
    speed = lines[-1]["concurrency_speed"]
    assert speed["source"] == "measured", speed
    # Each run also holds a few milliseconds of HTTP and Envoy that no token count explains.
    print("SPEED", speed)
    assert abs(speed["points"]["2"] - 2.0) <= 0.25, speed
