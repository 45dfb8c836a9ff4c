"""Kept places in the runtime (routing.retryGraceSeconds) on virtual time: the coordinator keeps a
place when a waiting request's client leaves, a retry takes it over, observers hear each event
once; and the adapter's digest says which requests are the same one."""

from __future__ import annotations

from flow import FakeServicerContext, Flow, Request, check_request, virtual_time
from llamaswap.adapters.admin import queue_document
from llamaswap.adapters.ext_authz import Authorization, retry_digest
from llamaswap.commands.queue import render
from llamaswap.config import parse_config
from llamaswap.core import NS_PER_S, Outcome
from llamaswap.runtime.kept import KeptEventKind, RetryKeys, parse_attempt
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.ticket import Arrival, ExchangeEnd

KEY = b"k" * 16


async def _arrive(flow: Flow, request_id: str, *, key: bytes | None = KEY, attempt: int | None = None,
                  priority: str | None = None) -> Request:
    return await flow.admit(Arrival(request_id, priority, None, "m", "peer", None, None, "POST",
                                    "/v1/chat/completions", retry_key=key, attempt=attempt))


def _kinds(flow: Flow) -> list[KeptEventKind]:
    return [event.kind for event in flow.recorder.kept_events]


@virtual_time
async def test_a_retry_takes_over_the_place_its_client_left() -> None:
    flow = Flow()
    running = await _arrive(flow, "running", key=None)
    assert running.granted
    first = await _arrive(flow, "job", attempt=0)
    await flow.advance(1)
    later = await _arrive(flow, "later", key=b"another request.")
    await flow.advance(1)
    await flow.cancel(first)  # the SDK's timeout
    assert first.ticket.outcome is Outcome.CANCELLED_WAITING
    [row] = flow.coordinator.view().kept
    assert (row.request_id, row.attempt, row.waited_s, row.away_s) == ("job", 0, 2.0, 0.0)
    await flow.advance(0.5)  # its backoff
    retry = await _arrive(flow, "job", attempt=1)
    assert flow.waiting_ids() == ["job", "later"] and flow.coordinator.view().kept == ()
    await flow.complete(running)
    assert retry.granted and not later.granted
    ticket = retry.ticket
    assert ticket.takeover is not None and ticket.takeover.from_attempt == 0
    assert ticket.takeover.away_ns == NS_PER_S // 2
    assert ticket.decision is not None and ticket.decision.queue_wait_ns == round(2.5 * NS_PER_S)
    assert _kinds(flow) == [KeptEventKind.KEPT, KeptEventKind.TAKEN_OVER]


@virtual_time
async def test_an_untaken_place_expires_once_at_the_end_of_its_grace_period() -> None:
    flow = Flow({"routing": {"retryGraceSeconds": 3}})
    await _arrive(flow, "running", key=None)
    first = await _arrive(flow, "job")
    await flow.cancel(first)
    await flow.advance(2.999)
    assert _kinds(flow) == [KeptEventKind.KEPT] and len(flow.coordinator.view().kept) == 1
    await flow.advance(0.001)
    assert _kinds(flow) == [KeptEventKind.KEPT, KeptEventKind.EXPIRED]
    assert flow.coordinator.view().kept == ()
    await flow.advance(60)
    assert _kinds(flow) == [KeptEventKind.KEPT, KeptEventKind.EXPIRED]
    late = await _arrive(flow, "job")
    assert late.ticket.takeover is None


@virtual_time
async def test_kept_places_count_against_max_queued() -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1}}})
    await _arrive(flow, "running", key=None)
    first = await _arrive(flow, "job")
    await flow.cancel(first)
    refused = await _arrive(flow, "other", key=None)
    assert refused.refusal.outcome is Outcome.REJECTED_FULL and refused.refusal.queue_depth == 1
    retry = await _arrive(flow, "job")
    assert retry.waiting and retry.ticket.takeover is not None


