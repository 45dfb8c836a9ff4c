"""The fake llama-server's token path (e2e/fake_llama.py adds these routes): `POST /apply-template`,
`POST /tokenize` and a streamed `POST /completion` with `return_tokens`, in the shapes llama-server
answers (measured: ../shared/facts/preemption.md), over a deterministic "model":

- a prompt's text is `<|user|>` and each message's content joined; its tokens are 1 (BOS) and
  each byte + 3;
- each next token is a function of every token before it (the prompt's and those generated),
  a letter's token (100 + 0..25) whose text is that letter: a resume on prompt + kept tokens
  continues exactly as the undisturbed run, as llama-server does at temperature 0;
- a stream sends one event per token (`content`, `tokens`, `tokens_predicted`), then a last one
  with `stop: true` and `stop_type` `limit` at `n_predict`.

Test controls (attributes): `hold_after` pauses each stream after that many tokens of it until
`release()`; `token_ms` paces the tokens. Records: `templates`, `tokenized` (each request's
body), `completions` (each /completion's prompt and n_predict), and `left` (streams whose
client left before their end: their prompt's length and tokens sent).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

BOS = 1
LETTER = 100


def prompt_text(messages: list[dict[str, Any]]) -> str:
    return "".join(f"<|{message.get('role')}|>{message.get('content')}" for message in messages) + "<|assistant|>"


def tokenize(text: str) -> list[int]:
    return [BOS, *(byte + 3 for byte in text.encode())]


def next_token(sequence: list[int]) -> int:
    weighted = sum((index + 1) * token for index, token in enumerate(sequence))
    return LETTER + (weighted * 2654435761 >> 7) % 26


def generate(prompt: list[int], count: int) -> list[int]:
    """What the fake generates for ``prompt``, undisturbed: ``count`` tokens."""
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(next_token(sequence))
    return sequence[len(prompt):]


def text_of(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + token - LETTER) for token in tokens)


class TokenRoutes:
    """The routes and their records; one per fake server."""

    def __init__(self) -> None:
        self.hold_after: int | None = None
        self.token_ms = 0.0
        self.templates: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.completions: list[tuple[list[int], int]] = []
        self.left: list[tuple[int, int]] = []
        self._release: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.held = 0  # streams paused at hold_after now

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/apply-template", self._template)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/completion", self._completion)

    def release(self) -> None:
        """Let every held stream go on (those held later wait for the next release)."""
        if self._loop is None:  # no stream came yet
            return

        def _set() -> None:
            if self._release is not None:
                self._release.set()
                self._release = None

        self._loop.call_soon_threadsafe(_set)

    async def _template(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.templates.append(body)
        return web.json_response({"prompt": prompt_text(body["messages"])})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        return web.json_response({"tokens": tokenize(body["content"])})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        self._loop = asyncio.get_running_loop()
        body = await request.json()
        prompt, n_predict = list(body["prompt"]), int(body["n_predict"])
        self.completions.append((prompt, n_predict))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        sequence = list(prompt)
        sent = 0
        try:
            while True:
                if sent == self.hold_after:  # (at n_predict: before the stream's last event)
                    if self._release is None:
                        self._release = asyncio.Event()
                    release = self._release
                    self.held += 1
                    try:
                        await release.wait()
                    finally:
                        self.held -= 1
                if sent >= n_predict:
                    break
                token = next_token(sequence)
                sequence.append(token)
                sent += 1
                await response.write(_event({"content": text_of([token]), "tokens": [token], "stop": False,
                                             "tokens_predicted": sent, "tokens_evaluated": len(prompt)}))
                if self.token_ms:
                    await asyncio.sleep(self.token_ms / 1000)
            await response.write(_event({"content": "", "tokens": [], "stop": True, "stop_type": "limit",
                                         "tokens_predicted": sent, "tokens_evaluated": len(prompt)}))
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.left.append((len(prompt), sent))
            raise
        return response


def _event(document: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(document)}\n\n".encode()
