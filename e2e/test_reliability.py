"""Faults, bad input and security, through the real Envoy and the real sidecar."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import socket

import aiohttp
import pytest
import yaml

from client import chat, start_blocker
from harness import (EnvoyProcess, activity_records, SidecarProcess, async_wait_for, free_port, get_json, http_get,
                     metric_samples, running_stack, wait_for, write_config)
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import build_bootstrap


async def _queued(stack, count: int) -> None:
    await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == count, what=f"{count} waiting")


# -- bad input ------------------------------------------------------------------------------


def _raw_request(port: int, header_lines: list[bytes], body: bytes = b'{"model":"model-a"}') -> bytes:
    """Send bytes as they are (repeated headers, non-ASCII) and return the whole reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = [b"POST /v1/chat/completions HTTP/1.1", b"host: test", b"content-type: application/json",
                f"content-length: {len(body)}".encode(), b"connection: close", *header_lines]
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _reply_header(reply: bytes, name: bytes) -> bytes | None:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


@pytest.mark.parametrize(("header_lines", "expected", "counted_as"), [
    ([b"x-llamaswap-priority: "], b"0", "absent"),
    ([b"x-llamaswap-priority: " + b"9" * 4000], b"0", "unparseable"),
    ([b"x-llamaswap-priority: \xc3\xbcber"], b"0", "unparseable"),
    ([b"x-llamaswap-priority: 5", b"x-llamaswap-priority: 7"], b"0", "unparseable"),
    ([b"x-llamaswap-priority: 1e3"], b"0", "unparseable"),
    ([b"x-llamaswap-priority: +5"], b"5", None),
    ([b"x-llamaswap-priority:  7 "], b"7", None),
    ([b"x-llamaswap-priority: 9223372036854775808"], b"0", "unparseable"),
    ([b"x-llamaswap-priority: -9223372036854775808"], b"-9223372036854775808", None),
    ([b"x-llamaswap-priority: BATCH"], b"-100", None),
    ([], b"0", "absent"),
])
def test_odd_priority_headers_are_served(tmp_path: pathlib.Path, header_lines, expected, counted_as) -> None:
    with running_stack(tmp_path) as stack:
        reply = _raw_request(stack.envoy.port, header_lines)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert _reply_header(reply, b"x-llamaswap-priority") == expected
        # The request is counted when its exchange's end reaches the sidecar: poll for it.
        samples = wait_for(lambda: _served_metrics(stack), what="the request counted as served")
        assert samples["llamaswap_priority_unparseable_total"] == (1.0 if counted_as == "unparseable" else 0.0)
        assert samples["llamaswap_priority_absent_total"] == (1.0 if counted_as == "absent" else 0.0)


def _served_metrics(stack) -> dict[str, float] | None:
    samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
    return samples if samples.get('llamaswap_requests_total{outcome="served"}') == 1.0 else None


async def test_body_over_the_limit_gets_413(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"envoy": {"maxRequestBytes": 1024 * 1024}}) as stack:
        async with aiohttp.ClientSession() as session:
            too_big = json.dumps({"model": "model-a", "pad": "x" * (2 * 1024 * 1024)}).encode()
            reply = await chat(session, stack.url, "too-big", body=too_big)
            fits = await chat(session, stack.url, "fits", body=json.dumps({"model": "model-a",
                                                                          "pad": "x" * 1000}).encode())
        assert reply.status == 413
        assert fits.status == 200
        assert stack.upstream.order() == ["fits"]


async def test_slow_sender_never_holds_the_gpu(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        body = json.dumps({"model": "model-a", "messages": []}).encode()
        sock = socket.create_connection(("127.0.0.1", stack.envoy.port), timeout=30)
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                         b"x-test-id: slow\r\nx-llamaswap-priority: interactive\r\n"
                         + f"content-length: {len(body)}\r\n\r\n".encode() + body[:5])
            async with aiohttp.ClientSession() as session:
                # While the slow client is still sending, the GPU is free for others.
                fast = await chat(session, stack.url, "fast")
                assert fast.status == 200
                await async_wait_for(lambda: stack.sidecar.queue()["running"] is None, what="fast released")
                assert stack.sidecar.queue()["waiting"] == []  # the slow one is not even queued
            sock.sendall(body[5:])
            reply = await asyncio.to_thread(sock.recv, 65536)
        finally:
            sock.close()
        assert reply.startswith(b"HTTP/1.1 200")
        assert stack.upstream.order() == ["fast", "slow"]


