"""Writing the answered lines' results: together (one transaction for those that ended within
RESULTS_S, or RESULTS_LINES of them), in a worker thread, and never by sending a line again.

A write that fails (a full disk: ENOSPC, SQLite's "database or disk is full") keeps its results
here and tries again after a pause that grows (WRITE_FIRST_S to WRITE_MOST_S). While writes fail,
or KEPT_MOST results wait for a write, `blocking` is true and the feeder starts no line: what is
kept is bounded by KEPT_MOST and the lines in flight (batches.inFlight per batch).
A line whose answer is kept here is `unwritten`: the feeder neither sends it again nor ends its
batch until it is written. Only a stop (or a kill) loses what is kept: those lines have no
result in the store and are sent again at the next start, as the running ones are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

from llamaswap.batches.rows import BatchRecord, Result

_log = logging.getLogger(__name__)

RESULTS_S = 0.05
RESULTS_LINES = 64
WRITE_FIRST_S = 0.5
WRITE_MOST_S = 30.0
# Results waiting for a write beyond which no line starts (a slow or failing disk).
KEPT_MOST = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """A line's result waiting to be written, with what telemetry learns once it is."""

    batch: BatchRecord
    result: Result
    status_code: int | None
    answered_ns: int


class ResultWriter:
    """``record`` writes results (the store's `record_results`: for each, whether it was new);
    ``written`` is told of each written one; ``recovered`` when writes succeed again after failing."""

    def __init__(self, record: Callable[[Sequence[Result]], list[bool]], *,
                 written: Callable[[Answered, bool], None], recovered: Callable[[], None]) -> None:
        self._record = record
        self._written = written
        self._recovered = recovered
        self._pending: list[Answered] = []
        self._unwritten: dict[str, set[int]] = {}  # batch id -> lines answered, not yet written
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.failing = False
        self.pause_s = WRITE_FIRST_S
        self._closed = False
        self._writing = False  # a write runs in a worker thread now (a cancel would not stop it)
        self._tried = asyncio.Event()  # set after each try at a write, and when the writing stops

    def add(self, answered: Answered) -> None:
        self._pending.append(answered)
        self._unwritten.setdefault(answered.batch.id, set()).add(answered.result.line.line)
        if len(self._pending) >= RESULTS_LINES:
            self._kick()
        elif self._timer is None and self._task is None:
            self._timer = asyncio.get_running_loop().call_later(RESULTS_S, self._kick)

    @property
    def blocking(self) -> bool:
        """Whether no line should start: writes fail, or too many results wait for one."""
        return self.failing or len(self._pending) >= KEPT_MOST

    def holds(self, batch_id: str) -> bool:
        """Whether a result of the batch is not written yet."""
        return bool(self._unwritten.get(batch_id))

    def is_unwritten(self, batch_id: str, line: int) -> bool:
        return line in self._unwritten.get(batch_id, ())

    def kept(self) -> int:
        """Results not written yet."""
        return sum(len(lines) for lines in self._unwritten.values())

    async def flush(self, batch_id: str) -> bool:
        """Write what is kept of the batch now (True: none of its results is left unwritten and
        writes succeed). It waits through writes until that batch's are done, whatever other
        batches add meanwhile (each write takes every result waiting: two writes at most), never
        for the pause before the next try: while writes fail (a full disk, where nothing else
        can be written either), False at once."""
        while self.holds(batch_id) and not self.failing and not self._closed:
            if self._task is None:
                self._cancel_timer()
                self._task = asyncio.create_task(self._run())
            self._tried.clear()
            await self._tried.wait()
        return not self.holds(batch_id) and not self.failing

    async def close(self) -> None:
        """Stop trying; one last write of what is kept (what fails is logged: sent again at the next start)."""
        self._closed = True
        self._cancel_timer()
        if self._task is not None:
            # A write under way finishes (its thread would go on anyway, its outcome unknown);
            # a pause before the next try is cut short.
            if not self._writing:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            added = await asyncio.to_thread(self._record, [answered.result for answered in pending])
        except Exception as exc:  # noqa: BLE001 - stopping: nothing else to do with them
            _log.error("batches: the results of %d line(s) could not be written at the stop (%s); they are sent "
                       "again at the next start", len(pending), exc)
            return
        self._done(pending, added)

    def _kick(self) -> None:
        self._timer = None
        if self._task is None and self._pending and not self._closed:
            self._task = asyncio.create_task(self._run())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _run(self) -> None:
        try:
            while self._pending:
                group, self._pending = self._pending, []
                self._writing = True
                try:
                    added = await asyncio.to_thread(self._record, [answered.result for answered in group])
                except asyncio.CancelledError:
                    # kept: its thread may still write them; written again, the first write wins
                    self._pending[:0] = group
                    raise
                except Exception as exc:  # noqa: BLE001 - kept and tried again: a full disk must not lose them
                    self._writing = False
                    self._pending[:0] = group
                    if self._closed:
                        break  # close() makes the last try
                    if not self.failing:
                        _log.error("batches: the results of %d line(s) cannot be written (%s); no line starts until "
                                   "they are (tried again every %.1f s at most %.0f s)", len(group), exc,
                                   self.pause_s, WRITE_MOST_S)
                    self.failing = True
                    self._tried.set()
                    await asyncio.sleep(self.pause_s)
                    self.pause_s = min(self.pause_s * 2, WRITE_MOST_S)
                    continue
                blocked = self.blocking or len(group) >= KEPT_MOST
                self._writing = False
                self._done(group, added)
                self._tried.set()
                if self.failing:
                    self.failing = False
                    self.pause_s = WRITE_FIRST_S
                    _log.warning("batches: results are written again; lines start again")
                if blocked and not self.blocking:
                    self._recovered()
                if len(self._pending) < RESULTS_LINES:
                    break
        finally:
            self._task = None
            self._writing = False
            self._tried.set()
            if self._pending and self._timer is None and not self._closed:
                with contextlib.suppress(RuntimeError):  # the loop is closing
                    self._timer = asyncio.get_running_loop().call_later(RESULTS_S, self._kick)

    def _done(self, group: list[Answered], added: list[bool]) -> None:
        for answered, new in zip(group, added):
            lines = self._unwritten.get(answered.batch.id)
            if lines is not None:
                lines.discard(answered.result.line.line)
                if not lines:
                    del self._unwritten[answered.batch.id]
            self._written(answered, new)
