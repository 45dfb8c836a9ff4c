"""Sending a chat line by the token path (llama-server; the rules: `batches/resume.py`), so that it
can be stopped at a token and resumed exactly: `/apply-template` and `/tokenize` once (their
result is kept with the line's progress at a stop), then a streamed `/completion` per part, each
through Envoy's listener at the batch's priority like any line (`json_to_metadata` reads the
body's `model` and `n_predict`: each part is scheduled as a request of the line's model).

A stop (`LineRun.stop`) closes the part's connection after the token being read (at once when
none came yet: the part still waits or reads its prompt); Envoy passes that on as a client that
leaves, the upstream is settled as for any abandoned generation, and the line's progress is
written to the store before its next part is sent, which then waits in the queue like any
request. The part's end wins over a stop that comes with it: a stop is acted on only between
events, and an ended part is the line's answer. A part whose connection breaks (Envoy or the
upstream gone) keeps its safe tokens too, not counted as a stop, and is sent again after a pause.
On an upstream without the token path (`/apply-template` answers 404, 405 or 501: not
llama-server) the line is sent as it is, and a stop closes it and sends it again from its
beginning (`TokenPath._restarts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from llamaswap.batches import resume, sse
from llamaswap.batches.http1 import AnswerTooLarge
from llamaswap.batches.resume import Part, Progress

_log = logging.getLogger(__name__)

TEMPLATE_PATH = "/apply-template"
# What an upstream without the token path (not llama-server: vLLM, SGLang, others) answers
# /apply-template: such a line is sent as it is, and a stop restarts it (`TokenPath._restarts`).
NO_TOKEN_PATH_STATUSES = frozenset({404, 405, 501})
TOKENIZE_PATH = "/tokenize"
COMPLETION_PATH = "/completion"
# The most of an error answer to a part that is read (it goes to the error file).
ERROR_MOST_BYTES = 1024 * 1024


class ProgressStore(Protocol):
    def progress(self, batch_id: str, line: int) -> Progress | None:
        ...

    def keep_progress(self, batch_id: str, line: int, request_id: str, progress: Progress) -> bool:
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class LineState:
    """What the feeder tells of a token-path line in flight (`Feeder.line_state`)."""

    first_sent_at: float  # wall-clock seconds of its first send (its place in the queue is kept from it)
    tokens: int  # generated so far: kept from its stopped parts and read in the part in flight
    stops: int
    stoppable: bool  # a part is in flight (waiting or running): `Feeder.stop_line` would stop it now
    stopping: bool = False  # a stop was asked of the part in flight, which has not let go yet


class LineRun:
    """A token-path line in flight: its progress, the part it streams now and whether a stop was
    asked (`stop`). Read by the feeder's `stop`, `running_tokens` and `first_sent_at`."""

    __slots__ = ("request_id", "progress", "part", "_stream", "stop_asked", "first_sent_at")

    def __init__(self, request_id: str, first_sent_at: float) -> None:
        self.request_id = request_id
        self.first_sent_at = first_sent_at
        self.progress: Progress | None = None
        self.part: Part | None = None
        self._stream: sse.Stream | None = None
        self.stop_asked = False

    @property
    def stoppable(self) -> bool:
        """Whether a part is in flight (not while the line prepares its prompt, pauses before a
        resend, or once its part ended)."""
        return self._stream is not None and self.part is not None and not self.part.ended

    def stop(self) -> bool:
        """Stop the part in flight at its next token (at once when no token came yet); False when
        none is (`stoppable`)."""
        if not self.stoppable or self.part is None or self._stream is None:
            return False
        self.stop_asked = True
        if not self.part.tokens:
            self._stream.close()
        return True

    def streaming(self, part: Part, stream: sse.Stream | None) -> None:
        """The part in flight now and its connection (None: the part's stream is over)."""
        self.part, self._stream = part, stream

    @property
    def tokens(self) -> int:
        """The tokens the line has now: kept from earlier parts and read in this one."""
        kept = len(self.progress.kept) if self.progress is not None else 0
        return kept + (len(self.part.tokens) if self.part is not None else 0)