# -- security --------------------------------------------------------------------------------


async def test_forged_ticket_does_not_skip_the_queue(tmp_path: pathlib.Path) -> None:
    """A grant's ticket lives only in Envoy's dynamic metadata, which no request header can set:
    a client that sends one (the old data path's header, or the metadata's key) waits its turn."""
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            forged = asyncio.create_task(chat(session, stack.url, "forged", extra_headers={
                "x-llamaswap-ticket": "guessed-or-stolen", "ticket": "guessed-or-stolen"}))
            await _queued(stack, 1)  # queued like everyone else, not waved through
            assert stack.upstream.order() == ["blocker"]
            # The admin API changes nothing, and Envoy's listener exposes only /metrics of it.
            assert http_get(f"{stack.sidecar.admin_url}/queue")[0] == 200
            async with session.post(f"{stack.sidecar.admin_url}/queue") as response:
                assert response.status == 405
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, forged)
        assert [r.status for r in replies] == [200, 200]
        assert stack.upstream.order() == ["blocker", "forged"]
        assert stack.upstream.max_active == 1


@pytest.mark.parametrize(("policy", "sent", "extra", "expected"), [
    ({"mode": "clamp", "min": -100, "max": 0}, "1000000", {}, "0"),
    ({"mode": "clamp", "min": -100, "max": 0}, "batch", {}, "-100"),
    ({"mode": "strip"}, "interactive", {}, "0"),
    ({"mode": "strip", "trustedHeader": "x-auth-priority"}, "interactive", {"x-auth-priority": "100"}, "100"),
])
async def test_priority_policy(tmp_path: pathlib.Path, policy, sent, extra, expected) -> None:
    with running_stack(tmp_path, {"security": {"priority": policy}}) as stack:
        async with aiohttp.ClientSession() as session:
            reply = await chat(session, stack.url, "r", priority=sent, extra_headers=extra)
        assert reply.status == 200
        assert reply.headers["x-llamaswap-priority"] == expected


# -- faults ------------------------------------------------------------------------------------


