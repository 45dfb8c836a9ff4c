"""The durable record of the Batch API: SQLite (WAL) beside a directory of files.

One database, five tables: files, batches, the lines of each batch (where each request lies in
its input file), each line's one result, and the progress of lines stopped part-way (the tokens
they keep, `batches/resume.py`). Invariants, enforced here:
- a line has at most one result (its primary key; the first write wins), so a line sent twice
  after a restart is written once, and the output and error files, made from these rows when the
  batch ends, hold every custom_id exactly once;
- a file's content is in place (written to a temporary name, then renamed) before its row is
  committed; an output file's name is derived from its batch, so finalizing again after a crash
  writes the same file;
- nothing of a refused upload or batch is kept;
- a line's progress is kept only while it has no result: a result deletes it in the same
  transaction, and progress is not written for a line that has one (a stop that races the
  line's end: the end wins);
- results are kept once: when a batch ends, its output and error files hold them and its rows
  of lines and results are deleted (`batches/output.py`);
- one process at a time: a flock on batches.dir (`batches/dirlock.py`), taken before anything
  there is read or removed.

Calls are synchronous and take a lock (one connection): the feeder and the API run the slow ones
(creating a batch of 50,000 lines, finalizing) in a worker thread, and those take the lock a
page at a time, so a call on the event loop waits for a page, not for the whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llamaswap.batches.files import FILES, FileInUse, FileRecord, FilesTable, upgrade_owners_and_expiry
from llamaswap.batches.dirlock import DirectoryInUse, DirectoryLock
from llamaswap.batches.lifecycle import STATUS_TIMESTAMP, BatchStatus, LineOutcome, new_id
from llamaswap.batches.output import ResultsTable, let_others_run, upgrade_attempts_and_bodies
from llamaswap.batches.resume import Progress
from llamaswap.batches.rows import BatchRecord, Counts, Result
from llamaswap.batches.validate import InputLine, LineError

DATABASE = "batches.sqlite3"
# Lines put in per transaction when a batch is validated.
LINES_PAGE = 250
__all__ = ["FILES", "BatchRecord", "Counts", "FileInUse", "FileRecord", "Result", "Store", "StoreError"]
# 2: a batch's counts of completed and failed lines kept in its row (read at every poll).
SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    status TEXT NOT NULL, metadata TEXT, priority INTEGER NOT NULL, errors TEXT,
    output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, outcome TEXT NOT NULL, record TEXT NOT NULL,
    ended_at REAL NOT NULL, PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS progress (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, request_id TEXT NOT NULL, prompt_tokens TEXT NOT NULL,
    kept TEXT NOT NULL, text TEXT NOT NULL, stops INTEGER NOT NULL, first_sent_at REAL NOT NULL,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS progress_by_request ON progress (request_id);
CREATE INDEX IF NOT EXISTS results_by_end ON results (batch_id, ended_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
"""


class StoreError(Exception):
    """The batches' directory or database cannot be used (batches.dir)."""


_TIMESTAMPS = tuple(name for name in STATUS_TIMESTAMP.values() if name is not None)


