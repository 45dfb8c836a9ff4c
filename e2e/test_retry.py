"""A client that retries keeps its place in the queue (routing.retryGraceSeconds), with the real
`openai` Python SDK as the client, through the real Envoy and sidecar, against the fake upstream.

The scenario of issue 29: `OpenAI(timeout=2, max_retries=3)` behind a running generation of
about 6 s, with later arrivals of the same priority. The SDK times each try out after 2 s, backs
off 0.375-0.5 s, 0.75-1 s, 1.5-2 s (its own source) and sends the same body again. The
generation ends when the SDK's third try waits (5.1-5.5 s after its first): by the test's hand,
not by a clock, so that the end never falls in the moment the SDK is away between two tries
(then the GPU would go to the next waiting request: a kept place holds a position, not the GPU).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import aiohttp
import openai

from client import chat
from fake_llama import FakeLlamaServer
from harness import Stack, async_wait_for, get_json, http_get, metric_samples, running_stack

TRIES_BEFORE_THE_END = 2  # tries that time out before the generation ends
BODY = {"model": "model-a", "messages": [{"role": "user", "content": "the same question each try"}]}


def _sdk_call(stack: Stack, *, request_id: str | None, api_key: str = "key-a") -> Any:
    """One SDK call as an application makes it; its raw response (headers and the completion)."""
    headers = {"x-test-id": "sdk"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, timeout=2, max_retries=3,
                           default_headers=headers)
    try:
        return client.chat.completions.with_raw_response.create(**BODY)  # type: ignore[call-overload]
    finally:
        client.close()


def _activity(stack: Stack) -> list[dict[str, Any]]:
    return get_json(f"{stack.sidecar.admin_url}/activity")["activity"]


def _kept_metric(stack: Stack) -> dict[str, float]:
    status, body = http_get(f"{stack.sidecar.admin_url}/metrics")
    assert status == 200
    samples = metric_samples(body.decode())
    return {event: samples.get(f'llamaswap_kept_places_total{{event="{event}"}}', 0.0)
            for event in ("kept", "taken_over", "expired")}


async def _sdk_behind_running(stack: Stack, session: aiohttp.ClientSession, *, request_id: str | None,
                              grace: bool = True) -> tuple[Any, dict[str, Any]]:
    """The issue's scenario: a generation runs; the SDK call arrives; one same-priority request
    arrives after its first try, another while its client is away (between two tries, when the
    grace period is on); the generation ends once the SDK's third try waits. Returns the SDK's raw
    response and the later requests' replies."""
    running = asyncio.create_task(chat(session, stack.url, "running", hold=True))
    await async_wait_for(lambda: stack.upstream.order() == ["running"], what="the running generation")
    sdk = asyncio.ensure_future(asyncio.to_thread(_sdk_call, stack, request_id=request_id))
    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="the SDK's first try waiting")
    later = {"later-1": asyncio.create_task(chat(session, stack.url, "later-1"))}
    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="later-1 waiting")
    if grace:
        # Arrives while the SDK's client is away: its first try timed out, the retry is not here yet.
        await async_wait_for(lambda: stack.sidecar.queue()["kept"], what="the SDK's place kept", interval=0.005)
    later["later-2"] = asyncio.create_task(chat(session, stack.url, "later-2"))

    def third_try_waits() -> bool:
        left = sum(1 for r in _activity(stack) if r["outcome"] == "cancelled_waiting")
        return left == TRIES_BEFORE_THE_END and len(stack.sidecar.queue()["waiting"]) == 3

    await async_wait_for(third_try_waits, what="the SDK's third try waiting")
    stack.upstream.release("running")
    raw = await sdk
    replies = dict(zip(later, await asyncio.gather(*later.values())))
    assert (await running).status == 200
    assert all(reply.status == 200 for reply in replies.values()), {k: r.status for k, r in replies.items()}
    return raw, replies


