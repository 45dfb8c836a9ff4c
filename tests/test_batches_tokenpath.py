"""The token path's other ways (`batches/tokenpath.py`), against a stand-in for Envoy's listener
that answers like llama-server's token endpoints: an upstream without them, an answer that is no
answer about the line, a stream that breaks, an error in the stream, a stop before the first token."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from llamaswap.batches.feeder import Feeder, FeedSettings, StoppableLines
from llamaswap.batches.store import BatchRecord, Store
from llamaswap.telemetry.batches import new_trace_ids

ENDPOINT = "/v1/chat/completions"
MAX_TOKENS = 8
PROMPT = [1, 2, 3]


def token_at(position: int) -> int:
    """The stand-in's model: the token at a position of the sequence (prompt included)."""
    return 100 + position % 26


def letters(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + token - 100) for token in tokens)


UNDISTURBED = [token_at(len(PROMPT) + n) for n in range(MAX_TOKENS)]


class TokenServer:
    """Answers /apply-template, /tokenize and a streamed /completion; `completion` may be replaced
    per test to answer otherwise (the default streams the model's tokens)."""

    def __init__(self) -> None:
        self.completions: list[dict[str, Any]] = []
        self.chats: list[dict[str, Any]] = []  # the lines sent as they are (an upstream without the token path)
        self.template_status = 200
        self.hooks: list[Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse | None]]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def template(request: web.Request) -> web.Response:
            if self.template_status != 200:
                return web.json_response({"error": {"code": 404, "message": "File Not Found"}},
                                         status=self.template_status)
            return web.json_response({"prompt": "<prompt>"})

        async def tokenize(request: web.Request) -> web.Response:
            return web.json_response({"tokens": PROMPT})

        async def hooked(request: web.Request, body: dict[str, Any]) -> web.StreamResponse | None:
            """The next hook's answer (None: none, or it lets the default answer)."""
            return await self.hooks.pop(0)(request, body) if self.hooks else None

        async def completion(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.completions.append(body)
            return await hooked(request, body) or await stream(request, body)

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.chats.append(body)
            return await hooked(request, body) or web.json_response({
                "object": "chat.completion", "model": body["model"], "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": letters(UNDISTURBED)},
                     "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": MAX_TOKENS}})

        app = web.Application()
        app.router.add_post(ENDPOINT, chat)
        app.router.add_post("/apply-template", template)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/completion", completion)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def stream(request: web.Request, body: dict[str, Any], *, upto: int | None = None,
                 error: bool = False) -> web.StreamResponse:
    """The model's stream for ``body``: every token and the end; with ``upto``, that many tokens and
    then the connection closes (or, with ``error``, an error event comes instead of the rest)."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    prompt = body["prompt"]
    count = body["n_predict"] if upto is None else upto
    for n in range(count):
        token = token_at(len(prompt) + n)
        await response.write(_event({"content": letters([token]), "tokens": [token], "stop": False,
                                     "tokens_predicted": n + 1}))
    if error:
        await response.write(b'data: {"error": {"code": 500, "message": "decode failed"}}\n\n')
    elif upto is None:
        await response.write(_event({"content": "", "tokens": [], "stop": True, "stop_type": "limit",
                                     "tokens_predicted": count}))
    else:
        assert request.transport is not None
        request.transport.close()  # the stream breaks
        return response
    await response.write_eof()
    return response


def _event(document: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(document)}\n\n".encode()


class Rig:
    def __init__(self, tmp_path: pathlib.Path, server: TokenServer) -> None:
        self.store = Store(tmp_path / "batches")
        self.tmp_path = tmp_path
        self.feeder = Feeder(self.store, FeedSettings(server.url, lambda: 1, lambda: 1000, preempt=lambda: True))
        self.task = asyncio.create_task(self.feeder.run())

    def batch(self) -> str:
        upload = self.tmp_path / "upload"
        upload.write_text(json.dumps({"custom_id": "q", "method": "POST", "url": ENDPOINT, "body": {
            "model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
        record = self.store.add_file(upload, filename="in.jsonl", purpose="batch")
        trace_id, span_id = new_trace_ids()
        batch = self.store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h",
                                        window_s=3600, metadata=None, priority=-100, trace_id=trace_id,
                                        span_id=span_id)
        self.feeder.wake()
        return batch.id

    async def ended(self, batch_id: str) -> BatchRecord:
        deadline = asyncio.get_running_loop().time() + 30
        while (batch := self.store.batch(batch_id)) is None or not batch.status.ended:
            assert asyncio.get_running_loop().time() < deadline, "the batch did not end"
            await asyncio.sleep(0.01)
        return batch

    def records(self, file_id: str | None) -> list[dict[str, Any]]:
        assert file_id is not None
        return [json.loads(text) for text in self.store.file_path(file_id).read_text().splitlines()]

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.store.close()


@pytest.fixture
async def rig(tmp_path: pathlib.Path) -> AsyncIterator[tuple[TokenServer, Rig]]:
    server = TokenServer()
    await server.start()
    made = Rig(tmp_path, server)
    try:
        yield server, made
    finally:
        await made.close()
        await server.stop()


Hook = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse | None]]


def _unanswered() -> tuple[Hook, asyncio.Event, asyncio.Event]:
    """A hook that never answers: its request is `waiting` until its client leaves (`left`)."""
    waiting = asyncio.Event()
    left = asyncio.Event()

    async def waits(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        waiting.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:  # the client left (handler_cancellation)
            left.set()
            raise
        raise AssertionError("the stop did not close the request")

    return waits, waiting, left


def _answer(rig: Rig, batch: BatchRecord) -> dict[str, Any]:
    [record] = rig.records(batch.output_file_id)
    body: dict[str, Any] = record["response"]["body"]
    return body


async def test_an_upstream_without_the_token_endpoints_gets_the_line_as_it_is(
        rig: tuple[TokenServer, Rig]) -> None:
    """Not llama-server (its /apply-template answers 404): the line is sent as it is, and its
    answer is the upstream's, with its stops counted."""
    server, made = rig
    server.template_status = 404
    answer = _answer(made, await made.ended(made.batch()))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED) and answer["llamaswap"] == {"stops": 0}
    assert server.completions == [] and [chat["messages"] for chat in server.chats] == [
        [{"role": "user", "content": "hi"}]]


