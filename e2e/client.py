"""A small async client for the tests: one chat completion through Envoy."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def chat(session: aiohttp.ClientSession, url: str, test_id: str, *, priority: str | None = None,
               model: str | None = "model-a", hold: bool = False, sleep_ms: int = 0, stream: bool = False,
               extra_headers: dict[str, str] | None = None, body: bytes | None = None) -> Reply:
    # The test id is the request id too, so /queue, /activity and the status route name it.
    headers = {"content-type": "application/json", "x-test-id": test_id, "x-request-id": test_id}
    if priority is not None:
        headers["x-llamaswap-priority"] = priority
    if hold:
        headers["x-test-hold"] = "1"
    if sleep_ms:
        headers["x-test-sleep-ms"] = str(sleep_ms)
    headers.update(extra_headers or {})
    if body is None:
        document: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
        if model is not None:
            document["model"] = model
        body = json.dumps(document).encode()
    async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
        return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, await response.read())


async def start_blocker(stack, session: aiohttp.ClientSession, test_id: str = "blocker", **kwargs: Any) -> asyncio.Task:
    """A request the fake upstream holds until released: the GPU is busy until then."""
    from harness import async_wait_for

    task = asyncio.create_task(chat(session, stack.url, test_id, hold=True, **kwargs))
    await async_wait_for(lambda: test_id in stack.upstream.order(), what=f"{test_id} at the upstream")
    return task