async def test_graceful_shutdown(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            waiting = [asyncio.create_task(chat(session, stack.url, f"w{i}")) for i in range(2)]
            await _queued(stack, 2)
            stack.sidecar.signal(signal.SIGTERM)
            rejected = await asyncio.gather(*waiting)
            assert [r.status for r in rejected] == [503, 503]
            assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
            assert rejected[0].json()["error"]["code"] == "shutting_down"
            assert stack.sidecar.alive()  # still finishing the running request
            stack.upstream.release("blocker")
            finished = await blocker
        assert finished.status == 200
        assert await asyncio.to_thread(stack.sidecar.popen.wait, 30) == 0
        assert stack.upstream.order() == ["blocker"]


async def test_reload_keeps_the_queue(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            waiting = [asyncio.create_task(chat(session, stack.url, name, model=model))
                       for name, model in (("lo", "model-lo"), ("hi", "model-hi"))]
            await _queued(stack, 2)
            document = yaml.safe_load(stack.config_path.read_text())
            bad = dict(document, routing={"scheduler": {"use": "lifo"}})
            stack.config_path.write_text(yaml.safe_dump(bad))
            stack.sidecar.signal(signal.SIGHUP)
            await async_wait_for(lambda: "reload refused" in stack.sidecar.log(), what="refusal logged")
            assert stack.sidecar.queue()["policy"] == "serial"
            good = dict(document, routing={"scheduler": {"use": "fifo"}}, models={"model-hi": {"priority": 50}})
            stack.config_path.write_text(yaml.safe_dump(good))
            stack.sidecar.signal(signal.SIGHUP)
            await async_wait_for(lambda: stack.sidecar.queue()["policy"] == "fifo", what="fifo after reload")
            assert [w["model"] for w in stack.sidecar.queue()["waiting"]] == ["model-hi", "model-lo"]
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *waiting)
        assert [r.status for r in replies] == [200, 200, 200]
        assert stack.upstream.order()[1:] == ["hi", "lo"]


async def test_watchdog_frees_a_runaway_grant(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path, {"routing": {"scheduler": {"maxRunSeconds": 1}}}) as stack:
        async with aiohttp.ClientSession() as session:
            runaway = await start_blocker(stack, session, "runaway")
            after = await chat(session, stack.url, "after")
            stack.upstream.release("runaway")
            await asyncio.gather(runaway, return_exceptions=True)
        assert after.status == 200
        assert stack.upstream.order() == ["runaway", "after"]
        records = await async_wait_for(lambda: activity_records(stack.sidecar.admin_url, {"runaway", "after"}),
                                       what="the records")
        samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
        assert records["runaway"]["outcome"] == "watchdog"
        assert samples["llamaswap_watchdog_fired_total"] == 1  # registered at 0: the value says it fired


async def test_upstream_refusing_connections(tmp_path: pathlib.Path) -> None:
    dead = free_port()
    # The startup settle asks a refused upstream again until settleTimeoutSeconds (it may be
    # restarting): keep that short here, where the upstream never comes.
    with running_stack(tmp_path, {"upstream": {"settleTimeoutSeconds": 1}},
                       upstream_url=f"http://127.0.0.1:{dead}") as stack:
        async with aiohttp.ClientSession() as session:
            first = await chat(session, stack.url, "one")
            second = await chat(session, stack.url, "two")
            await async_wait_for(lambda: stack.sidecar.queue()["running"] is None, what="GPU released")
        assert first.status == 503 and second.status == 503
        assert int(first.headers.get("retry-after", "0")) >= 1


def _fixed_port_stack(tmp_path: pathlib.Path, extra: dict | None = None):
    """Config, sidecar and bootstrap with fixed sidecar ports, so the sidecar can come back."""
    from fake_llama import FakeLlamaServer
    from harness import merge

    upstream = FakeLlamaServer().started()
    document = merge({
        "listen": {"http": "127.0.0.1:0", "grpc": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
        "upstream": {"url": upstream.url, "modelsPollSeconds": 0},
    }, extra or {})
    path = write_config(tmp_path, document)
    bootstrap = build_bootstrap(parse_config(document), envoy_admin_port=0)
    return upstream, path, bootstrap


@pytest.mark.parametrize("fail_open", [False, True])
async def test_sidecar_killed(tmp_path: pathlib.Path, fail_open: bool) -> None:
    # The start-up settle gives up on the still-busy upstream after 1 s, so that what holds the
    # GPU after the restart is the adoption alone.
    upstream, path, bootstrap = _fixed_port_stack(tmp_path, {"envoy": {"failOpen": fail_open},
                                                             "upstream": {"settleTimeoutSeconds": 1}})
    sidecar = SidecarProcess(path, tmp_path)
    envoy = EnvoyProcess(bootstrap, tmp_path)
    url = envoy.url
    try:
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(chat(session, url, "running", hold=True))
            await async_wait_for(lambda: "running" in upstream.order(), what="running at upstream")
            await async_wait_for(lambda: envoy.stat("access_logs.grpc_access_log.logs_written") > 0,
                                 what="a periodic entry for it (its worker's stream is open)")
            waiting = asyncio.create_task(chat(session, url, "waiting"))
            await async_wait_for(lambda: len(sidecar.queue()["waiting"]) == 1, what="one waiting")
            sidecar.popen.kill()
            reply = await asyncio.wait_for(waiting, 30)
            if fail_open:
                assert reply.status == 200  # the operator chose to let requests through unscheduled
            else:
                assert reply.status == 503
                assert int(reply.headers["retry-after"]) >= 1
                assert "waiting" not in upstream.order()
            sidecar.stop()
            sidecar = SidecarProcess(path, tmp_path, name="sidecar-2")
            # Back again while the exchange granted before the restart still runs: the new
            # process adopts it from Envoy's entries, and nothing else reaches the upstream.
            await async_wait_for(lambda: sidecar.queue()["gpu"] == "adopted", what="the running exchange adopted")
            upstream.max_active = upstream.active
            after = [asyncio.create_task(chat(session, url, f"after-{i}", sleep_ms=20)) for i in range(4)]
            await async_wait_for(lambda: len(sidecar.queue()["waiting"]) == 4, what="four waiting behind it")
            assert not [test_id for test_id in upstream.order() if test_id.startswith("after-")]
            upstream.release("running")
            await asyncio.wait_for(running, 30)
            replies = await asyncio.gather(*after)
        assert [r.status for r in replies] == [200] * 4
        assert upstream.max_active <= 1  # strictly one at a time, the adopted exchange included
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.close()


async def _restarted_with_max_run(sidecar: SidecarProcess, path: pathlib.Path, tmp_path: pathlib.Path,
                                  max_run_s: float) -> SidecarProcess:
    """Kill the sidecar, start a new one with routing.scheduler.maxRunSeconds set, and wait until
    it has adopted the exchange Envoy still reports."""
    sidecar.popen.kill()
    sidecar.stop()
    document = yaml.safe_load(path.read_text())
    document["routing"] = {"scheduler": {"maxRunSeconds": max_run_s}}
    path.write_text(yaml.safe_dump(document))
    restarted = SidecarProcess(path, tmp_path, name="sidecar-2")
    try:
        await async_wait_for(lambda: restarted.queue()["gpu"] == "adopted", what="the exchange adopted")
    except BaseException:
        restarted.stop()  # the caller's clean-up holds the old process, not this one
        raise
    return restarted


def _adopted_watchdog_sum_s(admin_url: str) -> float | None:
    """How long the adopted exchange the watchdog let go was held (s), once it was let go."""
    samples = metric_samples(http_get(f"{admin_url}/metrics")[1].decode())
    held = {name.split("{")[0]: value for name, value in samples.items()
            if name.startswith("llamaswap_upstream_settle_seconds_") and 'reason="adopted"' in name
            and 'result="watchdog"' in name}
    return held.get("llamaswap_upstream_settle_seconds_sum") if held.get(
        "llamaswap_upstream_settle_seconds_count") == 1 else None


async def test_an_exchange_adopted_after_a_restart_is_let_go_at_max_run_seconds_from_its_start(
        tmp_path: pathlib.Path) -> None:
    """The sidecar restarts while an exchange it granted runs on: the new process adopts it from
    Envoy's entries and holds the GPU for it, but not for ever: maxRunSeconds counts from the
    exchange's start (Envoy's start_time), so it is let go sooner after its adoption than that."""
    max_run_s = 8
    upstream, path, bootstrap = _fixed_port_stack(tmp_path, {"upstream": {"settleTimeoutSeconds": 1}})
    sidecar = SidecarProcess(path, tmp_path)
    envoy = EnvoyProcess(bootstrap, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(chat(session, envoy.url, "running", hold=True))
            await async_wait_for(lambda: "running" in upstream.order(), what="running at the upstream")
            await async_wait_for(lambda: envoy.stat("access_logs.grpc_access_log.logs_written") > 0,
                                 what="a periodic entry for it (its worker's stream is open)")
            sidecar = await _restarted_with_max_run(sidecar, path, tmp_path, max_run_s)
            after = asyncio.create_task(chat(session, envoy.url, "after"))
            held_s = await async_wait_for(lambda: _adopted_watchdog_sum_s(sidecar.admin_url), timeout=60,
                                          what="the adopted exchange let go by the watchdog")
            reply = await asyncio.wait_for(after, 30)
            assert "running" in upstream.order() and not running.done()  # let go, still held at the upstream
            upstream.release("running")
            await asyncio.wait_for(running, 30)
        assert reply.status == 200
        assert upstream.order() == ["running", "after"]
        # Counted from its adoption it would have been held maxRunSeconds at least (a timer
        # never fires early); counted from its start, the time before the restart is deducted.
        assert held_s < max_run_s
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.close()


async def test_an_exchange_that_waited_longer_than_max_run_seconds_is_adopted_after_a_restart(
        tmp_path: pathlib.Path) -> None:
    """Its age counts from its grant (its first byte to the upstream), not from its arrival:
    Envoy's start_time is the arrival, and the wait in the queue is no generation time. Issue 25:
    an exchange that had waited longer than maxRunSeconds was not adopted at all, and the next
    request ran beside it."""
    max_run_s = 12
    upstream, path, bootstrap = _fixed_port_stack(tmp_path, {"upstream": {"settleTimeoutSeconds": 1},
                                                             "envoy": {"leaseSeconds": 3}})
    sidecar = SidecarProcess(path, tmp_path)
    envoy = EnvoyProcess(bootstrap, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(chat(session, envoy.url, "first", hold=True))
            await async_wait_for(lambda: "first" in upstream.order(), what="first at the upstream")
            waited = asyncio.create_task(chat(session, envoy.url, "waited", hold=True))
            await async_wait_for(lambda: [row["waited_s"] for row in sidecar.queue()["waiting"]][0] > max_run_s,
                                 what=f"waited in the queue for more than {max_run_s} s")
            upstream.release("first")
            assert (await first).status == 200
            await async_wait_for(lambda: "waited" in upstream.order(), what="waited at the upstream")
            await async_wait_for(lambda: envoy.stat("access_logs.grpc_access_log.logs_written") > 1,
                                 what="a periodic entry for it")
            sidecar = await _restarted_with_max_run(sidecar, path, tmp_path, max_run_s)
            after = asyncio.create_task(chat(session, envoy.url, "after"))
            await async_wait_for(lambda: len(sidecar.queue()["waiting"]) == 1, what="after waiting behind it")
            assert "after" not in upstream.order()
            upstream.release("waited")
            replies = [await asyncio.wait_for(waited, 30), await asyncio.wait_for(after, 30)]
        assert [reply.status for reply in replies] == [200, 200]
        assert upstream.order() == ["first", "waited", "after"] and upstream.max_active == 1
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.close()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("worker", ["fresh", "warm"])
async def test_envoy_killed_while_a_request_runs_and_others_wait(tmp_path: pathlib.Path, signum, worker) -> None:
    """No ghost grant: a killed Envoy's warm worker's access-log stream ends with it and releases
    its grant at once; a fresh worker never opened one, so the grant lapses as a lease. Either
    way the next request after the restart is served, and never two at once."""
    upstream, path, bootstrap = _fixed_port_stack(tmp_path, {"envoy": {"leaseSeconds": 3}})
    sidecar = SidecarProcess(path, tmp_path)
    envoy = EnvoyProcess(bootstrap, tmp_path, concurrency=1)  # one worker: fresh or warm for sure
    logs_written = "access_logs.grpc_access_log.logs_written"
    try:
        async with aiohttp.ClientSession() as session:
            if worker == "warm":
                assert (await chat(session, envoy.url, "warm-up")).status == 200
                await async_wait_for(lambda: envoy.stat(logs_written) > 0, what="the warm-up's access-log entry")
            running = asyncio.create_task(chat(session, envoy.url, "running", hold=True))
            await async_wait_for(lambda: "running" in upstream.order(), what="running at the upstream")
            waiting = [asyncio.create_task(chat(session, envoy.url, f"w{i}")) for i in range(2)]
            await async_wait_for(lambda: len(sidecar.queue()["waiting"]) == 2, what="two waiting")
            assert (envoy.stat(logs_written) > 0) == (worker == "warm")
            envoy.signal(signum)
            assert await asyncio.to_thread(envoy.popen.wait, 30) is not None
            await asyncio.gather(running, *waiting, return_exceptions=True)
            upstream.release("running")  # the orphaned generation ends at the upstream
            await async_wait_for(lambda: sidecar.queue()["gpu"] == "idle" and not sidecar.queue()["waiting"],
                                 what="the grant released and the waiting gone")
            records = {r["request_id"]: r for r in get_json(f"{sidecar.admin_url}/activity")["activity"]}
            envoy.stop()
            envoy = EnvoyProcess(bootstrap, tmp_path, name="envoy-2", concurrency=1)
            after = await chat(session, envoy.url, "after")
        assert after.status == 200
        if signum == signal.SIGKILL:
            assert records["running"]["outcome"] == ("proxy_gone" if worker == "warm" else "lease_expired")
        else:
            # A stopping Envoy may still open a stream and report the exchange's end (the client
            # was cut off), or close the stream first: either way the grant ended with Envoy.
            assert records["running"]["outcome"] in ("cancelled_running", "proxy_gone", "lease_expired")
        assert [records[f"w{i}"]["outcome"] for i in range(2)] == ["cancelled_waiting", "cancelled_waiting"]
        assert upstream.order()[-1] == "after" and "w0" not in upstream.order()
        assert upstream.max_active == 1
    finally:
        envoy.stop()
        sidecar.stop()
        upstream.close()


async def test_disconnect_storm(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as storm_session:
                storm = [asyncio.create_task(chat(storm_session, stack.url, f"s{i}")) for i in range(1000)]
                await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 1000, timeout=120,
                                     interval=0.2, what="1000 waiting")
                for task in storm:
                    task.cancel()
                await asyncio.gather(*storm, return_exceptions=True)
            await async_wait_for(lambda: stack.sidecar.queue()["waiting"] == [], timeout=60, what="queue empty")
            stack.upstream.release("blocker")
            await blocker
            after = await chat(session, stack.url, "after")
        assert after.status == 200
        assert stack.upstream.order() == ["blocker", "after"]


async def test_burst_of_3000_is_served_exactly_once_in_order(tmp_path: pathlib.Path) -> None:
    """A burst larger than gRPC's default pending-call limits (1000/3000) loses nobody."""
    import random
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    config = {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0, "swapAffinityBonus": 0}}}}}
    rng = random.Random(3)
    with running_stack(tmp_path, config) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            blocker = await start_blocker(stack, session)
            priorities = [rng.choice((-100, -1, 0, 7, 100)) for _ in range(3000)]
            burst = [asyncio.create_task(chat(session, stack.url, f"r{i}:{p}", priority=str(p)))
                     for i, p in enumerate(priorities)]
            await async_wait_for(lambda: len(stack.sidecar.queue()["waiting"]) == 3000 or any(t.done() for t in burst),
                                 timeout=300, interval=0.5, what="3000 waiting")
            assert not any(task.done() for task in burst), "a request ended before the GPU was free"
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *burst)
    assert {reply.status for reply in replies} == {200}
    served = stack.upstream.order()[1:]
    assert sorted(served) == sorted(f"r{i}:{p}" for i, p in enumerate(priorities))  # each exactly once
    order = [int(test_id.split(":")[1]) for test_id in served]
    assert order == sorted(order, reverse=True)


