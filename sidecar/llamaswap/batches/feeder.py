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
  The GPU may compute it twice; the store keeps its first result only;
- an answer longer than batches.maxAnswerBytes is not read (the connection is dropped as soon as
  its length is known to pass it): the line ends with the error `answer_too_large`, not sent again;
- a line whose body cannot be read (its input file gone or cut short) ends with the error
  `input_line_unreadable`; any other failure of its sending ends it with `line_failed`: no line
  stays in flight for ever, and its batch can finalize;
- an answer whose result cannot be written (a full disk) is kept, not asked again: the batch
  pauses (no line starts) until the write succeeds (`writer.ResultWriter`).
With batches.preempt, a chat line that can be continued exactly takes llama-server's token path
(`batches/tokenpath.py`): `stop_line` stops it at a token, its progress is kept in the store,
and it is sent again to continue from there (its one answer as if it had run once).
Cancel abandons the lines in flight like a client that leaves (waiting ones leave the queue at
once, running ones are settled as any abandoned generation) and ends every line without a result
as cancelled; the window's end does the same as expired.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from llamaswap.batches import resume
from llamaswap.batches.feeding import BatchObserver, FeedSettings, NoBatchObserver
from llamaswap.batches.http1 import AnswerTooLarge, Http1Client, header_block
from llamaswap.batches.lifecycle import BatchStatus, LineOutcome, ended_status, line_request_id
from llamaswap.batches.output import Stage, let_others_run
from llamaswap.batches.records import (
    LineUnreadable,
    answer_record,
    ended_record,
    failed_record,
    parsed_body,
    read_exactly,
)
from llamaswap.batches.rows import BatchRecord, Result
from llamaswap.batches.store import Store
from llamaswap.batches.tokenpath import LineRun, LineState, TokenPath
from llamaswap.batches.validate import WHOLE_PARSE_BYTES, InputLine, LineError, Validation, validate
from llamaswap.batches.writer import Answered, ResultWriter

__all__ = ["BatchObserver", "FeedSettings", "Feeder", "LineState", "NoBatchObserver", "StoppableLines", "any_model",
           "out_of_space"]

_log = logging.getLogger(__name__)

# Statuses that are no answer about the line: it is sent again.
RESEND_STATUSES = frozenset({429, 502, 503, 504})
RESEND_FIRST_S = 0.5
RESEND_MOST_S = 30.0
# Lines read from the store at once, ahead of those in flight.
READ_AHEAD = 64
# A line's body (or an answer) up to this is parsed and re-serialised on the event loop (tens of
# microseconds); a longer answer in a worker thread. A longer line was scanned at validation (the
# same bound) and its body is sent as it lies in the file (InputLine.body_offset), never parsed;
# only a line recorded before body offsets were kept is parsed, in a worker thread.
INLINE_BODY_BYTES = WHOLE_PARSE_BYTES
# How often the feeder looks at the batches when nothing wakes it (a new batch, a cancel and a
# line's end do): for the completion window's end.
IDLE_LOOK_S = 5.0
# Where a stoppable line's place is kept (`Feeder.line_key`): apart from a client's retry keys (digests).
LINE_KEY_PREFIX = b"batch-line:"


async def any_model(model: str) -> bool:
    """Whether a model is served, when nothing can tell: every one is."""
    return True


