"""The files side of the batches' store: the `files` table and the directory of their bytes.

Who owns a file (its creator: batches.apiKeys' name or the caller header's value; None before
callers were told apart), when it expires, and how much the files take (batches.maxStoredBytes).
`Store` inherits it over its one connection and lock (`llamaswap.batches.store`).

Invariants kept here:
- a file's bytes and its directory entry are on disk (fsynced) before its row commits, so a row
  never names a file a power cut lost;
- an upload still being received has a temporary name (UPLOAD_PREFIX); one a kill left behind is
  removed at start;
- a file no row names is removed: at once when its row cannot be added (a full disk), at start
  when a kill came between the rename and the commit, or between a delete and the unlink;
- the quota is checked in the transaction that adds the row: two uploads at once cannot both pass it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import shutil
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from llamaswap.batches.lifecycle import BatchStatus, new_id

_log = logging.getLogger(__name__)

FILES = "files"
UPLOAD_PREFIX = ".upload-"
OUTPUT_PURPOSE = "batch_output"
# The names a file's bytes may have in files/: an upload's id (new_id("file-")), or an output's
# (the same with a suffix, -output or -errors). Only these are removed when no row names them.
_FILE_ID = re.compile(rf"file-[0-9a-f]{{{len(new_id(''))}}}(?:-[a-z]+)?")


class FileInUse(Exception):
    """A file that a batch not yet ended reads cannot be deleted."""


class QuotaExceeded(Exception):
    """Keeping a file would pass batches.maxStoredBytes."""

    def __init__(self, size: int, used: int, quota: int) -> None:
        super().__init__(f"{size} more bytes would pass the quota of {quota} bytes ({used} used)")
        self.size, self.used, self.quota = size, used, quota


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    owner: str | None = None
    expires_at: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Storage:
    """The space the files take: their bytes, how many, the quota, the disk's free bytes."""

    used_bytes: int
    files: int
    max_bytes: int | None
    disk_free_bytes: int | None

    @property
    def left_bytes(self) -> int | None:
        """What may still be stored: the quota's rest, or the disk's where it is less (None: unknown)."""
        lefts = [left for left in ((None if self.max_bytes is None else max(0, self.max_bytes - self.used_bytes)),
                                   self.disk_free_bytes) if left is not None]
        return min(lefts) if lefts else None

    def document(self) -> dict[str, Any]:
        return {"used_bytes": self.used_bytes, "files": self.files, "max_bytes": self.max_bytes,
                "left_bytes": self.left_bytes, "disk_free_bytes": self.disk_free_bytes}


def upgrade_owners_and_expiry(db: sqlite3.Connection) -> None:
    """Schema step (files side): files gain owner and expires_at, batches owner and the creator's
    trusted priority ceiling. Rows from before have none of them (an admin's alone; no expiry)."""
    added = []
    for table, column, kind in (("files", "owner", "TEXT"), ("files", "expires_at", "INTEGER"),
                                ("batches", "owner", "TEXT"), ("batches", "priority_ceiling", "INTEGER")):
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            added.append(f"ALTER TABLE {table} ADD COLUMN {column} {kind};")
    db.executescript("BEGIN;" + "".join(added) +
                     "CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at) WHERE expires_at IS NOT NULL;"
                     "COMMIT;")