async def test_a_stop_restarts_a_line_the_upstream_cannot_continue(rig: tuple[TokenServer, Rig]) -> None:
    """Without the token path a stop closes the line's request at once and sends it again from its
    beginning: it keeps its place (its key, its first send), nothing of its tokens."""
    server, made = rig
    server.template_status = 404
    waits, waiting, left = _unanswered()
    resent = asyncio.Event()
    go_on = asyncio.Event()

    async def answers_when_told(request: web.Request, body: dict[str, Any]) -> None:
        resent.set()
        await go_on.wait()
        return None  # the default answer

    server.hooks += [waits, answers_when_told]
    batch_id = made.batch()
    await asyncio.wait_for(waiting.wait(), 30)
    request_id = f"{batch_id}:q"
    lines = StoppableLines(made.feeder)
    key = lines.key_of(request_id)
    first = made.feeder.line_state(request_id)
    assert key is not None and first is not None and made.feeder.may_stop(request_id)
    assert lines.stop(request_id)
    await asyncio.wait_for(left.wait(), 30)
    await asyncio.wait_for(resent.wait(), 30)
    again = made.feeder.line_state(request_id)  # the same place: its key and first send; one stop, no tokens
    assert again is not None and lines.key_of(request_id) == key
    assert (again.first_sent_at, again.stops, again.tokens) == (first.first_sent_at, 1, 0)
    go_on.set()
    answer = _answer(made, await made.ended(batch_id))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED) and answer["llamaswap"] == {"stops": 1}
    assert len(server.chats) == 2 and server.chats[0] == server.chats[1] and server.completions == []
    assert made.store.progress(batch_id, 0) is None  # nothing kept to resume from


