"""The GPU benchmark's client: one completion timed, and N clients sending one after the other.

The same code sends to llama-server directly and through Envoy, so the difference between the
two is what llamaswap's path adds. Bodies are /v1/completions with a raw prompt (the random
models have no chat template) and `ignore_eos`, so that a request makes exactly `max_tokens`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp

PROMPT = "hello world the model token test swap load " * 4  # ~40 tokens: a short chat turn
TIMEOUT = aiohttp.ClientTimeout(total=600)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One completion as the client saw it."""

    first_byte_s: float  # request sent -> first token's chunk (streamed) or whole answer
    total_s: float  # request sent -> answer read
    tokens: int  # completion tokens
    server_ms: float  # llama-server's own prompt + generation time (its `timings`), 0 if absent
    queue_wait_ms: float  # llamaswap's x-llamaswap-queue-wait-ms, 0 straight to llama-server


def body(model: str | None, max_tokens: int, *, stream: bool) -> dict[str, object]:
    document: dict[str, object] = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                                   "stream": stream, "temperature": 0.0}
    if model is not None:
        document["model"] = model
    return document


async def complete(session: aiohttp.ClientSession, url: str, model: str | None, max_tokens: int, *,
                   stream: bool = False, priority: str | None = None) -> Answer:
    """POST url/v1/completions; raises RuntimeError on a status other than 200."""
    headers = {"x-llamaswap-priority": priority} if priority else {}
    started = time.perf_counter()
    first_byte = None
    async with session.post(f"{url}/v1/completions", json=body(model, max_tokens, stream=stream),
                            headers=headers, timeout=TIMEOUT) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} {model}: HTTP {response.status}: {(await response.text())[:300]}")
        wait_ms = float(response.headers.get("x-llamaswap-queue-wait-ms", 0) or 0)
        if not stream:
            document = await response.json()
            total = time.perf_counter() - started
            timings = document.get("timings") or {}
            return Answer(total, total, int(document["usage"]["completion_tokens"]),
                          float(timings.get("prompt_ms", 0)) + float(timings.get("predicted_ms", 0)), wait_ms)
        tokens = 0
        server_ms = 0.0
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                tokens += 1
                if first_byte is None:
                    first_byte = time.perf_counter() - started
            timings = chunk.get("timings")
            if timings:
                server_ms = float(timings.get("prompt_ms", 0)) + float(timings.get("predicted_ms", 0))
        total = time.perf_counter() - started
        return Answer(first_byte if first_byte is not None else total, total, tokens, server_ms, wait_ms)


async def clients(url: str, model: str | None, *, clients: int, requests_each: int, max_tokens: int,
                  priority: str | None = None) -> tuple[float, list[Answer]]:
    """`clients` clients, each sending `requests_each` requests one after the other: (wall seconds,
    every answer)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one_client() -> list[Answer]:
            return [await complete(session, url, model, max_tokens, priority=priority)
                    for _ in range(requests_each)]

        started = time.perf_counter()
        answers = await asyncio.gather(*(one_client() for _ in range(clients)))
        return time.perf_counter() - started, [a for client in answers for a in client]


async def for_a_while(url: str, model: str | None, *, clients: int, seconds: float, max_tokens: int
                      ) -> tuple[float, list[Answer]]:
    """`clients` clients sending one request after another until `seconds` have passed (each
    finishes the request it is in): (wall seconds, every answer)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        stop_at = time.perf_counter() + seconds

        async def one_client() -> list[Answer]:
            answers = []
            while time.perf_counter() < stop_at:
                answers.append(await complete(session, url, model, max_tokens))
            return answers

        started = time.perf_counter()
        answers = await asyncio.gather(*(one_client() for _ in range(clients)))
        return time.perf_counter() - started, [a for client in answers for a in client]