def fsync_directory(directory: pathlib.Path) -> None:
    """Make a rename or an unlink in ``directory`` durable (the entry, not only the bytes)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FILE_COLUMNS = "id, filename, purpose, bytes, created_at, owner, expires_at"


class FilesTable:
    """The files' methods of `Store` (which provides the connection, the lock and the clock)."""

    directory: pathlib.Path
    _db: sqlite3.Connection
    _lock: threading.RLock
    # How long an output or error file is kept (batches.outputExpirySeconds; None: until deleted),
    # read when one is written: the caller sets it (a reload may change it).
    output_expiry_s: Callable[[], int | None] = staticmethod(lambda: None)  # type: ignore[assignment]

    def now(self) -> int:
        raise NotImplementedError

    def _transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def file_path(self, file_id: str) -> pathlib.Path:
        return self.directory / FILES / file_id

    def upload_path(self) -> pathlib.Path:
        """A temporary name in the files' directory for an upload being received."""
        return self.directory / FILES / f"{UPLOAD_PREFIX}{new_id('')}"

    def remove_partial_uploads(self) -> int:
        """Remove the temporary files a kill left (uploads and outputs being written); how many.
        Called at start, before anything writes one."""
        removed = 0
        for path in (self.directory / FILES).glob(UPLOAD_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        return removed

    def add_file(self, received: pathlib.Path, *, filename: str, purpose: str, file_id: str | None = None,
                 owner: str | None = None, expires_at: int | None = None, quota: int | None = None,
                 expires_after_s: int | None = None) -> FileRecord:
        """Keep a received file: synced, renamed into place, its directory synced, then recorded.
        It expires at ``expires_at``, or ``expires_after_s`` after its created_at (now); an output
        (purpose batch_output) after output_expiry_s unless told. QuotaExceeded (nothing kept,
        ``received`` left for the caller) when the files would then take more than ``quota`` bytes."""
        size = received.stat().st_size
        now = self.now()
        if expires_at is None and expires_after_s is None and purpose == OUTPUT_PURPOSE:
            expires_after_s = self.output_expiry_s()
        if expires_at is None and expires_after_s is not None:
            expires_at = now + expires_after_s
        record = FileRecord(file_id or new_id("file-"), filename, purpose, size, now, owner, expires_at)
        with open(received, "rb") as synced:
            os.fsync(synced.fileno())
        renamed = False
        with self._lock:  # held until the file is known recorded or removed
            try:
                with self._transaction() as db:
                    if quota is not None:
                        used = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE id != ?",
                                          (record.id,)).fetchone()[0]
                        if used + size > quota:
                            raise QuotaExceeded(size, used, quota)
                    # Renamed and synced inside the transaction: its row commits after the file is durable.
                    os.replace(received, self.file_path(record.id))
                    renamed = True
                    fsync_directory(self.directory / FILES)
                    db.execute(f"INSERT OR REPLACE INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                               dataclasses.astuple(record))
            except BaseException:
                if renamed:  # the row was not added (a full disk fails the INSERT or the COMMIT)
                    self._remove_if_unrecorded(record.id)
                raise
        return record

    def _remove_if_unrecorded(self, file_id: str) -> None:
        """Remove a file's bytes unless a row names it (an output written again keeps its row).
        Where that cannot be asked, the bytes stay until the next start removes them."""
        try:
            with self._lock:
                if self._db.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone() is None:
                    self.file_path(file_id).unlink(missing_ok=True)
        except (OSError, sqlite3.Error) as exc:
            _log.warning("batches: the file %s, not recorded, could not be removed (%s); the next start removes it",
                         file_id, exc)

    def remove_unrecorded_files(self) -> int:
        """Remove the files in files/ that no row names (a kill between a rename and its commit, or
        between a delete's commit and its unlink, left them); how many. Only regular files named as
        file ids are touched. Called at start, after the schema, before anything adds a file."""
        with self._lock:
            recorded = {row[0] for row in self._db.execute("SELECT id FROM files")}
        removed = []
        with os.scandir(self.directory / FILES) as entries:
            for entry in entries:
                if (entry.name not in recorded and _FILE_ID.fullmatch(entry.name)
                        and entry.is_file(follow_symlinks=False)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed.append(entry.name)
        if removed:
            _log.info("batches: %d file(s) no row names removed from %s (left by a kill or a full disk): %s",
                      len(removed), self.directory / FILES, ", ".join(sorted(removed)))
        return len(removed)

    def file(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRecord(*row) if row else None

    def files(self, *, purpose: str | None = None, owner: str | None = None) -> list[FileRecord]:
        """Every file (of that purpose, of that owner), newest first."""
        wheres, args = [], []
        if purpose:
            wheres.append("purpose = ?")
            args.append(purpose)
        if owner is not None:
            wheres.append("owner = ?")
            args.append(owner)
        where = f" WHERE {' AND '.join(wheres)}" if wheres else ""
        with self._lock:
            rows = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files{where} ORDER BY created_at DESC, rowid DESC",
                                    args).fetchall()
        return [FileRecord(*row) for row in rows]

    def delete_file(self, file_id: str) -> bool:
        """Forget a file (False: there is none); FileInUse while a batch that has not ended reads it."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone() is None:
                return False
            user = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN ({_ENDED_MARKS})",
                              (file_id, *_ENDED)).fetchone()
            if user is not None:
                raise FileInUse(f"the file {file_id} is the input of {user[0]}, which has not ended: cancel it first")
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    def expire_files(self) -> list[str]:
        """Delete the files whose expires_at has come (rows, then bytes), except the input of a
        batch that has not ended (it goes at the first sweep after that batch ends); their ids."""
        with self._transaction() as db:
            rows = db.execute(
                f"SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? AND id NOT IN "
                f"(SELECT input_file_id FROM batches WHERE status NOT IN ({_ENDED_MARKS}))",
                (self.now(), *_ENDED)).fetchall()
            expired = [row[0] for row in rows]
            db.executemany("DELETE FROM files WHERE id = ?", ((file_id,) for file_id in expired))
        for file_id in expired:
            self.file_path(file_id).unlink(missing_ok=True)
        return expired

    def storage(self, quota: int | None = None) -> Storage:
        """The space the files take now, beside ``quota`` and the disk's free bytes."""
        with self._lock:
            used, count = self._db.execute("SELECT COALESCE(SUM(bytes), 0), COUNT(*) FROM files").fetchone()
        try:
            free: int | None = shutil.disk_usage(self.directory / FILES).free
        except OSError:
            free = None
        return Storage(used, count, quota, free)


_ENDED = tuple(status.value for status in BatchStatus if status.ended)
_ENDED_MARKS = ", ".join("?" * len(_ENDED))

