"""Feeding batches: each line goes to Envoy's public listener like any client's request, at the
batch's priority, at most `batches.inFlight` lines of one batch at a time, and what comes back
is recorded once in the store.

Why through Envoy and not to the coordinator directly: a line is then scheduled, traced, counted,
shown and settled exactly like a client's request, by the one rule, with no second path to keep.

What happens to a line:
- the upstream's answer (any status but those below) is its result: 2xx to the output file,
  anything else to the error file with its status and body;
- no answer (Envoy down, a connection reset), 429 (the queue is full) and 502/503/504 (llamaswap
  stopping, its wait limit, the upstream gone) are not an answer about the line: it is sent
  again after a pause (its Retry-After where given), until the batch's window ends;
- a line running when the sidecar is killed has no result: it is sent again after the restart.
  The GPU may compute it twice; the store keeps its first result only.
Cancel abandons the lines in flight like a client that leaves (waiting ones leave the queue at
once, running ones are settled as any abandoned generation) and ends every line without a result
as cancelled; the window's end does the same as expired.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from llamaswap.batches.http1 import Http1Client, header_block
from llamaswap.batches.lifecycle import BatchStatus, LineOutcome, ended_status, line_request_id
from llamaswap.batches.store import BatchRecord, Result, Store
from llamaswap.batches.validate import InputLine, LineError, Validation, line_body, validate
from llamaswap.core.priority import HEADER as PRIORITY_HEADER

_log = logging.getLogger(__name__)

# Statuses that are no answer about the line: it is sent again.
RESEND_STATUSES = frozenset({429, 502, 503, 504})
RESEND_FIRST_S = 0.5
RESEND_MOST_S = 30.0
# Lines read from the store at once, ahead of those in flight.
READ_AHEAD = 64
# Lines' results are written together, one transaction for those that ended within RESULTS_S
# (or RESULTS_LINES of them): a transaction per line was the feeder's largest cost after the
# HTTP client's. A kill loses at most those: their lines are sent again, as the running ones are.
RESULTS_S = 0.05
RESULTS_LINES = 64
# How often the feeder looks at the batches when nothing wakes it (a new batch, a cancel and a
# line's end do): for the completion window's end.
IDLE_LOOK_S = 5.0


class BatchObserver(Protocol):
    """What telemetry learns from the feeder (a no-op by default)."""

    def line_started(self, batch: BatchRecord, line: InputLine, request_id: str) -> dict[str, str]:
        """A line is about to be sent: the headers that join it to its batch's trace."""
        ...

    def line_ended(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, status_code: int | None,
                   answered_ns: int | None = None) -> None:
        """A line's result was recorded; ``answered_ns``: when its answer came (time.time_ns()),
        where that was before now (results are written together)."""
        ...

    def lines_ended(self, outcome: LineOutcome, count: int) -> None:
        """Lines that ended unanswered (expired, cancelled)."""
        ...

    def batch_ended(self, batch: BatchRecord) -> None:
        ...

    def statuses(self, counts: Mapping[BatchStatus, int]) -> None:
        """How many batches are in each status now."""
        ...


class NoBatchObserver:
    def line_started(self, batch: BatchRecord, line: InputLine, request_id: str) -> dict[str, str]:
        return {}

    def line_ended(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, status_code: int | None,
                   answered_ns: int | None = None) -> None:
        pass

    def lines_ended(self, outcome: LineOutcome, count: int) -> None:
        pass

    def batch_ended(self, batch: BatchRecord) -> None:
        pass

    def statuses(self, counts: Mapping[BatchStatus, int]) -> None:
        pass


@dataclasses.dataclass(frozen=True, slots=True)
class FeedSettings:
    """Where lines go and how they are marked. ``in_flight`` is read at each look (a reload may
    change batches.inFlight); ``priority_header`` is the header that carries the priority
    (security.priority.trustedHeader where set, else X-LlamaSwap-Priority)."""

    target_url: str
    in_flight: Callable[[], int]
    max_requests: Callable[[], int]
    priority_header: str = PRIORITY_HEADER
    # Sent with every line: the upstream's key (upstream.apiKey), which the Batch API's callers
    # had to show (batches/api.py), as llama-server wants it of every request.
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The priority a batch's lines are sent at now (the API's BatchService.line_priority: the
    # policy in force, the creator's ceiling); None: the one the batch was created with.
    line_priority: Callable[[BatchRecord], int] | None = None


async def any_model(model: str) -> bool:
    """Whether a model is served, when nothing can tell: every one is."""
    return True