async def test_a_part_answered_503_is_sent_again(rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig

    async def unavailable(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": {"message": "stopping"}}, status=503, headers={"retry-after-ms": "10"})

    server.hooks.append(unavailable)
    answer = _answer(made, await made.ended(made.batch()))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED)
    assert answer["llamaswap"] == {"stops": 0} and len(server.completions) == 2


async def test_a_broken_stream_keeps_its_tokens_and_goes_on_without_counting_a_stop(
        rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig

    async def breaks(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return await stream(request, body, upto=3)

    server.hooks.append(breaks)
    answer = _answer(made, await made.ended(made.batch()))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS and answer["llamaswap"] == {"stops": 0}
    assert [(body["prompt"], body["n_predict"]) for body in server.completions] == [
        (PROMPT, MAX_TOKENS), (PROMPT + UNDISTURBED[:3], MAX_TOKENS - 3)]


async def test_an_error_in_the_stream_is_the_lines_error(rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig

    async def fails(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return await stream(request, body, upto=2, error=True)

    server.hooks.append(fails)
    batch = await made.ended(made.batch())
    [record] = made.records(batch.error_file_id)
    assert record["response"]["status_code"] == 500 and record["error"]["message"] == "decode failed"


async def test_a_stop_before_the_first_token_closes_the_part_at_once(rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig
    waits, waiting, left = _unanswered()  # no answer yet: as a part waiting in the queue
    server.hooks.append(waits)
    batch_id = made.batch()
    await asyncio.wait_for(waiting.wait(), 30)
    request_id = f"{batch_id}:q"
    state = made.feeder.line_state(request_id)
    assert state is not None and state.tokens == 0
    lines = StoppableLines(made.feeder)
    key = lines.key_of(request_id)
    assert key is not None and key.endswith(request_id.encode()) and lines.key_of(f"{batch_id}:other") is None
    assert StoppableLines().key_of(request_id) is None and not StoppableLines().stop(request_id)
    # Its progress, as the queue's rows carry it: the feeder's state of it (None for any other).
    progress = lines.progress(request_id)
    assert progress is not None and (progress.stops, progress.tokens) == (0, 0)
    assert lines.progress(f"{batch_id}:other") is None and StoppableLines().progress(request_id) is None
    assert lines.stop(request_id)
    await asyncio.wait_for(left.wait(), 30)
    answer = _answer(made, await made.ended(batch_id))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED)
    assert answer["llamaswap"] == {"stops": 1}
    assert [body["n_predict"] for body in server.completions] == [MAX_TOKENS, MAX_TOKENS]
    assert lines.key_of(request_id) is None and lines.progress(request_id) is None  # ended: nothing to stop


async def test_an_answer_that_is_not_a_stream_of_tokens_is_the_lines_error(rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig

    async def not_a_stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"content": "all at once"})

    server.hooks.append(not_a_stream)
    batch = await made.ended(made.batch())
    [record] = made.records(batch.error_file_id)
    assert record["response"]["status_code"] == 500 and "llama-server" in record["error"]["message"]
    assert len(server.completions) == 1


async def test_a_line_abandoned_mid_part_keeps_its_tokens_for_the_next_start(rig: tuple[TokenServer, Rig]) -> None:
    server, made = rig

    async def stalls(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            token = token_at(len(body["prompt"]) + n)
            await response.write(_event({"content": letters([token]), "tokens": [token], "stop": False,
                                         "tokens_predicted": n + 1}))
        await asyncio.sleep(30)  # until the client leaves
        return response

    server.hooks.append(stalls)
    batch_id = made.batch()
    request_id = f"{batch_id}:q"
    deadline = asyncio.get_running_loop().time() + 30
    while (state := made.feeder.line_state(request_id)) is None or state.tokens < 3:
        assert asyncio.get_running_loop().time() < deadline, "the line did not read 3 tokens"
        await asyncio.sleep(0.01)
    made.task.cancel()  # the sidecar stops
    await asyncio.gather(made.task, return_exceptions=True)
    kept = made.store.progress(batch_id, 1)
    assert kept is not None and (list(kept.kept), kept.stops) == (UNDISTURBED[:3], 0)
    made.feeder = Feeder(made.store, made.feeder.settings)
    made.task = asyncio.create_task(made.feeder.run())
    answer = _answer(made, await made.ended(batch_id))
    assert answer["choices"][0]["message"]["content"] == letters(UNDISTURBED)
    assert (server.completions[-1]["prompt"], server.completions[-1]["n_predict"]) == (
        PROMPT + UNDISTURBED[:3], MAX_TOKENS - 3)