# What the feeder provides: a short POST answered (sent again on no answer, 429, 502-504), and
# the pause before a part is sent again.
Post = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
Pause = Callable[[int, Mapping[str, str], str], Awaitable[None]]


class TokenPath:
    """Runs token-path lines against Envoy's listener at ``host:port``."""

    def __init__(self, host: str, port: int, store: ProgressStore, *, resend_statuses: frozenset[int]) -> None:
        self.host, self.port = host, port
        self.store = store
        self.resend_statuses = resend_statuses

    async def run(self, run: LineRun, batch_id: str, line: int, body: Mapping[str, Any], raw_body: bytes,
                  headers: bytes, post: Post, pause: Pause, most: int) -> tuple[int, bytes]:
        """The line's answer (status, body): its one chat.completion, or the first answer of the
        upstream that is an error about the line. ``body`` is the line's request body as read,
        ``raw_body`` the same as sent (where the upstream has no token path). AnswerTooLarge past
        ``most`` bytes."""
        progress = await asyncio.to_thread(self.store.progress, batch_id, line)
        if progress is None:
            prepared = await self._prepare(body, post, run.first_sent_at)
            if prepared is None:
                return await self._restarts(run, raw_body, headers, pause, most)
            if isinstance(prepared, tuple):
                return prepared
            progress = prepared
        else:
            run.first_sent_at = progress.first_sent_at
        run.progress = progress
        tries = 0
        while True:
            last = resume.finished_by_stops(body, progress)
            if last is None:
                try:
                    outcome = await self._part(run, body, headers, progress)
                except asyncio.CancelledError:
                    self._keep_at_cancel(run, batch_id, line, progress)
                    raise
                if isinstance(outcome, tuple):
                    status, answer_headers, answer = outcome
                    if status not in self.resend_statuses:
                        return status, answer
                    tries += 1
                    await pause(tries, answer_headers, f"HTTP {status}")
                    continue
                last = outcome
            if last.ended:
                document = json.dumps(resume.answer(body, progress, last, run.request_id, int(time.time()))).encode()
                if len(document) > most:
                    raise AnswerTooLarge(most, len(document))
                return 200, document
            asked, run.stop_asked = run.stop_asked, False
            progress = progress.stopped(last, counted=asked)
            run.progress, run.part = progress, None
            if not await asyncio.to_thread(self.store.keep_progress, batch_id, line, run.request_id, progress):
                _log.info("batch line %s: its progress was not kept (the line has a result)", run.request_id)
            if not asked:  # the connection broke: a pause, as for any line without an answer
                tries += 1
                await pause(tries, {}, "the stream broke")
            else:
                tries = 0
                _log.info("batch line %s: stopped with %d token(s) kept (stop %d); sent again to continue",
                          run.request_id, len(progress.kept), progress.stops)

    def _keep_at_cancel(self, run: LineRun, batch_id: str, line: int, progress: Progress) -> None:
        """The line is abandoned mid-part (the sidecar stops, its batch ends): the tokens it has are
        kept, so that a restart goes on from them (a batch that ended drops them with its rows).
        Written here, on the loop: a cancelled task cannot wait for a thread."""
        part = run.part
        if part is None or part.ended or part.safe_tokens == 0:
            return
        try:
            self.store.keep_progress(batch_id, line, run.request_id, progress.stopped(part, counted=False))
        except Exception as exc:  # noqa: BLE001 - then the line starts from its last kept tokens
            _log.warning("batch line %s: its tokens could not be kept as it was abandoned (%s)", run.request_id, exc)

    async def _prepare(self, body: Mapping[str, Any], post: Post,
                       first_sent_at: float) -> Progress | tuple[int, bytes] | None:
        """The prompt's tokens (an answer that is an error about the line: that answer; None: the
        upstream has no token path)."""
        status, answer = await post(TEMPLATE_PATH, json.dumps(resume.template_body(body)).encode())
        if status in NO_TOKEN_PATH_STATUSES:
            return None
        if status != 200:
            return status, answer
        prompt = resume.prompt_of(json.loads(answer))
        status, answer = await post(TOKENIZE_PATH, json.dumps(resume.tokenize_body(body["model"], prompt)).encode())
        if status != 200:
            return status, answer
        return Progress(resume.tokens_of(json.loads(answer)), first_sent_at=first_sent_at)

    async def _restarts(self, run: LineRun, request: bytes, headers: bytes, pause: Pause,
                        most: int) -> tuple[int, bytes]:
        """A line the upstream cannot continue (no token path): sent as it is, each send a part
        that a stop closes at once and that is then sent again from its beginning. Nothing is
        kept of a stopped send (its tokens are generated again), so nothing is written to the
        store: a sidecar that restarts sends the line afresh. The answer is the last send's, with
        the stops counted (`llamaswap.stops`)."""
        progress = run.progress = Progress((), first_sent_at=run.first_sent_at)
        tries = 0
        while True:
            part = Part()  # the send in flight: no tokens are read from it
            try:
                stream = await sse.send(self.host, self.port, resume.CHAT_ENDPOINT, headers, request)
            except OSError as exc:
                return 503, f"the listener cannot be reached: {exc}".encode()
            run.streaming(part, stream)
            answer: bytes | None = None
            try:
                await stream.head()
                answer = await stream.body(most)
            except OSError as exc:
                if not run.stop_asked:
                    _log.warning("batch line %s: its connection broke (%s)", run.request_id, exc)
            finally:
                run.streaming(part, None)
                stream.close()
            asked, run.stop_asked = run.stop_asked, False
            if answer is not None:  # (an answer that came with a stop wins: nothing to restart)
                if stream.status in self.resend_statuses:
                    tries += 1
                    await pause(tries, stream.headers, f"HTTP {stream.status}")
                    continue
                answered = 200 <= stream.status < 300
                return stream.status, resume.with_stops(answer, progress.stops) if answered else answer
            progress = run.progress = dataclasses.replace(progress, stops=progress.stops + asked)
            if asked:
                tries = 0
                _log.info("batch line %s: stopped (stop %d); sent again from its beginning (the upstream has no "
                          "token path)", run.request_id, progress.stops)
            else:
                tries += 1
                await pause(tries, {}, "the connection broke")

    async def _part(self, run: LineRun, body: Mapping[str, Any], headers: bytes,
                    progress: Progress) -> Part | tuple[int, Mapping[str, str], bytes]:
        """One streamed /completion: the part as read until its end, a stop or a broken
        connection; or the upstream's answer when it is not a stream (an error)."""
        part = Part(body.get("stop"))
        request = json.dumps(resume.completion_body(body, progress)).encode()
        try:
            stream = await sse.send(self.host, self.port, COMPLETION_PATH, headers, request)
        except OSError as exc:
            return 503, {}, f"the listener cannot be reached: {exc}".encode()
        run.streaming(part, stream)
        try:
            await stream.head()
            if stream.status != 200:
                return stream.status, stream.headers, await stream.body(ERROR_MOST_BYTES)
            if "text/event-stream" not in stream.headers.get("content-type", ""):
                # not llama-server's stream: sending it again would get the same (the line's error)
                return 500, {}, json.dumps({"error": {"message": (
                    f"the upstream answered {COMPLETION_PATH} without a stream of tokens: batches.preempt wants "
                    "llama-server"), "type": "server_error"}}).encode()
            async for text in stream.lines():
                event = resume.parse_event(text)
                if event is None:
                    continue
                if "error" in event:  # the generation failed part-way: the line's error
                    return 500, {}, json.dumps({"error": event["error"]}).encode()
                part.add(event)
                if run.stop_asked and not part.ended:
                    break
                # (An ended part is read to the answer's end before the hang-up: else Envoy may see a
                # client that left, and the slot is settled for nothing.)
        except OSError as exc:
            if not run.stop_asked:
                _log.warning("batch line %s: its stream broke after %d token(s) (%s)", run.request_id,
                             len(part.tokens), exc)
        finally:
            run.streaming(part, None)
            stream.close()
        return part
