"""The batch side of the store that ends batches: attempts counted before they run, the output
and error files written by paging through the results, and the results dropped once the files
hold them. `Store` inherits it over its one connection and lock (`llamaswap.batches.store`).

Invariants kept here:
- an attempt at validating or finalizing a batch is counted (committed) before it starts, so a
  batch whose attempt kills the process is known after the restart: after ATTEMPTS_MOST of them
  the batch ends `failed` saying why, and the node does not crash again on it;
- finalizing holds one page of results in memory (PAGE_LINES rows), reads each page in its own
  short transaction and runs in a worker thread: a poll or a line's result waits one page at most;
- the output and error files are synced and renamed into place (their directory synced) before
  the batch's end commits; the batch ends only from the status it was finalized for (a cancel
  that came meanwhile wins, and the next look finalizes it again, to the same file ids);
- results are kept once: after the batch's end commits, its results and lines are deleted (in
  pages); a kill in between leaves rows that `drop_ended_results` removes at the next start.
"""

from __future__ import annotations

import contextlib
import enum
import json
import pathlib
import sqlite3
import threading
import time
from typing import IO

from llamaswap.batches.files import OUTPUT_PURPOSE, FileRecord
from llamaswap.batches.lifecycle import STATUS_TIMESTAMP, BatchStatus, LineOutcome
from llamaswap.batches.rows import BatchRecord

# A batch whose validation or finalizing failed (raised, or ended the process) this many times fails.
ATTEMPTS_MOST = 2
# Rows read (results) or deleted (results, lines) in one transaction.
PAGE_LINES = 128
# The statuses a batch may end from, by the status it ends as: a batch finalized as expired that
# a cancel reached meanwhile ends cancelled at the next look, not expired with cancelling_at set.
END_FROM = {
    BatchStatus.COMPLETED: (BatchStatus.FINALIZING,),
    BatchStatus.EXPIRED: (BatchStatus.IN_PROGRESS,),
    BatchStatus.CANCELLED: (BatchStatus.CANCELLING,),
}
_STAGES_FROM = {
    "validate": (BatchStatus.VALIDATING,),
    "finalize": (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING),
}


# How long a worker thread rests between two steps of a long job (validating, finalizing).
REST_S = 0.0005


def let_others_run() -> None:
    """In a worker thread, between two steps (pages of rows, stretches of a file, about a
    millisecond of work each): rest for REST_S without the GIL and the store's lock just
    released. A thread that only yields (sleep(0)) takes the GIL back at once, and the event loop,
    which drops and takes the GIL at every socket call of a request, waits up to the switch
    interval (5 ms) each time. Measured in-process beside 50,000 lines validating (load 5 on two
    cores): an HTTP request's p99 49 ms with no pause, 24 ms yielding, 9 ms resting 0.5 ms; the
    validation took 1.2, 1.8 and about 2-3.5 s."""
    time.sleep(REST_S)


class Stage(str, enum.Enum):
    """A step of a batch that reads or writes all of it, and so may fail or exhaust the process."""

    VALIDATE = "validate"
    FINALIZE = "finalize"

    @property
    def column(self) -> str:
        return f"{self.value}_attempts"

    @property
    def failure(self) -> tuple[str, str]:
        """The error code and message of a batch that failed here ATTEMPTS_MOST times."""
        if self is Stage.VALIDATE:
            return ("validation_failed",
                    f"validating the input file failed {ATTEMPTS_MOST} times (it raised an error, or the sidecar "
                    "stopped during it, e.g. killed for memory): the batch is not tried again; check the file, "
                    "split it, or lower batches.maxLineBytes")
        return ("finalize_failed",
                f"writing the output and error files failed {ATTEMPTS_MOST} times (it raised an error, or the "
                "sidecar stopped during it): the batch is not tried again and its results are dropped")


