"""Files whose bytes are in files/ but no row names them: removed at once when the row cannot be
added (a full disk fails the INSERT or the COMMIT after the rename), and at the next start when
a kill came between a rename and its commit or between a delete's commit and its unlink."""

from __future__ import annotations

import pathlib
import sqlite3
from typing import Any

import pytest

from llamaswap.batches.lifecycle import new_id
from llamaswap.batches.store import Store

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class FullAtCommit:
    """The store's connection, whose COMMIT fails as SQLite's does on a full disk."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def names(directory: pathlib.Path) -> list[str]:
    return sorted(path.name for path in (directory / "files").iterdir())


def received(tmp_path: pathlib.Path, name: str = "upload") -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(LINE)
    return path


def test_files_no_row_names_are_removed_at_start_and_nothing_else(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path)
    kept = store.add_file(received(tmp_path), filename="in.jsonl", purpose="batch")
    output = store.add_file(received(tmp_path), filename="out.jsonl", purpose="batch_output",
                            file_id=f"file-{new_id('')}-output")
    store.close()
    files = tmp_path / "files"
    orphans = [new_id("file-"), f"file-{new_id('')}-output", f"file-{new_id('')}-errors"]
    for name in orphans:
        (files / name).write_bytes(LINE)
    # Not a file id, not a regular file, or a link: none of them is the store's to remove.
    (files / "notes.txt").write_bytes(b"an operator's")
    (files / new_id("file-")).mkdir()
    outside = tmp_path / "outside"
    outside.write_bytes(LINE)
    link = new_id("file-")
    (files / link).symlink_to(outside)
    store = Store(tmp_path)
    assert set(names(tmp_path)).isdisjoint(orphans)
    assert {kept.id, output.id, "notes.txt", link} <= set(names(tmp_path)) and len(names(tmp_path)) == 5
    assert store.file_path(kept.id).read_bytes() == LINE and outside.exists()
    assert (tmp_path / "batches.sqlite3").exists() and (tmp_path / "batches.lock").exists()
    store.close()


def test_a_kill_between_a_delete_and_its_unlink_leaves_nothing_after_the_next_start(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path)
    record = store.add_file(received(tmp_path), filename="in.jsonl", purpose="batch")

    class Killed(BaseException):
        pass

    def killed(self: pathlib.Path, missing_ok: bool = False) -> None:
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(pathlib.Path, "unlink", killed)
        with pytest.raises(Killed):
            store.delete_file(record.id)
    assert store.file(record.id) is None and store.file_path(record.id).exists()
    store.close()
    store = Store(tmp_path)
    assert names(tmp_path) == []
    store.close()


def test_a_row_that_cannot_be_added_after_the_rename_leaves_no_file(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path)
    monkeypatch.setattr(store, "_db", FullAtCommit(store._db))
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.add_file(received(tmp_path), filename="in.jsonl", purpose="batch")
    monkeypatch.undo()
    assert store.files() == [] and names(tmp_path) == []
    # The store goes on once space returns.
    assert store.add_file(received(tmp_path), filename="in.jsonl", purpose="batch").bytes == len(LINE)
    store.close()


def test_a_failed_insert_after_the_rename_leaves_no_file(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path)
    store._db.execute("CREATE TEMP TRIGGER refuse BEFORE INSERT ON files BEGIN "
                      "SELECT RAISE(ABORT, 'database or disk is full'); END")
    with pytest.raises(sqlite3.Error, match="full"):
        store.add_file(received(tmp_path), filename="in.jsonl", purpose="batch")
    assert store.files() == [] and names(tmp_path) == []
    store.close()


def test_a_file_written_again_keeps_its_bytes_when_its_row_cannot_be_replaced(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output finalized again after a crash has its row already: the failure leaves both."""
    store = Store(tmp_path)
    file_id = f"file-{new_id('')}-output"
    store.add_file(received(tmp_path), filename="out.jsonl", purpose="batch_output", file_id=file_id)
    monkeypatch.setattr(store, "_db", FullAtCommit(store._db))
    with pytest.raises(sqlite3.OperationalError):
        store.add_file(received(tmp_path), filename="out.jsonl", purpose="batch_output", file_id=file_id)
    monkeypatch.undo()
    assert [record.id for record in store.files()] == [file_id] and names(tmp_path) == [file_id]
    assert store.file_path(file_id).read_bytes() == LINE
    store.close()