async def test_changed_config_file_is_applied_without_a_signal(tmp_path: pathlib.Path) -> None:
    """A Kubernetes ConfigMap update changes the file, not the process: it is picked up."""
    with running_stack(tmp_path) as stack:
        document = yaml.safe_load(stack.config_path.read_text())
        changed = dict(document, routing={"scheduler": {"use": "fifo", "maxQueued": 7}})
        stack.config_path.write_text(yaml.safe_dump(changed))
        await async_wait_for(lambda: stack.sidecar.queue()["policy"] == "fifo", timeout=30,
                             what="the changed file applied")
        assert "configuration reloaded" in stack.sidecar.log()


async def test_a_reload_that_needs_a_new_envoy_bootstrap_is_refused(tmp_path: pathlib.Path) -> None:
    """Envoy keeps the bootstrap it started with: a change to its keys would leave the two
    disagreeing (a lease renewed at the old pace), so the sidecar refuses it and says why."""
    with running_stack(tmp_path) as stack:
        document = yaml.safe_load(stack.config_path.read_text())
        changed = dict(document, envoy={**document.get("envoy", {}), "leaseSeconds": 9},
                       routing={"scheduler": {"use": "fifo"}})
        stack.config_path.write_text(yaml.safe_dump(changed))
        stack.sidecar.signal(signal.SIGHUP)
        await async_wait_for(lambda: "reload refused" in stack.sidecar.log(), what="the refusal logged")
        assert "envoy changed, which Envoy's bootstrap uses" in stack.sidecar.log()
        assert stack.sidecar.queue()["policy"] == "serial"  # nothing of the file applied