def upgrade_attempts_and_bodies(db: sqlite3.Connection) -> None:
    """Schema step (batch side): batches gain their attempts' counts, lines where a long line's
    body lies (None for lines from before, and for short lines: their body is parsed when sent)."""
    added = []
    for table, column, kind in (("batches", "validate_attempts", "INTEGER NOT NULL DEFAULT 0"),
                                ("batches", "finalize_attempts", "INTEGER NOT NULL DEFAULT 0"),
                                ("lines", "body_offset", "INTEGER"), ("lines", "body_length", "INTEGER")):
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            added.append(f"ALTER TABLE {table} ADD COLUMN {column} {kind};")
    if added:
        db.executescript("BEGIN;" + "".join(added) + "COMMIT;")


class ResultsTable:
    """The batch-ending methods of `Store` (which provides the connection, the lock, the clock,
    the batches' records and the files' table)."""

    _db: sqlite3.Connection
    _lock: threading.RLock

    # -- provided by Store and FilesTable --------------------------------------------------------

    def now(self) -> int:
        raise NotImplementedError

    def _transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def batch(self, batch_id: str) -> BatchRecord | None:
        raise NotImplementedError

    def upload_path(self) -> pathlib.Path:
        raise NotImplementedError

    def add_file(self, received: pathlib.Path, *, filename: str, purpose: str, file_id: str | None = None,
                 owner: str | None = None, expires_at: int | None = None, quota: int | None = None) -> FileRecord:
        raise NotImplementedError

    # -- attempts --------------------------------------------------------------------------------

    def begin_attempt(self, batch_id: str, stage: Stage) -> int | None:
        """Count an attempt at ``stage`` (committed before the attempt starts); its number, or
        None when ATTEMPTS_MOST were made already (the caller ends the batch: `fail_batch`)."""
        with self._transaction() as db:
            row = db.execute(f"SELECT {stage.column} FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] >= ATTEMPTS_MOST:
                return None
            db.execute(f"UPDATE batches SET {stage.column} = {stage.column} + 1 WHERE id = ?", (batch_id,))
            return int(row[0]) + 1

    def forgive_attempt(self, batch_id: str, stage: Stage) -> None:
        """An attempt that did not fail the batch's way (the sidecar stopping, the disk full) is not counted."""
        with self._transaction() as db:
            db.execute(f"UPDATE batches SET {stage.column} = MAX(0, {stage.column} - 1) WHERE id = ?", (batch_id,))

    def attempts(self, batch_id: str) -> dict[Stage, int]:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(stage.column for stage in Stage)} FROM batches WHERE id = ?",
                                   (batch_id,)).fetchone()
        return dict(zip(Stage, row)) if row else {}

    def fail_batch(self, batch_id: str, stage: Stage) -> bool:
        """End a batch `failed` with ``stage``'s error (OpenAI's `errors` shape), from the
        statuses that stage runs in (False: it was elsewhere, nothing changed)."""
        code, message = stage.failure
        only_from = _STAGES_FROM[stage.value]
        with self._transaction() as db:
            changed = db.execute(
                f"UPDATE batches SET status = ?, errors = ?, failed_at = COALESCE(failed_at, ?) "
                f"WHERE id = ? AND status IN ({', '.join('?' * len(only_from))})",
                (BatchStatus.FAILED.value, json.dumps([{"code": code, "line": None, "message": message,
                                                        "param": None}]),
                 self.now(), batch_id, *(status.value for status in only_from))).rowcount == 1
        if changed:
            self.drop_results(batch_id)
        return changed

    # -- the output and error files -----------------------------------------------------------

    def result_page(self, batch_id: str, *, after: int, limit: int = PAGE_LINES) -> list[tuple[int, bool, str]]:
        """(line, whether it goes to the output file, its record) of the results after line ``after``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT line, outcome, record FROM results WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?",
                (batch_id, after, limit)).fetchall()
        return [(line, outcome == LineOutcome.COMPLETED.value, record) for line, outcome, record in rows]

    def finalize(self, batch: BatchRecord, status: BatchStatus) -> BatchRecord | None:
        """Write the output and error files from the results, in file order, a page at a time, and
        end the batch as ``status`` (from END_FROM's statuses only: None when it moved meanwhile).
        Safe to repeat: the files' ids come from the batch's. No temporary file outlives a call."""
        names = {True: (f"file-{batch.id.removeprefix('batch_')}-output", f"{batch.id}_output.jsonl"),
                 False: (f"file-{batch.id.removeprefix('batch_')}-errors", f"{batch.id}_error.jsonl")}
        current = self.batch(batch.id)
        if current is None or current.status not in END_FROM.get(status, ()):
            return None
        temporaries = {True: self.upload_path(), False: self.upload_path()}
        try:
            counts = self._write_pages(batch.id, temporaries)
            written: dict[bool, str | None] = {}
            for in_output, (file_id, filename) in names.items():
                if counts[in_output]:
                    written[in_output] = self.add_file(temporaries[in_output], filename=filename,
                                                       purpose=OUTPUT_PURPOSE, file_id=file_id, owner=batch.owner).id
                else:
                    written[in_output] = None
        finally:
            for temporary in temporaries.values():
                temporary.unlink(missing_ok=True)
        ended = self._end(batch.id, status, written[True], written[False])
        if not ended:
            return None
        self.drop_results(batch.id)
        return self.batch(batch.id)

    def _write_pages(self, batch_id: str, temporaries: dict[bool, pathlib.Path]) -> dict[bool, int]:
        counts = {True: 0, False: 0}
        with open(temporaries[True], "wb") as output, open(temporaries[False], "wb") as errors:
            files: dict[bool, IO[bytes]] = {True: output, False: errors}
            after = 0
            while page := self.result_page(batch_id, after=after):
                for _, in_output, record in page:
                    files[in_output].write(record.encode() + b"\n")
                    counts[in_output] += 1
                after = page[-1][0]
                let_others_run()
            for file in files.values():
                file.flush()
        return counts  # add_file syncs each before it is renamed into place

    def _end(self, batch_id: str, status: BatchStatus, output_id: str | None, errors_id: str | None) -> bool:
        stamp = STATUS_TIMESTAMP[status]
        only_from = END_FROM.get(status, ())
        with self._transaction() as db:
            return db.execute(
                f"UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, "
                f"{stamp} = COALESCE({stamp}, ?) WHERE id = ? AND status IN ({', '.join('?' * len(only_from))})",
                (status.value, output_id, errors_id, self.now(), batch_id,
                 *(s.value for s in only_from))).rowcount == 1

    # -- results kept once ----------------------------------------------------------------------

    def drop_results(self, batch_id: str) -> int:
        """Delete an ended batch's results and lines (the files hold them now), a page per
        transaction; how many results."""
        dropped = 0
        for table in ("results", "lines", "progress"):
            while True:
                with self._transaction() as db:
                    count = db.execute(
                        f"DELETE FROM {table} WHERE batch_id = ? AND line IN "
                        f"(SELECT line FROM {table} WHERE batch_id = ? ORDER BY line LIMIT ?)",
                        (batch_id, batch_id, PAGE_LINES * 4)).rowcount
                if table == "results":
                    dropped += count
                if count == 0:
                    break
                let_others_run()
        return dropped

    def drop_ended_results(self) -> int:
        """At start: the results and lines of batches that ended (a kill came between a batch's
        end and their deletion); how many results."""
        ended = tuple(status.value for status in BatchStatus if status.ended)
        with self._lock:
            rows = self._db.execute(
                f"SELECT DISTINCT batch_id FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE status IN "
                f"({', '.join('?' * len(ended))})) UNION SELECT DISTINCT batch_id FROM results WHERE batch_id IN "
                f"(SELECT id FROM batches WHERE status IN ({', '.join('?' * len(ended))}))",
                (*ended, *ended)).fetchall()
        return sum(self.drop_results(batch_id) for (batch_id,) in rows)