def out_of_space(exc: BaseException) -> bool:
    """Whether a failed write is the disk's (full, or over a quota): it passes when space returns."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)


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
        # answered lines whose results are not written yet: written together, kept while writes fail
        self._writer = ResultWriter(store.record_results, written=self._result_written, recovered=self._wake.set)
        # request id -> a line of the token path in flight (what `stop_line` stops)
        self._runs: dict[str, LineRun] = {}
        self._token_path: TokenPath | None = None

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

    def stop_line(self, request_id: str) -> bool:
        """Stop the line sent with this x-request-id at its next token (at once where no token came
        yet) and send it again to continue from its tokens: it then waits in the queue like any
        request (an upstream without the token path: sent again from its beginning). True where
        it was a line of the token path with a part in flight (waiting or running); False for any
        other: a line on the plain path (never stopped), one preparing
        its prompt, pausing before a resend or whose part just ended (its end wins), an unknown id.
        Called on the feeder's event loop (the sidecar's)."""
        run = self._runs.get(request_id)
        return run is not None and run.stop()

    def line_key(self, request_id: str) -> bytes | None:
        """The key a stoppable line's place is kept under, the same for each of its parts, while a
        part of it is in flight (asked when the part reaches admission); None for any other request
        (a line's template and tokenize requests, a line on the plain path, a client's)."""
        run = self._runs.get(request_id)
        return LINE_KEY_PREFIX + request_id.encode() if run is not None and run.stoppable else None

    def may_stop(self, request_id: str) -> bool:
        """A line with a key (`line_key`) that may still be stopped: fewer than
        batches.maxPreemptions stops so far (after that it runs to its end)."""
        run = self._runs.get(request_id)
        stops = run.progress.stops if run is not None and run.progress is not None else 0
        return run is not None and run.stoppable and stops < self.settings.max_preemptions()

    def line_state(self, request_id: str) -> LineState | None:
        """A token-path line in flight: when it was first sent, its tokens now, its stops, whether
        a stop would stop it now (None: no such line here). The same first send is kept in the
        store at each stop (`Store.progress_of_request`), for a restart."""
        run = self._runs.get(request_id)
        if run is None:
            return None
        return LineState(run.first_sent_at, run.tokens, run.progress.stops if run.progress is not None else 0,
                         run.stoppable, run.stop_asked)

    @property
    def writes_failing(self) -> bool:
        """Whether results cannot be written now (a full disk): no line starts until they can."""
        return self._writer.failing

    async def run(self) -> None:
        # No total timeout: a line may wait for the GPU for hours (the scheduler bounds it).
        target = urllib.parse.urlsplit(self.settings.target_url)
        self._client = Http1Client(target.hostname or "127.0.0.1", target.port or 80)
        self._token_path = TokenPath(self._client.host, self._client.port, self.store,
                                     resend_statuses=RESEND_STATUSES)
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
        await self._writer.close()
        for batch_id in list(self._inputs):
            self._close_input(batch_id)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def look(self) -> None:
        """One pass over the batches that are not ended: fill, expire, cancel, finalize."""
        active = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
        for batch in reversed(await asyncio.to_thread(self.store.batches, statuses=active)):  # oldest first
            # Each batch on its own: one whose step raises is logged, and the others go on (its
            # validating and finalizing attempts are counted, so it cannot fail for ever).
            try:
                await self._look_at(batch)
            except Exception:  # noqa: BLE001 - one batch's trouble must not stop the others
                _log.exception("batch %s (%s): this look at it failed; the other batches go on", batch.id,
                               batch.status.value)
        self.observer.statuses(await asyncio.to_thread(self.store.status_counts))

    async def _look_at(self, batch: BatchRecord) -> None:
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

    async def _attempt(self, batch: BatchRecord, stage: Stage) -> bool:
        """Count an attempt at ``stage`` before it starts; False when the batch failed there too
        often already: it is ended `failed` now, saying why."""
        attempt = await asyncio.to_thread(self.store.begin_attempt, batch.id, stage)
        if attempt is not None:
            if attempt > 1:
                _log.warning("batch %s: %s, attempt %d (the last one failed or the sidecar stopped during it)",
                             batch.id, stage.value, attempt)
            return True
        if await asyncio.to_thread(self.store.fail_batch, batch.id, stage):
            _log.error("batch %s failed: %s", batch.id, stage.failure[1])
            self._forget_batch(batch.id)
            final = await asyncio.to_thread(self.store.batch, batch.id)
            if final is not None:
                self.observer.batch_ended(final)
        return False

    def _forgive(self, batch: BatchRecord, stage: Stage) -> None:
        try:
            self.store.forgive_attempt(batch.id, stage)
        except Exception as exc:  # noqa: BLE001 - then it stays counted, no worse
            _log.warning("batch %s: its %s attempt stays counted (%s)", batch.id, stage.value, exc)

    async def _validate(self, batch: BatchRecord) -> None:
        max_requests, max_line_bytes = self.settings.max_requests(), self.settings.max_line_bytes()

        def read() -> Validation:
            with open(self.store.file_path(batch.input_file_id), "rb") as source:
                return validate(source, endpoint=batch.endpoint, max_requests=max_requests,
                                max_line_bytes=max_line_bytes, pause=let_others_run)

        if not await self._attempt(batch, Stage.VALIDATE):
            return
        try:
            validation = await asyncio.to_thread(read)
            validation = validation.without_models([model for model in validation.models
                                                    if not await self._serves(model)])
        except OSError as exc:
            _log.error("batch %s: its input file %s cannot be read (%s)", batch.id, batch.input_file_id, exc)
            validation = Validation((), (LineError("input_file_unreadable", None,
                                                   f"the input file cannot be read: {exc}"),))
        except asyncio.CancelledError:  # the sidecar stops: not the batch's failure
            self._forgive(batch, Stage.VALIDATE)
            raise
        try:
            moved_on = await asyncio.to_thread(self.store.validated, batch.id, validation.lines, validation.errors,
                                               validation.more_errors)
        except Exception as exc:
            if not out_of_space(exc):
                raise  # counted: a look logs it, and the batch fails after ATTEMPTS_MOST
            self._forgive(batch, Stage.VALIDATE)
            _log.error("batch %s: its lines cannot be recorded (%s); it stays validating and is tried again at the "
                       "next look", batch.id, exc)
            return
        if moved_on:
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
        ahead = self._ahead.setdefault(batch.id, collections.deque())
        if not ahead and not self._flying.get(batch.id) and not self._writer.blocking:
            # The first read after a start or a rewind may pass many lines that have results:
            # in a worker thread. (Nothing of this batch is in flight, so no line's end reads
            # ahead meanwhile; later reads start from the cursor and are short.)
            after = self._cursor.get(batch.id, 0)
            read = await asyncio.to_thread(self.store.unfinished_lines, batch.id, after=after, limit=READ_AHEAD)
            if not ahead and not self._flying.get(batch.id):
                ahead.extend(read)
        if self._start_lines(batch) or self._flying.get(batch.id):
            return
        # Nothing after the cursor and nothing in flight: its answers written, done, unless a
        # line before the cursor was given back without a result (then read from the start again).
        if not await self._writer.flush(batch.id):
            return  # results kept unwritten (a full disk): the writer wakes a look once they are
        if await asyncio.to_thread(self.store.unfinished_lines, batch.id, limit=1):  # a scan of every line
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
        if room <= 0 or self._paused or batch.id in self._stopping or self._writer.blocking:
            return 0
        ahead = self._ahead.setdefault(batch.id, collections.deque())
        if len(ahead) < room:
            after = ahead[-1].line if ahead else self._cursor.get(batch.id, 0)
            ahead.extend(self.store.unfinished_lines(batch.id, after=after, limit=max(READ_AHEAD, room)))
        started = 0
        while ahead and started < room:
            line = ahead.popleft()
            if line.line in flying or self._writer.is_unwritten(batch.id, line.line):
                continue  # answered, its result not written yet: never sent again
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
        if not await self._writer.flush(batch.id):  # answered lines keep their answers: written first
            return  # a full disk: the next look tries again
        ended = await asyncio.to_thread(self.store.end_unfinished, batch.id, outcome,
                                        lambda line: ended_record(batch.id, line, outcome))
        if ended:
            _log.info("batch %s: %d line(s) %s", batch.id, ended, outcome.value)
            self.observer.lines_ended(outcome, ended)
        status = ended_status(expired=outcome is LineOutcome.EXPIRED, cancelled=outcome is LineOutcome.CANCELLED)
        await self._finalize(batch, status)

    async def _finalize(self, batch: BatchRecord, status: BatchStatus) -> None:
        if not await self._writer.flush(batch.id):
            return  # its answers are not all written (a full disk): the next look tries again
        if not await self._attempt(batch, Stage.FINALIZE):
            return
        try:
            final = await asyncio.to_thread(self.store.finalize, batch, status)
        except asyncio.CancelledError:  # the sidecar stops: not the batch's failure
            self._forgive(batch, Stage.FINALIZE)
            raise
        except Exception as exc:
            if not out_of_space(exc):
                raise  # counted: a look logs it, and the batch fails after ATTEMPTS_MOST
            self._forgive(batch, Stage.FINALIZE)
            _log.error("batch %s: its output files cannot be written (%s); it stays %s and is tried again at the "
                       "next look", batch.id, exc, batch.status.value)
            return
        self._forget_batch(batch.id)
        if final is None:  # it moved meanwhile (a cancel during expiry): the next look ends it so
            self._forgive(batch, Stage.FINALIZE)
            _log.info("batch %s: moved while it was finalized as %s; looked at again", batch.id, status.value)
            self._wake.set()
            return
        counts = self.store.counts(batch.id, batch.total)
        _log.info("batch %s %s: %d completed, %d failed of %d", batch.id, status.value, counts.completed,
                  counts.failed, counts.total)
        self.observer.batch_ended(final)

    async def _send(self, batch: BatchRecord, line: InputLine) -> None:
        """Send one line until it is answered; every way out ends it: a result kept to be written
        (`writer`), or, when abandoned (cancel, expiry, stop), the line given back without one."""
        request_id = line_request_id(batch.id, line.custom_id, line.line)
        try:
            await self._send_once(batch, line, request_id)
        except asyncio.CancelledError:
            self._forget(batch, line)  # abandoned: a look decides what comes next
            raise
        except Exception as exc:  # noqa: BLE001 - a line must end, not stay in flight for ever
            _log.exception("batch %s line %d: sending it failed; it ends with line_failed", batch.id, line.line)
            self._keep_result(batch, line, LineOutcome.FAILED, failed_record(
                batch.id, line, "line_failed", f"llamaswap could not send this request: {type(exc).__name__}: {exc}"),
                None)
        self._forget(batch, line)
        self._line_ended(batch)

    async def _send_once(self, batch: BatchRecord, line: InputLine, request_id: str) -> None:
        try:
            body = await self._body(batch, line)
        except LineUnreadable as exc:
            _log.error("batch %s line %d: %s", batch.id, line.line, exc)
            self._keep_result(batch, line, LineOutcome.FAILED, failed_record(
                batch.id, line, "input_line_unreadable", str(exc)), None)
            return
        headers = self._batch_headers(batch) + header_block(
            {"x-request-id": request_id, **self.observer.line_started(batch, line, request_id)})
        try:
            document = await self._continuable(batch, body)
            if document is None:
                status, answer = await self._post_until_answered(batch, request_id, body, headers)
            else:
                status, answer = await self._send_by_tokens(batch, line, request_id, document, body, headers)
        except AnswerTooLarge as exc:  # the same answer again: never asked again
            _log.error("batch %s line %d: %s (batches.maxAnswerBytes); it ends with answer_too_large", batch.id,
                       line.line, exc)
            self._keep_result(batch, line, LineOutcome.FAILED, failed_record(
                batch.id, line, "answer_too_large",
                f"the upstream's answer to this request has more than {exc.most} bytes (batches.maxAnswerBytes): "
                "ask for less in one request (fewer inputs, fewer tokens), or raise batches.maxAnswerBytes"), None)
            return
        # Kept to be written with others, before the next line starts; a kill before the
        # write sends this line again, and its first result is the one kept.
        outcome = LineOutcome.COMPLETED if 200 <= status < 300 else LineOutcome.FAILED
        if len(answer) <= INLINE_BODY_BYTES:
            record = answer_record(batch.id, line, status, request_id, answer)
        else:  # a long answer (embeddings) is parsed off the event loop
            record = await asyncio.to_thread(answer_record, batch.id, line, status, request_id, answer)
        self._keep_result(batch, line, outcome, record, status)

    def _keep_result(self, batch: BatchRecord, line: InputLine, outcome: LineOutcome, record: str,
                     status: int | None) -> None:
        self._writer.add(Answered(batch, Result(batch.id, line, outcome, record, self.store.now_exact()), status,
                                  time.time_ns()))

    def _result_written(self, answered: Answered, new: bool) -> None:
        if new:
            self.observer.line_ended(answered.batch, answered.result.line, answered.result.outcome,
                                     answered.status_code, answered.answered_ns)

    def _forget_batch(self, batch_id: str) -> None:
        """The batch ended: nothing of it is kept here."""
        self._flying.pop(batch_id, None)
        self._cursor.pop(batch_id, None)
        self._ahead.pop(batch_id, None)
        self._stopping.discard(batch_id)
        self._close_input(batch_id)

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

    async def _body(self, batch: BatchRecord, line: InputLine) -> bytes:
        """The line's request body: re-serialised from its line (a short one on the loop, a
        longer one in a thread), or, for a line too long to parse, read as it lies in the file.
        LineUnreadable when the input file is gone, cut short or no longer what was validated."""
        try:
            fd = self._inputs.get(batch.id)
            if fd is None:  # kept open while the batch feeds (its file cannot be deleted meanwhile)
                fd = self._inputs[batch.id] = os.open(self.store.file_path(batch.input_file_id), os.O_RDONLY)
        except OSError as exc:
            raise LineUnreadable(f"the input file {batch.input_file_id} cannot be read: {exc}") from exc
        if line.body_offset is not None and line.body_length is not None:
            return await asyncio.to_thread(read_exactly, fd, line.body_offset, line.body_length, batch, line)
        if line.length <= INLINE_BODY_BYTES:
            return parsed_body(read_exactly(fd, line.offset, line.length, batch, line), batch, line)
        return await asyncio.to_thread(
            lambda: parsed_body(read_exactly(fd, line.offset, line.length, batch, line), batch, line))

    def _close_input(self, batch_id: str) -> None:
        self._headers.pop(batch_id, None)
        fd = self._inputs.pop(batch_id, None)
        if fd is not None:
            os.close(fd)

    async def _continuable(self, batch: BatchRecord, body: bytes) -> dict[str, Any] | None:
        """The line's body where it takes the token path (batches.preempt on, a chat line that can
        be continued exactly: `resume.not_continuable`), else None."""
        if batch.endpoint != resume.CHAT_ENDPOINT or not self.settings.preempt():
            return None
        try:
            document = json.loads(body) if len(body) <= INLINE_BODY_BYTES else await asyncio.to_thread(json.loads, body)
        except ValueError:
            return None
        return document if isinstance(document, dict) and resume.not_continuable(document) is None else None

    async def _send_by_tokens(self, batch: BatchRecord, line: InputLine, request_id: str, document: dict[str, Any],
                              body: bytes, headers: bytes) -> tuple[int, bytes]:
        assert self._token_path is not None
        run = self._runs[request_id] = LineRun(request_id, self.store.now_exact())
        try:
            return await self._token_path.run(
                run, batch.id, line.line, document, body, headers,
                post=lambda path, data: self._post_until_answered(batch, request_id, data, headers, path),
                pause=lambda tries, answer_headers, why: self._pause(request_id, tries, answer_headers, why),
                most=self.settings.max_answer_bytes())
        finally:
            if self._runs.get(request_id) is run:
                del self._runs[request_id]

    async def _post_until_answered(self, batch: BatchRecord, request_id: str, body: bytes,
                                   headers: bytes, path: str | None = None) -> tuple[int, bytes]:
        tries = 0
        while True:
            assert self._client is not None
            tries += 1
            try:
                response = await self._client.post(path or batch.endpoint, headers, body,
                                                   most=self.settings.max_answer_bytes())
                if response.status not in RESEND_STATUSES:
                    return response.status, response.body
                answer_headers: Mapping[str, str] = response.headers
                why = f"HTTP {response.status} ({response.headers.get('x-llamaswap-outcome') or 'no outcome'})"
            except (OSError, asyncio.TimeoutError) as exc:
                answer_headers, why = {}, f"{type(exc).__name__}: {exc}"
            await self._pause(request_id, tries, answer_headers, why)

    async def _pause(self, request_id: str, tries: int, headers: Mapping[str, str], why: str) -> None:
        """Before a line is sent again (its ``tries``th try had no answer about it): the answer's
        Retry-After where given, else RESEND_FIRST_S doubling, at most RESEND_MOST_S."""
        wait_s = _retry_after(headers) or min(RESEND_FIRST_S * 2 ** min(tries - 1, 16), RESEND_MOST_S)
        if tries in (1, 10) or tries % 100 == 0:
            _log.warning("batch line %s: %s; sending it again in %.1f s (try %d)", request_id, why, wait_s, tries)
        await asyncio.sleep(min(wait_s, RESEND_MOST_S))


class StoppableLines:
    """The feeder's lines as the runtime stops them (runtime/stops.py's `Lines`): ``feeder`` may be
    set after this is made (None: no Batch API, nothing is stopped)."""

    def __init__(self, feeder: Feeder | None = None) -> None:
        self.feeder = feeder

    def key_of(self, request_id: str) -> bytes | None:
        return self.feeder.line_key(request_id) if self.feeder is not None else None

    def may_stop(self, request_id: str) -> bool:
        return self.feeder.may_stop(request_id) if self.feeder is not None else False

    def stop(self, request_id: str) -> bool:
        return self.feeder.stop_line(request_id) if self.feeder is not None else False

    def progress(self, request_id: str) -> LineState | None:
        return self.feeder.line_state(request_id) if self.feeder is not None else None


def _retry_after(headers: Mapping[str, str]) -> float | None:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return max(0.0, float(headers[name]) * scale)
        except (KeyError, ValueError):
            continue
    return None
