"""The OpenAI body's `service_tier` as a request's priority, through the real Envoy (its
json_to_metadata filter copies the key into the Check) and the real sidecar, against a fake
upstream: `flex` is batch, `default`/`auto` normal, `priority` interactive, when no
X-LlamaSwap-Priority is sent; the header wins, and the operator's policy applies."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any

import aiohttp
import pytest

from client import chat, start_blocker
from harness import async_wait_for, http_get, metric_samples, running_stack


def _body(tier: Any) -> bytes:
    # The tier after the messages: json_to_metadata reads a top-level key wherever it stands.
    return json.dumps({"model": "model-a", "messages": [{"role": "user", "content": "hi"}],
                       "service_tier": tier}).encode()


def _served(stack, count: int) -> dict[str, float] | None:
    samples = metric_samples(http_get(f"{stack.sidecar.admin_url}/metrics")[1].decode())
    return samples if samples.get('llamaswap_requests_total{outcome="served"}') == count else None


async def test_the_tier_orders_a_request_without_the_header(tmp_path: pathlib.Path) -> None:
    arrivals = [  # (request id, service_tier, X-LlamaSwap-Priority)
        ("flex", "flex", None),
        ("header-wins", "priority", "batch"),
        ("junk", 7, None),  # not a string: ignored, as no header
        ("default", "default", None),
        ("priority", "priority", None),
    ]
    with running_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(stack, session)
            tasks = []
            for index, (request_id, tier, header) in enumerate(arrivals):
                tasks.append(asyncio.create_task(chat(session, stack.url, request_id, priority=header,
                                                      body=_body(tier))))
                # Arrival order breaks ties: each one in the queue before the next is sent.
                await async_wait_for(lambda n=index + 1: len(stack.sidecar.queue()["waiting"]) == n,
                                     what=f"{request_id} in the queue")
            waiting = {w["request_id"]: w["priority"] for w in stack.sidecar.queue()["waiting"]}
            stack.upstream.release("blocker")
            replies = await asyncio.gather(blocker, *tasks)
            samples = await async_wait_for(lambda: _served(stack, 1 + len(arrivals)), what="every request counted")
    assert [r.status for r in replies] == [200] * (1 + len(arrivals))
    assert waiting == {"flex": -100, "header-wins": -100, "junk": 0, "default": 0, "priority": 100}
    assert stack.upstream.order() == ["blocker", "priority", "junk", "default", "flex", "header-wins"]
    by_id = {request_id: reply.headers for (request_id, _, _), reply in zip(arrivals, replies[1:])}
    assert {request_id: (h["x-llamaswap-priority"], h["x-llamaswap-band"]) for request_id, h in by_id.items()} == {
        "flex": ("-100", "batch"),
        "header-wins": ("-100", "batch"),
        "junk": ("0", "normal"),
        "default": ("0", "normal"),
        "priority": ("100", "interactive"),
    }
    # The body reaches the upstream as it was sent, its service_tier included.
    tiers = {request_id: tier for request_id, tier, _ in arrivals}
    assert {hit.test_id: hit.body_bytes for hit in stack.upstream.hits[1:]} == {
        request_id: len(_body(tier)) for request_id, tier in tiers.items()}
    # A tier is the caller's priority, not a missing header: only the blocker and the junk count as absent.
    assert samples["llamaswap_priority_absent_total"] == 2.0
    assert samples["llamaswap_priority_unparseable_total"] == 0.0


@pytest.mark.parametrize(("security", "expected"), [
    ({"mode": "clamp", "min": -50, "max": 50}, {"flex": ("-50", "batch"), "priority": ("50", "interactive")}),
    ({"mode": "strip"}, {"flex": ("0", "normal"), "priority": ("0", "normal")}),
])
async def test_the_operators_policy_applies_to_the_tier(tmp_path: pathlib.Path, security: dict[str, Any],
                                                       expected: dict[str, tuple[str, str]]) -> None:
    with running_stack(tmp_path, {"security": {"priority": security}}) as stack:
        async with aiohttp.ClientSession() as session:
            got = {}
            for tier in expected:
                reply = await chat(session, stack.url, tier, body=_body(tier))
                assert reply.status == 200, reply.body
                got[tier] = (reply.headers["x-llamaswap-priority"], reply.headers["x-llamaswap-band"])
    assert got == expected