@virtual_time
async def test_no_place_is_kept_with_the_grace_period_off_nor_without_a_digest() -> None:
    flow = Flow({"routing": {"retryGraceSeconds": 0}})
    await _arrive(flow, "running", key=None)
    first = await _arrive(flow, "job")
    await flow.cancel(first)
    assert flow.coordinator.view().kept == () and _kinds(flow) == []
    assert (await _arrive(flow, "job")).ticket.takeover is None
    on = Flow()
    await _arrive(on, "running", key=None)
    unknown = await _arrive(on, "job", key=None)
    await on.cancel(unknown)
    assert on.coordinator.view().kept == () and _kinds(on) == []


@virtual_time
async def test_a_request_that_got_the_gpu_never_leaves_a_place() -> None:
    flow = Flow()
    running = await _arrive(flow, "job")
    assert running.granted
    await _arrive(flow, "other", key=None)
    await flow.end(running, ExchangeEnd.CLIENT_LEFT)  # its client timed out while it generated
    assert running.ticket.outcome is Outcome.CANCELLED_RUNNING
    assert flow.coordinator.view().kept == () and _kinds(flow) == []
    assert (await _arrive(flow, "job")).ticket.takeover is None


@virtual_time
async def test_shutdown_ends_the_kept_places() -> None:
    flow = Flow()
    await _arrive(flow, "running", key=None)
    first = await _arrive(flow, "job")
    await flow.cancel(first)
    flow.coordinator.stop_admitting()
    await flow.idle()
    assert _kinds(flow) == [KeptEventKind.KEPT, KeptEventKind.EXPIRED]
    assert flow.coordinator.view().kept == ()


def _digest(keys: RetryKeys, headers: dict[str, str], body: bytes | None = None,
            address: str = "10.0.0.1", path: str = "/v1/chat/completions") -> bytes | None:
    request = check_request(headers)
    request.attributes.request.http.path = path
    request.attributes.source.address.socket_address.address = address
    if body is not None:
        request.attributes.request.http.raw_body = body
    return retry_digest(request, keys)


def test_the_same_request_is_the_same_caller_and_id_or_body() -> None:
    keys = RetryKeys()
    body = b'{"model":"m","messages":[]}'
    sized = {"content-length": str(len(body)), "authorization": "Bearer a"}
    # Envoy made up the id (it differs from the copy taken on arrival): the body decides.
    by_body = _digest(keys, {**sized, "x-request-id": "envoy-1"}, body)
    assert by_body is not None
    assert _digest(keys, {**sized, "x-request-id": "envoy-2"}, body) == by_body
    assert _digest(keys, {**sized, "authorization": "Bearer b", "x-request-id": "envoy-2"}, body) != by_body
    assert _digest(keys, {**sized, "x-request-id": "envoy-2"}, body, address="10.0.0.2") != by_body
    assert _digest(keys, {**sized, "x-request-id": "envoy-2"}, body.replace(b"[]", b"[1]")) != by_body
    # Only the beginning was sent: the full length tells bodies apart that begin alike.
    assert _digest(keys, {**sized, "content-length": "999999"}, body) != by_body
    # The client chose its id: the id decides, whatever the body.
    chosen = {**sized, "x-request-id": "job-7", "x-llamaswap-client-request-id": "job-7"}
    assert _digest(keys, chosen, body) == _digest(keys, chosen, b"another body")
    assert _digest(keys, {**chosen, "authorization": "Bearer b"}, body) != _digest(keys, chosen, body)
    # Another process's key: nothing in common.
    assert _digest(RetryKeys(), {**sized, "x-request-id": "envoy-1"}, body) != by_body
    # Without a body from Envoy (no content-length) and no id of the client's own: no digest.
    assert _digest(keys, {"x-request-id": "envoy-1"}) is None


def test_the_same_body_to_another_route_is_another_request() -> None:
    # managementApi: schedule: a load and an unload of one model send the same body; an unload
    # (it runs alone) is no retry of the load, nor a completion of a chat completion.
    keys = RetryKeys()
    body = b'{"model":"m"}'
    sized = {"content-length": str(len(body)), "x-request-id": "envoy-1"}
    load = _digest(keys, sized, body, path="/models/load")
    assert load is not None and load == _digest(keys, sized, body, path="/models/load")
    assert _digest(keys, sized, body, path="/models/unload") != load
    assert _digest(keys, sized, body, path="/v1/completions") != _digest(keys, sized, body)