async def _keeps_its_place(tmp_path: pathlib.Path, *, request_id: str | None) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            raw, _ = await _sdk_behind_running(stack, session, request_id=request_id)
        completion = raw.parse()
        assert raw.http_response.status_code == 200 and completion.choices[0].message.content == "ok"
        # Served before every request that arrived after its first try (the tries that timed out
        # never reached the upstream: they waited).
        assert stack.upstream.order() == ["running", "sdk", "later-1", "later-2"]
        sdk_hit = stack.upstream.hits[1]
        assert "x-llamaswap-client-request-id" not in {key.lower() for key in sdk_hit.headers}  # Envoy's, not theirs
        served_id = raw.headers["x-request-id"]
        if request_id is not None:
            assert served_id == request_id
        served = await async_wait_for(
            lambda: next((r for r in _activity(stack) if r["request_id"] == served_id and r["outcome"] == "served"),
                         None), what="the SDK's served record")
        left = sorted((r for r in _activity(stack) if r["outcome"] == "cancelled_waiting"),
                      key=lambda r: r["arrival_unix_ms"])
        assert left, "no try of the SDK timed out while waiting"
        if request_id is not None:
            assert {r["request_id"] for r in left} == {request_id}
        else:  # Envoy made up an id for each try: different ones
            assert len({r["request_id"] for r in left} | {served_id}) == len(left) + 1
        first_try = left[0]
        # Its wait counts from its first try: the first try's arrival, to its grant.
        assert served["arrival_unix_ms"] == first_try["arrival_unix_ms"]
        # (The record rounds to 0.001 ms, the header to 0.1 ms.)
        assert abs(served["serial_queue_wait_ms"] - (served["granted_unix_ms"] - first_try["arrival_unix_ms"])) < 0.002
        assert abs(float(raw.headers["x-llamaswap-queue-wait-ms"]) - served["serial_queue_wait_ms"]) < 0.051
        # From which try, and how long its client was away (the SDK counts its tries from 0).
        assert served["kept_from_attempt"] == len(left) - 1
        assert served["kept_away_ms"] > 0
        kept = _kept_metric(stack)
        assert kept["kept"] == len(left) and kept["taken_over"] == len(left) and kept["expired"] == 0
        assert stack.sidecar.queue()["kept"] == []


async def test_an_sdk_retry_keeps_its_place_by_its_request_id(tmp_path: pathlib.Path) -> None:
    await _keeps_its_place(tmp_path, request_id="sdk-call-1")


async def test_an_sdk_retry_keeps_its_place_by_its_body(tmp_path: pathlib.Path) -> None:
    await _keeps_its_place(tmp_path, request_id=None)


async def test_the_grace_period_off_is_todays_behaviour(tmp_path: pathlib.Path) -> None:
    """routing.retryGraceSeconds: 0: every retry is a new arrival at the back, as before."""
    with running_stack(tmp_path, {"routing": {"retryGraceSeconds": 0}}) as stack:
        async with aiohttp.ClientSession() as session:
            raw, _ = await _sdk_behind_running(stack, session, request_id="sdk-call-1", grace=False)
        assert raw.http_response.status_code == 200
        assert stack.upstream.order() == ["running", "later-1", "later-2", "sdk"]
        # The record is written when the exchange's end reaches the sidecar, which may follow the response.
        served = await async_wait_for(
            lambda: next((r for r in _activity(stack) if r["request_id"] == "sdk-call-1" and r["outcome"] == "served"),
                         None), what="the SDK's served record")
        first_try = min(r["arrival_unix_ms"] for r in _activity(stack) if r["outcome"] == "cancelled_waiting")
        assert served["arrival_unix_ms"] > first_try and served["kept_from_attempt"] is None
        assert _kept_metric(stack) == {"kept": 0, "taken_over": 0, "expired": 0}