def result_id(batch_id: str, line: int) -> str:
    """A line's `id` in the output: the same on every try, so a line sent again is the same record."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{line}".encode()).hexdigest()[:24]


def answer_record(batch_id: str, line: InputLine, status: int, request_id: str, body: bytes) -> dict[str, Any]:
    """The output or error file's line for an answer of the upstream."""
    try:
        document: Any = json.loads(body)
    except ValueError:
        document = body.decode("utf-8", "replace")
    error = None
    if not 200 <= status < 300:
        detail = document.get("error") if isinstance(document, dict) else None
        message = detail.get("message") if isinstance(detail, dict) else None
        error = {"code": f"http_{status}", "message": message if isinstance(message, str) else
                 f"the upstream answered {status}"}
    return {"id": result_id(batch_id, line.line), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": document}, "error": error}


def ended_record(batch_id: str, line: InputLine, outcome: LineOutcome) -> dict[str, Any]:
    """The error file's line for a line never answered (expired, cancelled)."""
    message = {LineOutcome.EXPIRED: "the batch's completion window ended before this request ran",
               LineOutcome.CANCELLED: "the batch was cancelled before this request finished"}[outcome]
    return {"id": result_id(batch_id, line.line), "custom_id": line.custom_id, "response": None,
            "error": {"code": outcome.error_code, "message": message}}


class Feeder:
    """Sends every feeding batch's lines and ends batches; `run` until cancelled."""

    def __init__(self, store: Store, settings: FeedSettings, *, observer: BatchObserver | None = None,
                 serves: Callable[[str], Awaitable[bool]] = any_model) -> None:
        self.store = store
        self.settings = settings
        # Asked as admission asks (the coordinator's `serves`): a line it would refuse fails the batch.
        self._serves = serves
        self.observer: BatchObserver = observer or NoBatchObserver()
        self._wake = asyncio.Event()
        self._paused = False
        self._stopping: set[str] = set()  # batches cancelled since the last look ended them
        self._flying: dict[str, dict[int, asyncio.Task[None]]] = {}  # batch id -> line -> its sending
        # batch id -> the last line started: every line up to it has a result or is in flight, so
        # the next ones are read from there (a read from the start would cost O(lines) each time).
        self._cursor: dict[str, int] = {}
        # batch id -> the next lines after the cursor, read ahead in one query (a line's end then
        # starts the next without asking the store)
        self._ahead: dict[str, collections.deque[InputLine]] = {}
        self._client: Http1Client | None = None
        # batch id -> its input file, open while the batch feeds (a line's body is read at its offset)
        self._inputs: dict[str, int] = {}
        # batch id -> the priority its lines are sent at and the headers every line of it carries, as bytes
        self._headers: dict[str, tuple[int, bytes]] = {}
        # answered lines whose results are not written yet (`_write_results`), and the timer that writes them
        self._results: list[tuple[BatchRecord, Result, int, int]] = []  # ..., its status, when (time_ns)
        self._results_timer: asyncio.TimerHandle | None = None

    def wake(self) -> None:
        """Look at the batches now (a batch was created or cancelled)."""
        self._wake.set()

    def stop_feeding(self, batch_id: str) -> None:
        """The batch is cancelling: no line of it starts from now (a look then ends it)."""
        self._stopping.add(batch_id)
        self._wake.set()

    def pause(self) -> None:
        """Send no more lines (the sidecar is stopping); those in flight go on."""
        self._paused = True

    def in_flight(self, batch_id: str) -> int:
        """Lines of a batch sent and not yet answered (waiting or running, or pausing to be sent again)."""
        return len(self._flying.get(batch_id, {}))

    async def run(self) -> None:
        # No total timeout: a line may wait for the GPU for hours (the scheduler bounds it).
        target = urllib.parse.urlsplit(self.settings.target_url)
        self._client = Http1Client(target.hostname or "127.0.0.1", target.port or 80)
        try:
            while True:
                self._wake.clear()
                try:
                    await self.look()
                except Exception:  # noqa: BLE001 - the feeder must outlive any one batch's trouble
                    _log.exception("batches: a look at the batches failed; trying again")
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
                # comes as the wait ends, and a feeder woken often then outlived its stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_LOOK_S):
                        await self._wake.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop sending; lines in flight are abandoned (sent again at the next start), the results
        of those answered are written."""
        tasks = [task for lines in self._flying.values() for task in lines.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._flying.clear()
        self._write_results()
        for batch_id in list(self._inputs):
            self._close_input(batch_id)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def look(self) -> None:
        """One pass over the batches that are not ended: fill, expire, cancel, finalize."""
        active = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
        for batch in reversed(await asyncio.to_thread(self.store.batches, statuses=active)):  # oldest first
            if batch.status is BatchStatus.CANCELLING:
                await self._end(batch, LineOutcome.CANCELLED)
            elif batch.status is BatchStatus.FINALIZING:  # every line has its result: not expired
                await self._finalize(batch, BatchStatus.COMPLETED)
            elif self.store.now() >= batch.expires_at:
                await self._end(batch, LineOutcome.EXPIRED)
            elif batch.status is BatchStatus.VALIDATING:
                await self._validate(batch)
            else:
                await self._fill(batch)
        self.observer.statuses(self.store.status_counts())

    async def _validate(self, batch: BatchRecord) -> None:
        def read() -> Validation:
            with open(self.store.file_path(batch.input_file_id), "rb") as source:
                return validate(source, endpoint=batch.endpoint, max_requests=self.settings.max_requests())

        try:
            validation = await asyncio.to_thread(read)
            validation = validation.without_models([model for model in validation.models
                                                    if not await self._serves(model)])
        except OSError as exc:
            _log.error("batch %s: its input file %s cannot be read (%s)", batch.id, batch.input_file_id, exc)
            validation = Validation((), (LineError("input_file_unreadable", None,
                                                   f"the input file cannot be read: {exc}"),))
        if await asyncio.to_thread(self.store.validated, batch.id, validation.lines, validation.errors,
                                   validation.more_errors):
            if validation.errors:
                _log.info("batch %s failed validation: %d problem(s)", batch.id,
                          len(validation.errors) + validation.more_errors)
                final = self.store.batch(batch.id)
                if final is not None:
                    self.observer.batch_ended(final)
            else:
                _log.info("batch %s: %d line(s) at priority %d", batch.id, len(validation.lines), batch.priority)
                self._wake.set()

    async def _fill(self, batch: BatchRecord) -> None:
        if self._paused:  # nothing starts (the sidecar is stopping): no end to look for either
            return
        if self._start_lines(batch) or self._flying.get(batch.id):
            return
        self._write_results()
        # Nothing after the cursor and nothing in flight: done, unless a line before the cursor
        # lost its sending without a result (then read from the start again).
        if self.store.unfinished_lines(batch.id, limit=1):
            self._rewind(batch.id)
            self._wake.set()
        elif self.store.set_status(batch.id, BatchStatus.FINALIZING, only_from=(BatchStatus.IN_PROGRESS,)):
            await self._finalize(batch, BatchStatus.COMPLETED)

    def _start_lines(self, batch: BatchRecord) -> int:
        """Send the batch's next lines up to batches.inFlight; how many started. Called by a look
        and, without one, by each line that ends (the next line goes out at once: a look per line
        would cost a read of every batch)."""
        flying = self._flying.setdefault(batch.id, {})
        room = max(1, self.settings.in_flight()) - len(flying)
        if room <= 0 or self._paused or batch.id in self._stopping:
            return 0
        ahead = self._ahead.setdefault(batch.id, collections.deque())
        if len(ahead) < room:
            after = ahead[-1].line if ahead else self._cursor.get(batch.id, 0)
            ahead.extend(self.store.unfinished_lines(batch.id, after=after, limit=max(READ_AHEAD, room)))
        started = 0
        while ahead and started < room:
            line = ahead.popleft()
            if line.line in flying:
                continue
            flying[line.line] = asyncio.create_task(self._send(batch, line), name=f"{batch.id}:{line.line}")
            self._cursor[batch.id] = line.line
            started += 1
        return started

    def _rewind(self, batch_id: str) -> None:
        """Read the batch's lines from its start again (a line lost its sending without a result)."""
        self._cursor[batch_id] = 0
        self._ahead.pop(batch_id, None)

    def _line_ended(self, batch: BatchRecord) -> None:
        """A line's end frees its place: the next one goes out now while the batch still feeds;
        anything else (its last line, a cancel, the window's end) is a look's to handle."""
        feeding = self.store.now() < batch.expires_at and batch.id not in self._stopping
        if not feeding or (not self._start_lines(batch) and not self._flying.get(batch.id)):
            self._wake.set()

    async def _end(self, batch: BatchRecord, outcome: LineOutcome) -> None:
        """Cancel or expire: abandon what is in flight, end every line without a result so, finalize."""
        flying = self._flying.pop(batch.id, {})
        for task in flying.values():
            task.cancel()
        await asyncio.gather(*flying.values(), return_exceptions=True)
        self._write_results()  # answered lines keep their answers
        ended = await asyncio.to_thread(self.store.end_unfinished, batch.id, outcome,
                                        lambda line: ended_record(batch.id, line, outcome))
        if ended:
            _log.info("batch %s: %d line(s) %s", batch.id, ended, outcome.value)
            self.observer.lines_ended(outcome, ended)
        status = ended_status(expired=outcome is LineOutcome.EXPIRED, cancelled=outcome is LineOutcome.CANCELLED)
        await self._finalize(batch, status)

    async def _finalize(self, batch: BatchRecord, status: BatchStatus) -> None:
        self._write_results()
        final = await asyncio.to_thread(self.store.finalize, batch, status)
        self._flying.pop(batch.id, None)
        self._cursor.pop(batch.id, None)
        self._ahead.pop(batch.id, None)
        self._stopping.discard(batch.id)
        self._close_input(batch.id)
        counts = self.store.counts(batch.id, batch.total)
        _log.info("batch %s %s: %d completed, %d failed of %d", batch.id, status.value, counts.completed,
                  counts.failed, counts.total)
        self.observer.batch_ended(final)

    async def _send(self, batch: BatchRecord, line: InputLine) -> None:
        request_id = line_request_id(batch.id, line.custom_id, line.line)
        try:
            headers = self._batch_headers(batch) + header_block(
                {"x-request-id": request_id, **self.observer.line_started(batch, line, request_id)})
            status, answer = await self._post_until_answered(batch, request_id, self._body(batch, line), headers)
        except asyncio.CancelledError:
            self._forget(batch, line)  # abandoned (cancel, expiry, stop): a look decides what comes next
            raise
        # The result is kept to be written with others (`_write_results`), before the next line
        # starts: a look that finds nothing left to send writes it before it asks the store. A
        # kill before the write sends this line again, and its first result is the one kept.
        outcome = LineOutcome.COMPLETED if 200 <= status < 300 else LineOutcome.FAILED
        self._results.append((batch, Result(batch.id, line, outcome, answer_record(
            batch.id, line, status, request_id, answer), self.store.now_exact()), status, time.time_ns()))
        if len(self._results) >= RESULTS_LINES:
            self._write_results()
        elif self._results_timer is None:
            self._results_timer = asyncio.get_running_loop().call_later(RESULTS_S, self._write_results)
        self._forget(batch, line)
        self._line_ended(batch)

    def _write_results(self) -> None:
        """Write the answered lines' results, one transaction (the store's first write wins)."""
        if self._results_timer is not None:
            self._results_timer.cancel()
            self._results_timer = None
        pending, self._results = self._results, []
        if not pending:
            return
        try:
            added = self.store.record_results([result for _, result, _, _ in pending])
        except Exception:  # noqa: BLE001 - the lines stay without results; a look sends them again
            _log.exception("batches: the results of %d line(s) could not be recorded; they are sent again",
                           len(pending))
            for batch_id in {result.batch_id for _, result, _, _ in pending}:
                self._rewind(batch_id)
            self._wake.set()
            return
        for (batch, result, status, answered_ns), new in zip(pending, added):
            if new:
                self.observer.line_ended(batch, result.line, result.outcome, status, answered_ns)

    def _forget(self, batch: BatchRecord, line: InputLine) -> None:
        flying = self._flying.get(batch.id)
        if flying is not None and flying.get(line.line) is asyncio.current_task():
            del flying[line.line]

    def _batch_headers(self, batch: BatchRecord) -> bytes:
        # Asked at every line: a reload that tightens the clamp bounds the lines sent after it.
        priority = batch.priority if self.settings.line_priority is None else self.settings.line_priority(batch)
        kept = self._headers.get(batch.id)
        if kept is None or kept[0] != priority:
            kept = self._headers[batch.id] = (priority, header_block({
                **self.settings.headers, "content-type": "application/json",
                self.settings.priority_header: str(priority)}))
        return kept[1]

    def _body(self, batch: BatchRecord, line: InputLine) -> bytes:
        fd = self._inputs.get(batch.id)
        if fd is None:  # kept open while the batch feeds (its file cannot be deleted meanwhile)
            fd = self._inputs[batch.id] = os.open(self.store.file_path(batch.input_file_id), os.O_RDONLY)
        return line_body(os.pread(fd, line.length, line.offset))

    def _close_input(self, batch_id: str) -> None:
        self._headers.pop(batch_id, None)
        fd = self._inputs.pop(batch_id, None)
        if fd is not None:
            os.close(fd)

    async def _post_until_answered(self, batch: BatchRecord, request_id: str, body: bytes,
                                   headers: bytes) -> tuple[int, bytes]:
        pause_s = RESEND_FIRST_S
        tries = 0
        while True:
            assert self._client is not None
            tries += 1
            try:
                response = await self._client.post(batch.endpoint, headers, body)
                if response.status not in RESEND_STATUSES:
                    return response.status, response.body
                wait_s = _retry_after(response.headers) or pause_s
                why = f"HTTP {response.status} ({response.headers.get('x-llamaswap-outcome') or 'no outcome'})"
            except (OSError, asyncio.TimeoutError) as exc:
                wait_s, why = pause_s, f"{type(exc).__name__}: {exc}"
            if tries in (1, 10) or tries % 100 == 0:
                _log.warning("batch line %s: %s; sending it again in %.1f s (try %d)", request_id, why, wait_s, tries)
            await asyncio.sleep(min(wait_s, RESEND_MOST_S))
            pause_s = min(pause_s * 2, RESEND_MOST_S)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return max(0.0, float(headers[name]) * scale)
        except (KeyError, ValueError):
            continue
    return None