def test_the_attempt_is_the_sdks_retry_count() -> None:
    assert [parse_attempt(v) for v in ("0", "2", None, "-1", "x", "99999")] == [0, 2, None, None, None, None]


@virtual_time
async def test_queue_and_the_command_list_a_kept_place() -> None:
    flow = Flow()
    running = await _arrive(flow, "running", key=None)
    first = await _arrive(flow, "job", attempt=2)
    await flow.advance(2)
    await flow.renew(running)  # (its lease: envoy.leaseSeconds)
    await flow.cancel(first)
    await flow.advance(1)
    document = queue_document(flow.coordinator.view())
    assert document["kept"] == [{"request_id": "job", "state": "kept", "attempt": 2, "priority": 0,
                                 "band": "normal", "model": "m", "waited_s": 3.0, "away_s": 1.0,
                                 "expires_in_s": 9.0}]
    summary, _, *rows = render(document).splitlines()
    assert summary.endswith(", 1 kept for a retry")
    assert rows[-1].split()[:3] == ["-", "K", "job"]


class _CountedDigest:
    """An adapter's deferred digest (`Arrival.retry_digest`) that counts how often it is computed."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.key


async def _arrive_deferred(flow: Flow, request_id: str, digest: _CountedDigest) -> Request:
    return await flow.admit(Arrival(request_id, None, None, "m", "peer", None, None, "POST",
                                    "/v1/chat/completions", retry_digest=digest))


@virtual_time
async def test_the_digest_is_computed_only_where_a_place_can_be_kept_or_taken_over() -> None:
    flow = Flow()
    at_once = _CountedDigest(b"another request.")
    running = await _arrive_deferred(flow, "running", at_once)
    assert running.granted
    left = _CountedDigest(KEY)
    first = await _arrive_deferred(flow, "job", left)
    assert left.calls == 0  # no place is kept: nothing to take over
    await flow.cancel(first)  # its client left: its place is kept under its digest
    assert left.calls == 1 and len(flow.coordinator.view().kept) == 1
    retried = _CountedDigest(KEY)
    retry = await _arrive_deferred(flow, "job", retried)  # a place is kept: it may be this one's
    assert retried.calls == 1 and retry.ticket.takeover is not None
    await flow.complete(running)
    assert retry.granted and retried.calls == 1
    # Granted at once with no place kept: never hashed, and never now (its Check was answered).
    assert at_once.calls == 0 and running.ticket.retry_key is None and at_once.calls == 0
    assert _kinds(flow) == [KeptEventKind.KEPT, KeptEventKind.TAKEN_OVER]


@virtual_time
async def test_a_connection_that_ends_keeps_the_places_of_its_waiting_requests() -> None:
    flow = Flow()
    await _arrive(flow, "running", key=None)
    digest = _CountedDigest(KEY)
    await _arrive_deferred(flow, "job", digest)
    await flow.peer_gone("peer")
    assert digest.calls == 1 and _kinds(flow) == [KeptEventKind.KEPT]
    assert [row.request_id for row in flow.coordinator.view().kept] == ["job"]


def test_the_adapter_hashes_the_body_only_when_the_digest_is_read() -> None:
    keys = RetryKeys()
    body = b'{"model":"m","messages":[]}'
    headers = {"content-length": str(len(body)), "authorization": "Bearer a", "x-request-id": "envoy-1",
               "x-stainless-retry-count": "1"}
    request = check_request(headers)
    http = request.attributes.request.http
    http.raw_body = body
    request.attributes.source.address.socket_address.address = "10.0.0.1"
    arrival = Authorization(Coordinator(parse_config({})), retry_keys=keys)._arrival(
        request, FakeServicerContext())  # type: ignore[arg-type]
    assert arrival.attempt == 1 and arrival.retry_digest is not None
    assert http.raw_body == body  # not hashed on arrival
    assert arrival.retry_digest() == _digest(keys, headers, body)
    assert http.raw_body == b""  # hashed, never kept
    off = Authorization(Coordinator(parse_config({"routing": {"retryGraceSeconds": 0}})), retry_keys=keys)._arrival(
        check_request(headers), FakeServicerContext())  # type: ignore[arg-type]
    assert off.retry_digest is None and off.attempt is None