async def _post(session: aiohttp.ClientSession, url: str, test_id: str, api_key: str) -> int:
    """The same body each time, no x-request-id (Envoy makes one up): only the body and caller match."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {api_key}", "x-test-id": test_id}
    async with session.post(f"{url}/v1/chat/completions", data=json.dumps(BODY), headers=headers) as response:
        await response.read()
        return response.status


async def _leave_waiting(stack: Stack, session: aiohttp.ClientSession, api_key: str) -> None:
    """A waiting request whose client gives up (a client timeout): its place is kept."""
    kept_before = len(stack.sidecar.queue()["kept"])
    waiting_before = len(stack.sidecar.queue()["waiting"])
    task = asyncio.create_task(_post(session, stack.url, "left", api_key))
    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == waiting_before + 1, what="it waits")
    task.cancel()
    await async_wait_for(lambda: len(stack.sidecar.queue()["kept"]) == kept_before + 1, what="its place kept")


async def test_another_callers_identical_body_never_takes_the_place(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = asyncio.create_task(chat(session, stack.url, "blocker", hold=True))
            await async_wait_for(lambda: stack.upstream.order() == ["blocker"], what="blocker at the upstream")
            await _leave_waiting(stack, session, "key-a")
            other = asyncio.create_task(_post(session, stack.url, "other-caller", "key-b"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="the other caller waiting")
            queue = stack.sidecar.queue()
            assert len(queue["kept"]) == 1  # the place is still kept: not taken by key-b
            assert queue["kept"][0]["state"] == "kept" and queue["kept"][0]["waited_s"] >= queue["kept"][0]["away_s"]
            page = get_json(f"{stack.sidecar.admin_url}/ui/state")  # what the page at /ui lists
            assert [row["state"] for row in page["kept"]] == ["kept"]
            assert _kept_metric(stack)["taken_over"] == 0
            # The caller whose place it is takes it, ahead of the other caller who came first.
            retry = asyncio.create_task(_post(session, stack.url, "retry", "key-a"))
            await async_wait_for(lambda: stack.sidecar.queue()["kept"] == [], what="the place taken over")
            assert [row["position"] for row in stack.sidecar.queue()["waiting"]] == [1, 2]
            stack.upstream.release("blocker")
            statuses = await asyncio.gather(blocker, other, retry)
        assert statuses[1:] == [200, 200]
        assert stack.upstream.order() == ["blocker", "retry", "other-caller"]
        assert _kept_metric(stack) == {"kept": 1, "taken_over": 1, "expired": 0}


async def test_an_untaken_kept_place_expires_on_time_and_is_counted(tmp_path: pathlib.Path) -> None:
    grace_s = 1.0
    with running_stack(tmp_path, {"routing": {"retryGraceSeconds": grace_s}}) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = asyncio.create_task(chat(session, stack.url, "blocker", hold=True))
            await async_wait_for(lambda: stack.upstream.order() == ["blocker"], what="blocker at the upstream")
            await _leave_waiting(stack, session, "key-a")
            seen_away: list[float] = []

            def expired() -> bool:
                kept = stack.sidecar.queue()["kept"]
                seen_away.extend(row["away_s"] for row in kept)
                return not kept

            await async_wait_for(expired, what="the kept place expired", interval=0.01)
            # Never kept past its grace period, and gone once (counted once).
            assert seen_away and max(seen_away) <= grace_s
            assert _kept_metric(stack) == {"kept": 1, "taken_over": 0, "expired": 1}
            # A retry after that is a new arrival.
            late = asyncio.create_task(_post(session, stack.url, "late", "key-a"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="the late retry waiting")
            stack.upstream.release("blocker")
            assert (await late) == 200
            await blocker
        served = await async_wait_for(
            lambda: next((r for r in _activity(stack) if r["outcome"] == "served" and r["kept_away_ms"] is None
                          and r["request_id"] != "blocker"), None), what="the late retry's record")
        left = next(r for r in _activity(stack) if r["outcome"] == "cancelled_waiting")
        assert served["arrival_unix_ms"] > left["arrival_unix_ms"]
        assert _kept_metric(stack) == {"kept": 1, "taken_over": 0, "expired": 1}


async def test_answers_say_whether_and_when_to_retry(tmp_path: pathlib.Path) -> None:
    """x-should-retry: false where sending the same request again cannot help; retry-after-ms
    beside Retry-After where it can (the OpenAI SDKs read both)."""
    config = {"routing": {"scheduler": {"maxQueued": 1}}, "envoy": {"maxRequestBytes": 4096}}
    with running_stack(tmp_path, config, fake=FakeLlamaServer(router=True)) as stack:
        async with aiohttp.ClientSession() as session:
            unknown = await chat(session, stack.url, "unknown", model="no-such-model")
            assert (unknown.status, unknown.headers.get("x-should-retry")) == (404, "false")
            async with session.post(f"{stack.url}/models/load", json={"model": "model-a"}) as response:
                assert (response.status, response.headers.get("x-should-retry")) == (403, "false")
            large = await chat(session, stack.url, "large", body=b'{"model":"model-a","pad":"' + b"x" * 8192 + b'"}')
            assert (large.status, large.headers.get("x-should-retry")) == (413, "false")
            blocker = asyncio.create_task(chat(session, stack.url, "blocker", hold=True))
            await async_wait_for(lambda: stack.upstream.order() == ["blocker"], what="blocker at the upstream")
            waiting = asyncio.create_task(chat(session, stack.url, "waiting"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="one waiting")
            full = await chat(session, stack.url, "full")
            assert full.status == 429 and "x-should-retry" not in full.headers
            assert int(full.headers["retry-after-ms"]) == 1000 * int(full.headers["retry-after"])
            stack.upstream.release("blocker")
            assert [(await t).status for t in (blocker, waiting)] == [200, 200]