class Store(FilesTable, ResultsTable):
    """Files and batches under ``directory`` (batches.dir); ``now`` gives wall-clock seconds.
    The files' methods are FilesTable's (`llamaswap.batches.files`)."""

    def __init__(self, directory: str | os.PathLike[str], *, now: Callable[[], float] = time.time) -> None:
        self.directory = pathlib.Path(directory)
        self._now = now
        self._lock = threading.RLock()
        self._dir_lock = DirectoryLock(self.directory)
        try:
            (self.directory / FILES).mkdir(parents=True, exist_ok=True)
            self._dir_lock.acquire()  # before anything is read or removed: another sidecar may use them
            self._db = sqlite3.connect(self.directory / DATABASE, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._upgrade()
            upgrade_owners_and_expiry(self._db)
            upgrade_attempts_and_bodies(self._db)
            self.remove_partial_uploads()
            self.remove_unrecorded_files()
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self.drop_ended_results()
        except DirectoryInUse as exc:
            raise StoreError(f"batches.dir {self.directory}: {exc}") from exc
        except (OSError, sqlite3.Error) as exc:
            opened = getattr(self, "_db", None)
            if opened is not None:  # the connection goes with the lock: a retry opens its own
                opened.close()
            self._dir_lock.release()
            raise StoreError(f"batches.dir {self.directory}: cannot keep batches there ({exc}); set batches.dir to a "
                             "writable directory") from exc

    def _upgrade(self) -> None:
        """A database of schema 1 gets the counts' columns, filled from its results."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(batches)")}
        if "completed" in columns:
            return
        self._db.executescript(f"""
            BEGIN;
            ALTER TABLE batches ADD COLUMN completed INTEGER NOT NULL DEFAULT 0;
            ALTER TABLE batches ADD COLUMN failed INTEGER NOT NULL DEFAULT 0;
            UPDATE batches SET
                completed = (SELECT COUNT(*) FROM results r WHERE r.batch_id = batches.id
                             AND r.outcome = '{LineOutcome.COMPLETED.value}'),
                failed = (SELECT COUNT(*) FROM results r WHERE r.batch_id = batches.id
                          AND r.outcome != '{LineOutcome.COMPLETED.value}');
            COMMIT;""")

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._dir_lock.release()

    def now(self) -> int:
        return int(self._now())

    def now_exact(self) -> float:
        return self._now()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # A COMMIT that failed (a full disk) leaves the transaction open: closed here, or
                # every later BEGIN would fail and the store never recover once space returns.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    # -- batches -----------------------------------------------------------------------------

    def create_batch(self, *, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
                     metadata: dict[str, str] | None, priority: int, trace_id: str, span_id: str,
                     owner: str | None = None, priority_ceiling: int | None = None) -> BatchRecord:
        """A batch, validating: the feeder reads its input file next (`validated`); ``owner``
        created it, and its lines run at most at ``priority_ceiling``."""
        now = self.now()
        batch_id = new_id("batch_")
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, created_at, expires_at, status, "
                "metadata, priority, total, trace_id, span_id, owner, priority_ceiling) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, completion_window, now, now + window_s,
                 BatchStatus.VALIDATING.value, json.dumps(metadata) if metadata is not None else None, priority,
                 0, trace_id, span_id, owner, priority_ceiling))
        batch = self.batch(batch_id)
        assert batch is not None
        return batch

    def validated(self, batch_id: str, lines: Sequence[InputLine], errors: Sequence[LineError],
                  more_errors: int = 0) -> bool:
        """A validating batch becomes in_progress with its lines, or failed with its input file's
        errors (False: it was no longer validating, e.g. cancelled meanwhile). The lines go in
        first, a page per transaction (a poll waits for one page, not for 50,000 lines); the
        status changes last, so a kill between leaves a validating batch, validated again."""
        status = BatchStatus.FAILED if errors else BatchStatus.IN_PROGRESS
        documents = [error.document() for error in errors]
        if more_errors:
            documents.append({"code": "more_errors", "line": None, "param": None,
                              "message": f"{more_errors} more problem(s) not listed"})
        stamp = STATUS_TIMESTAMP[status]
        for start in range(0, 0 if errors else len(lines), LINES_PAGE):
            with self._transaction() as db:
                if db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone() != (
                        BatchStatus.VALIDATING.value,):
                    break
                db.executemany(
                    "INSERT OR IGNORE INTO lines (batch_id, line, custom_id, offset, length, body_offset, body_length) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    ((batch_id, line.line, line.custom_id, line.offset, line.length, line.body_offset,
                      line.body_length) for line in lines[start:start + LINES_PAGE]))
            let_others_run()
        with self._transaction() as db:
            changed = db.execute(
                f"UPDATE batches SET status = ?, errors = ?, total = ?, {stamp} = ? WHERE id = ? AND status = ?",
                (status.value, json.dumps(documents) if errors else None, 0 if errors else len(lines), self.now(),
                 batch_id, BatchStatus.VALIDATING.value)).rowcount == 1
        if not changed:
            self.drop_results(batch_id)  # the lines put in before it moved (a cancel meanwhile)
        return changed

    def batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            names = [column[0] for column in self._db.execute("SELECT * FROM batches LIMIT 0").description]
        return _batch_record(dict(zip(names, row))) if row else None

    def batches(self, *, statuses: Sequence[BatchStatus] | None = None) -> list[BatchRecord]:
        """Every batch (of those statuses), newest first."""
        query = "SELECT * FROM batches"
        args: tuple[str, ...] = ()
        if statuses is not None:
            args = tuple(status.value for status in statuses)
            query += f" WHERE status IN ({', '.join('?' * len(args))})"
        with self._lock:
            cursor = self._db.execute(query + " ORDER BY created_at DESC, rowid DESC", args)
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return [_batch_record(dict(zip(names, row))) for row in rows]

    def set_status(self, batch_id: str, status: BatchStatus, *, only_from: Sequence[BatchStatus] = ()) -> bool:
        """Move a batch to ``status`` (stamping its time); with ``only_from``, only from those
        (False: it was elsewhere, nothing changed: the first call wins)."""
        stamp = STATUS_TIMESTAMP[status]
        sets = "status = ?" + (f", {stamp} = COALESCE({stamp}, ?)" if stamp else "")
        args: list[Any] = [status.value] + ([self.now()] if stamp else [])
        query = f"UPDATE batches SET {sets} WHERE id = ?"
        args.append(batch_id)
        if only_from:
            query += f" AND status IN ({', '.join('?' * len(only_from))})"
            args += [s.value for s in only_from]
        with self._transaction() as db:
            return db.execute(query, args).rowcount == 1

    # -- lines and results -------------------------------------------------------------------

    def unfinished_lines(self, batch_id: str, *, after: int = 0, limit: int = 100) -> list[InputLine]:
        """Lines with no result yet, in file order, from line ``after`` on."""
        with self._lock:
            rows = self._db.execute(
                "SELECT l.line, l.custom_id, l.offset, l.length, l.body_offset, l.body_length FROM lines l "
                "LEFT JOIN results r "
                "ON r.batch_id = l.batch_id AND r.line = l.line WHERE l.batch_id = ? AND l.line > ? "
                "AND r.line IS NULL ORDER BY l.line LIMIT ?", (batch_id, after, limit)).fetchall()
        return [InputLine(*row) for row in rows]

    def record_result(self, batch_id: str, line: InputLine, outcome: LineOutcome, record: str) -> bool:
        """A line's result (its file line, `rows.record_text`), once: False when it already had
        one (the first write wins)."""
        return self.record_results([Result(batch_id, line, outcome, record, self._now())])[0]

    def record_results(self, results: Sequence[Result]) -> list[bool]:
        """Lines' results in one transaction, each once: for each, False when its line already had
        one (the first write wins). The batches' counts go up with them. A batch that ended keeps
        none (its files are written; its results were dropped). The records come serialised:
        nothing per result but the INSERT is done while the lock is held."""
        added: list[bool] = []
        counts: dict[tuple[str, str], int] = {}
        ended = {status.value for status in BatchStatus if status.ended}
        with self._transaction() as db:
            open_batches: dict[str, bool] = {}
            for result in results:
                if result.batch_id not in open_batches:
                    row = db.execute("SELECT status FROM batches WHERE id = ?", (result.batch_id,)).fetchone()
                    open_batches[result.batch_id] = row is not None and row[0] not in ended
                if not open_batches[result.batch_id]:
                    added.append(False)
                    continue
                cursor = db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?)",
                                    (result.batch_id, result.line.line, result.outcome.value, result.record,
                                     result.ended_at))
                added.append(cursor.rowcount == 1)
                db.execute("DELETE FROM progress WHERE batch_id = ? AND line = ?", (result.batch_id, result.line.line))
                if cursor.rowcount == 1:
                    column = "completed" if result.outcome is LineOutcome.COMPLETED else "failed"
                    counts[(result.batch_id, column)] = counts.get((result.batch_id, column), 0) + 1
            for (batch_id, column), count in counts.items():
                db.execute(f"UPDATE batches SET {column} = {column} + ? WHERE id = ?", (count, batch_id))
        return added

    def keep_progress(self, batch_id: str, line: int, request_id: str, progress: Progress) -> bool:
        """A stopped line's progress, replacing what it had; False (nothing written) when the line
        has a result already: its end won."""
        with self._transaction() as db:
            return db.execute(
                "INSERT OR REPLACE INTO progress SELECT ?, ?, ?, ?, ?, ?, ?, ? WHERE NOT EXISTS "
                "(SELECT 1 FROM results WHERE batch_id = ? AND line = ?)",
                (batch_id, line, request_id, json.dumps(progress.prompt_tokens), json.dumps(progress.kept),
                 progress.text, progress.stops, progress.first_sent_at, batch_id, line)).rowcount == 1

    def progress(self, batch_id: str, line: int) -> Progress | None:
        """A line's progress kept at its last stop (None: never stopped, or ended)."""
        with self._lock:
            row = self._db.execute("SELECT prompt_tokens, kept, text, stops, first_sent_at FROM progress "
                                   "WHERE batch_id = ? AND line = ?", (batch_id, line)).fetchone()
        return _progress(row) if row else None

    def progress_of_request(self, request_id: str) -> Progress | None:
        """The progress of the stopped line sent with this x-request-id (its first arrival:
        `first_sent_at`); None: no such line stopped and unfinished."""
        with self._lock:
            row = self._db.execute("SELECT prompt_tokens, kept, text, stops, first_sent_at FROM progress "
                                   "WHERE request_id = ? LIMIT 1", (request_id,)).fetchone()
        return _progress(row) if row else None

    def end_unfinished(self, batch_id: str, outcome: LineOutcome,
                       record: Callable[[InputLine], str]) -> int:
        """Every line still without a result ends as ``outcome`` (expired, cancelled), with
        ``record`` (its file line); how many."""
        ended = 0
        while True:
            lines = self.unfinished_lines(batch_id, limit=LINES_PAGE)
            if not lines:
                return ended
            now = self._now()
            ended += sum(self.record_results([Result(batch_id, line, outcome, record(line), now) for line in lines]))
            let_others_run()

    def counts(self, batch_id: str, total: int) -> Counts:
        """Kept in the batch's row with each result (O(1): every poll of a batch reads it)."""
        with self._lock:
            row = self._db.execute("SELECT completed, failed FROM batches WHERE id = ?", (batch_id,)).fetchone()
        completed, failed = row if row else (0, 0)
        return Counts(total, completed, failed)

    def status(self, batch_id: str) -> BatchStatus | None:
        with self._lock:
            row = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return BatchStatus(row[0]) if row else None

    def status_counts(self) -> dict[BatchStatus, int]:
        """How many batches are in each status."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return {BatchStatus(status): count for status, count in rows}

    def recent_ends(self, batch_id: str, limit: int) -> list[float]:
        """When the latest ``limit`` lines of a batch ended, newest first (for its estimated finish)."""
        with self._lock:
            rows = self._db.execute("SELECT ended_at FROM results WHERE batch_id = ? ORDER BY ended_at DESC LIMIT ?",
                                    (batch_id, limit)).fetchall()
        return [row[0] for row in rows]


def _progress(row: tuple[Any, ...]) -> Progress:
    prompt_tokens, kept, text, stops, first_sent_at = row
    return Progress(tuple(json.loads(prompt_tokens)), tuple(json.loads(kept)), text, stops, first_sent_at)


def _batch_record(row: dict[str, Any]) -> BatchRecord:
    return BatchRecord(
        id=row["id"], endpoint=row["endpoint"], input_file_id=row["input_file_id"],
        completion_window=row["completion_window"], created_at=row["created_at"], expires_at=row["expires_at"],
        status=BatchStatus(row["status"]), metadata=json.loads(row["metadata"]) if row["metadata"] else None,
        priority=row["priority"], errors=json.loads(row["errors"]) if row["errors"] else None,
        output_file_id=row["output_file_id"], error_file_id=row["error_file_id"], total=row["total"],
        timestamps={name: row[name] for name in _TIMESTAMPS}, trace_id=row["trace_id"], span_id=row["span_id"],
        owner=row.get("owner"), priority_ceiling=row.get("priority_ceiling"))
