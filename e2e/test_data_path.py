"""The hold and release through the real Envoy and sidecar: timers, disconnects, limits."""

from __future__ import annotations

import asyncio
import json
import pathlib

import aiohttp

from client import chat, start_blocker
from harness import activity_records, async_wait_for, http_get, metric_samples, running_stack


async def test_hold_outlives_envoy_timers(tmp_path: pathlib.Path) -> None:
    """Envoy's stream idle timeout (1 s) never ends a wait: the held Check has no idle timer."""
    config = {"envoy": {"streamIdleTimeoutSeconds": 1}}
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            waiter = asyncio.create_task(chat(session, stack.url, "waiter", priority="batch"))
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="waiter queued")
            # Hold well past both timers: wait until the waiter has been queued for 3 s by the
            # sidecar's own account (polling, not sleeping, decides when).
            await async_wait_for(lambda: stack.sidecar.queue()["waiting"][0]["waited_s"] >= 3.0,
                                 timeout=30, interval=0.2, what="3 s of waiting")
            assert not waiter.done()
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, waiter)
        assert [r.status for r in replies] == [200, 200]
        assert float(replies[1].headers["x-llamaswap-queue-wait-ms"]) >= 3000
        assert stack.upstream.order() == ["blocker", "waiter"]


async def test_disconnect_while_waiting_leaves_queue(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            async with aiohttp.ClientSession() as doomed_session:
                doomed = asyncio.create_task(chat(doomed_session, stack.url, "doomed", priority="interactive"))
                await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="doomed queued")
                doomed.cancel()
            await async_wait_for(lambda: stack.sidecar.queue()["waiting"] == [], what="queue empty after disconnect")
            stack.upstream.release("blocker")
            await blocker
            after = await chat(session, stack.url, "after")
        assert after.status == 200
        assert "doomed" not in stack.upstream.order()
        assert stack.upstream.order() == ["blocker", "after"]


async def test_client_gone_mid_generation_waits_for_the_upstream(tmp_path: pathlib.Path) -> None:
    """A client that leaves a non-streamed request does not stop the generation (llama-server, and
    the fake, keep computing): the next request is granted only when GET /slots says idle."""
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            async with aiohttp.ClientSession() as doomed_session:
                abandoned = await start_blocker(stack, doomed_session, "abandoned")
                waiting = asyncio.create_task(chat(session, stack.url, "next"))
                await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1, what="next queued")
                abandoned.cancel()
            # Envoy ended the exchange; the upstream still computes for nobody: nothing else starts.
            await async_wait_for(lambda: stack.sidecar.queue()["gpu"] == "settling", what="the GPU settling")
            assert stack.upstream.order() == ["abandoned"]
            assert not waiting.done()
            stack.upstream.release("abandoned")
            reply = await asyncio.wait_for(waiting, 30)
            await async_wait_for(lambda: stack.sidecar.queue()["gpu"] == "idle", what="GPU free again")
            records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"abandoned", "next"}),
                                           what="two activity records")
        assert reply.status == 200
        assert stack.upstream.order() == ["abandoned", "next"]
        assert stack.upstream.max_active == 1  # never two at once, in fact
        first = records["abandoned"]
        assert first["outcome"] == "cancelled_running"
        assert first["settle_ms"] > 0
        assert records["next"]["outcome"] == "served"
        samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
        assert samples['llamaswap_upstream_settle_seconds_count{reason="abandoned",result="idle"}'] == 1


async def test_upstream_error_releases_gpu(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            failed = await chat(session, stack.url, "fails", extra_headers={"x-test-fail": "1"})
            after = await chat(session, stack.url, "after")
            await async_wait_for(lambda: stack.sidecar.queue()["running"] is None, what="GPU free again")
        assert failed.status == 500
        assert after.status == 200


async def test_queue_full_gets_429(tmp_path: pathlib.Path) -> None:
    """Retry-After says when a place is expected to free: the running request's expected end
    (20 s here, before anything is measured), not 1 s that invites a retry storm."""
    config = {"routing": {"scheduler": {"maxQueued": 2}},
              "estimates": {"defaultRunSeconds": 20, "defaultSwapSeconds": 0}}
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            queued = [asyncio.create_task(chat(session, stack.url, f"q{i}")) for i in range(2)]
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 2, what="two queued")
            rejected = await chat(session, stack.url, "third")
            stack.upstream.release("blocker")
            served = await asyncio.gather(blocker, *queued)
        assert rejected.status == 429
        # 20 s minus the little the blocker has run so far, rounded up.
        assert 15 <= int(rejected.headers["retry-after"]) <= 20
        assert rejected.headers["content-type"].startswith("application/json")
        error = rejected.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error" and "full" in error["message"]
        assert [r.status for r in served] == [200, 200, 200]
        assert "third" not in stack.upstream.order()


async def test_max_wait_gets_503(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"routing": {"scheduler": {"maxWaitSeconds": 0.5}}}) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            expired = await chat(session, stack.url, "too-late", priority="batch")
            stack.upstream.release("blocker")
            await blocker
        assert expired.status == 503
        assert int(expired.headers["retry-after"]) >= 1
        assert expired.json()["error"]["code"] == "queue_wait_expired"
        assert "maxWaitSeconds" in expired.json()["error"]["message"]
        assert "too-late" not in stack.upstream.order()


async def test_each_granted_request_reaches_the_upstream_on_a_connection_of_its_own(tmp_path: pathlib.Path) -> None:
    """Envoy keeps no idle connection to the upstream: llama-server gives each open connection one
    of its few HTTP threads until 5 s after its last request, and Envoy's per-worker pools could
    hold them all, leaving a granted request unread that long. One client, one downstream
    connection: with keep-alive upstream, all would share one connection."""
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            replies = [await chat(session, stack.url, f"r{index}") for index in range(4)]
        assert [reply.status for reply in replies] == [200] * 4
        assert stack.upstream is not None
        ports = [hit.peer_port for hit in stack.upstream.hits]
        assert len(ports) == 4 and None not in ports
        assert len(set(ports)) == 4, ports


async def test_bypass_routes_skip_the_queue(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            for path in ("/health", "/v1/models", "/models"):
                async with session.get(f"{stack.url}{path}") as response:
                    assert response.status == 200, path
            assert stack.sidecar.queue()["waiting"] == []
            stack.upstream.release("blocker")
            await blocker


async def test_model_from_large_and_odd_bodies(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            padding = "x" * (32 * 1024 * 1024)
            big = json.dumps({"messages": [{"role": "user", "content": padding}], "model": "model-big"}).encode()
            big_reply = await chat(session, stack.url, "big", body=big)
            not_json = await chat(session, stack.url, "not-json", body=b"this is not json")
            no_model = await chat(session, stack.url, "no-model", model=None)
            odd_model = await chat(session, stack.url, "odd-model", body=b'{"model": 42}')
        assert [big_reply.status, not_json.status, no_model.status, odd_model.status] == [200, 200, 200, 200]
        hits = {hit.test_id: hit for hit in stack.upstream.hits}
        assert hits["big"].model == "model-big" and hits["big"].body_bytes == len(big)
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"big", "odd-model"}),
                                       what="the records")
        assert records["big"]["model"] == "model-big"  # read from the 32 MiB body
        assert records["odd-model"]["model"] is None  # not a string: no model
        # A single-model upstream serves every request with its one model, whatever the name.
        assert records["big"]["scheduled_model"] == "fake.gguf"
        assert stack.sidecar.queue()["resident_models"] == ["fake.gguf"]


async def test_streaming_passes_through_unbuffered(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            headers = {"x-test-id": "sse", "x-test-chunks": "4", "x-test-chunk-ms": "300",
                       "x-llamaswap-priority": "interactive"}
            body = json.dumps({"model": "model-a", "stream": True, "messages": []})
            async with session.post(f"{stack.url}/v1/chat/completions", data=body, headers=headers) as response:
                assert response.status == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                assert response.headers["x-llamaswap-band"] == "interactive"
                first = await response.content.readline()
                # The first event reached us while the upstream was still generating.
                assert stack.upstream.hits[0].end_ns is None
                rest = await response.read()
        assert first.startswith(b"data: ")
        assert rest.count(b"data: ") == 4  # three more chunks and [DONE]
        status, _ = http_get(f"{stack.sidecar.admin_url}/queue")
        assert status == 200


ENVOY_CONTROL_HEADERS = {
    "x-envoy-retry-on": "5xx,reset,retriable-status-codes",
    "x-envoy-retriable-status-codes": "500",
    "x-envoy-max-retries": "3",
    "x-envoy-upstream-rq-per-try-timeout-ms": "300",
}


async def test_a_clients_envoy_headers_never_give_one_grant_several_upstream_attempts(tmp_path: pathlib.Path) -> None:
    """The listener is the edge (use_remote_address, no internal addresses): a client's retry and
    per-try-timeout headers are not Envoy's to follow, so one grant is one upstream attempt."""
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            failed = await chat(session, stack.url, "fails", extra_headers={**ENVOY_CONTROL_HEADERS,
                                                                           "x-test-fail": "1"})
            slow = await chat(session, stack.url, "slow", sleep_ms=1000, extra_headers=ENVOY_CONTROL_HEADERS)
        assert (failed.status, slow.status) == (500, 200)  # no retry of the 500, no per-try timeout
        assert stack.upstream.order() == ["fails", "slow"]  # one attempt each
        with stack.upstream.lock:
            forwarded = [set(hit.headers) & set(ENVOY_CONTROL_HEADERS) for hit in stack.upstream.hits]
        assert forwarded == [set(), set()]  # an external client's x-envoy-* headers are dropped
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"fails", "slow"}),
                                       what="both activity records")
        assert (records["fails"]["outcome"], records["slow"]["outcome"]) == ("upstream_error", "served")


async def test_fail_open_never_passes_a_flood_past_the_stream_limit_unscheduled(tmp_path: pathlib.Path) -> None:
    """With envoy.failOpen: true, a flood past envoy.maxSidecarStreams gets 429 from the sidecar;
    Envoy's breaker is lifted, so its overflow can never be mistaken for an unreachable sidecar
    and let through to the GPU."""
    config = {"envoy": {"failOpen": True, "maxSidecarStreams": 3}}
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            # Three held Checks: the sidecar's stream limit is reached.
            waiting = [asyncio.create_task(chat(session, stack.url, f"w{i}")) for i in range(3)]
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 3, what="three waiting")
            flood = await asyncio.wait_for(
                asyncio.gather(*(chat(session, stack.url, f"flood-{i}") for i in range(4))), 60)
            assert [r.status for r in flood] == [429] * 4
            assert not [test_id for test_id in stack.upstream.order() if test_id.startswith("flood-")]
            assert stack.upstream.max_active == 1
            stack.upstream.release("blocker")
            replies = await asyncio.wait_for(asyncio.gather(blocker, *waiting), 60)
        assert [r.status for r in replies] == [200] * 4
        assert stack.upstream.max_active == 1
        body = json.loads(flood[0].body)
        assert "envoy.maxSidecarStreams" in body["error"]["message"]
