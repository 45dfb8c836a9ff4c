"""The Batch API's pure parts and its store: input validation, priorities, ids, estimates, and
the SQLite record (exactly one result per line, files made from them, restarts)."""

from __future__ import annotations

import errno
import io
import json
import pathlib
import sqlite3
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamaswap.batches.lifecycle import (
    DEFAULT_PRIORITY,
    BadPriority,
    BatchStatus,
    LineOutcome,
    batch_of_request,
    batch_priority,
    ended_status,
    estimated_finish,
    line_request_id,
)
from llamaswap.batches.rows import record_text
from llamaswap.batches.store import FileInUse, Store, StoreError
from llamaswap.batches.validate import InputLine, line_body, validate
from llamaswap.core.priority import PriorityMode, PriorityPolicy

ENDPOINT = "/v1/chat/completions"


def line(custom_id: str, **changes: object) -> dict[str, object]:
    document: dict[str, object] = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                                   "body": {"model": "m", "messages": []}}
    document.update(changes)
    return document


def jsonl(*documents: object) -> io.BytesIO:
    return io.BytesIO(b"".join((d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n" for d in documents))


# -- validation ------------------------------------------------------------------------------


def test_good_lines_are_found_where_they_lie_in_the_file() -> None:
    data = jsonl(line("a"), b"", line("b"))
    result = validate(data, endpoint=ENDPOINT, max_requests=10)
    assert result.errors == () and result.models == {"m": (1, 3)}
    assert [(item.line, item.custom_id) for item in result.lines] == [(1, "a"), (3, "b")]
    raw = data.getvalue()
    for item in result.lines:
        assert json.loads(line_body(raw[item.offset:item.offset + item.length])) == {"model": "m", "messages": []}


@pytest.mark.parametrize(("bad", "code", "param"), [
    (b"[1, 2", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    (line("", ), "missing_required_parameter", "custom_id"),
    (line("x", method="GET"), "invalid_method", "method"),
    (line("x", url="/v1/embeddings"), "invalid_url", "url"),
    (line("x", body="text"), "missing_required_parameter", "body"),
    (line("x", body={"messages": []}), "missing_required_parameter", "body.model"),
    (line("x", body={"model": "m", "stream": True}), "invalid_request", "body.stream"),
])
def test_each_bad_line_is_named_with_its_number(bad: object, code: str, param: str | None) -> None:
    result = validate(jsonl(line("first"), bad), endpoint=ENDPOINT, max_requests=10)
    assert [(error.line, error.code, error.param) for error in result.errors] == [(2, code, param)]


def test_a_repeated_custom_id_is_an_error_of_the_later_line() -> None:
    result = validate(jsonl(line("a"), line("b"), line("a")), endpoint=ENDPOINT, max_requests=10)
    assert [(error.line, error.code) for error in result.errors] == [(3, "duplicate_custom_id")]


def test_the_lines_of_a_model_not_served_are_errors_in_file_order() -> None:
    found = validate(jsonl(line("a", body={"model": "x"}), b"[", line("b"), line("c", body={"model": "x"})),
                     endpoint=ENDPOINT, max_requests=10)
    assert found.models == {"x": (1, 4), "m": (3,)}
    refused = found.without_models(["x"])
    assert [(error.line, error.code) for error in refused.errors] == [
        (1, "model_not_found"), (2, "invalid_json_line"), (4, "model_not_found")]
    assert found.without_models([]) is found


def test_too_many_lines_and_no_lines_are_one_error_each() -> None:
    over = validate(jsonl(*(line(str(n)) for n in range(4))), endpoint=ENDPOINT, max_requests=3)
    assert [(error.code, error.line) for error in over.errors] == [("too_many_requests", None)]
    assert "4 requests" in over.errors[0].message and "batches.maxRequests" in over.errors[0].message
    empty = validate(io.BytesIO(b"\n\n"), endpoint=ENDPOINT, max_requests=3)
    assert [error.code for error in empty.errors] == ["empty_file"]


def test_errors_past_the_listed_ones_are_counted() -> None:
    result = validate(io.BytesIO(b"x\n" * 1005), endpoint=ENDPOINT, max_requests=2000)
    assert len(result.errors) == 1000 and result.more_errors == 5


# -- priorities, ids, estimates --------------------------------------------------------------

TRUST = PriorityPolicy(PriorityMode.TRUST, -100, 100, None)


def test_a_batch_runs_at_batch_unless_its_metadata_says() -> None:
    assert batch_priority(None, TRUST) == DEFAULT_PRIORITY == -100
    assert batch_priority({"priority": "normal"}, TRUST) == 0
    assert batch_priority({"priority": " -150 "}, TRUST) == -150
    assert batch_priority({"priority": "-150"}, PriorityPolicy(PriorityMode.CLAMP, -100, 100, None)) == -100
    # strip drops the claim; the batch's own default stays (the feeder sends it in the trusted header).
    strip = PriorityPolicy(PriorityMode.STRIP, -100, 100, "x-trusted")
    assert batch_priority({"priority": "999999"}, strip) == batch_priority(None, strip) == -100
    with pytest.raises(BadPriority, match="interactive"):
        batch_priority({"priority": "soon"}, TRUST)


def test_a_line_request_id_names_its_batch() -> None:
    assert line_request_id("batch_1", "q-1", 3) == "batch_1:q-1"
    assert line_request_id("batch_1", "a b/c", 3) == "batch_1:a%20b%2Fc"
    assert line_request_id("batch_1", "x" * 200, 7) == "batch_1:line-7"
    assert batch_of_request("batch_1:q-1") == "batch_1"
    assert batch_of_request("chat-42") is None


def test_a_batch_ends_cancelled_before_expired_before_completed() -> None:
    assert ended_status(expired=True, cancelled=True) is BatchStatus.CANCELLED
    assert ended_status(expired=True, cancelled=False) is BatchStatus.EXPIRED
    assert ended_status(expired=False, cancelled=False) is BatchStatus.COMPLETED


def test_the_finish_is_estimated_from_the_recent_rate() -> None:
    # Ten lines ended one a second: 20 left take 20 s from now.
    assert estimated_finish(100.0, [float(t) for t in range(90, 100)], 20) == pytest.approx(120.0)
    assert estimated_finish(100.0, [float(t) for t in range(95, 100, 2)], 20) == pytest.approx(140.0)
    assert estimated_finish(100.0, [99.0], 20) is None
    assert estimated_finish(100.0, [90.0, 99.0], 0) is None


# -- the store -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def stored_batch(store: Store, tmp_path: pathlib.Path, lines: int) -> tuple[str, list[InputLine]]:
    upload = tmp_path / "upload.jsonl"
    upload.write_bytes(jsonl(*(line(f"c{n}") for n in range(lines))).getvalue())
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=86_400,
                               metadata=None, priority=-100, trace_id="0" * 31 + "1", span_id="0" * 15 + "2")
    assert batch.status is BatchStatus.VALIDATING
    with open(store.file_path(record.id), "rb") as source:
        found = validate(source, endpoint=ENDPOINT, max_requests=100)
    assert store.validated(batch.id, found.lines, found.errors)
    return batch.id, list(found.lines)


def test_a_line_has_one_result_whoever_writes_it_again(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    batch_id, lines = stored_batch(store, tmp_path, 3)
    assert store.record_result(batch_id, lines[1], LineOutcome.COMPLETED, record_text({"custom_id": "c1", "try": 1}))
    assert not store.record_result(batch_id, lines[1], LineOutcome.FAILED, record_text({"custom_id": "c1", "try": 2}))
    assert [item.custom_id for item in store.unfinished_lines(batch_id)] == ["c0", "c2"]
    counts = store.counts(batch_id, 3)
    assert (counts.total, counts.completed, counts.failed) == (3, 1, 0)


def test_finalizing_writes_each_line_once_in_file_order_and_can_be_repeated(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    batch_id, lines = stored_batch(store, tmp_path, 4)
    for item in reversed(lines[:3]):
        outcome = LineOutcome.FAILED if item.custom_id == "c1" else LineOutcome.COMPLETED
        store.record_result(batch_id, item, outcome, record_text({"custom_id": item.custom_id}))
    assert store.end_unfinished(batch_id, LineOutcome.CANCELLED,
                                lambda item: record_text({"custom_id": item.custom_id})) == 1
    assert store.set_status(batch_id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    batch = store.batch(batch_id)
    assert batch is not None
    assert store.finalize(batch, BatchStatus.EXPIRED) is None  # it is cancelling: it cannot end expired
    first = store.finalize(batch, BatchStatus.CANCELLED)
    assert first is not None and first.status is BatchStatus.CANCELLED and first.timestamps["cancelled_at"]
    assert first.timestamps["expired_at"] is None
    # Ended: its results are dropped (the files hold them) and finalizing again changes nothing.
    assert store.result_page(batch_id, after=0) == [] and store.unfinished_lines(batch_id) == []
    assert store.finalize(batch, BatchStatus.CANCELLED) is None
    output = store.file_path(first.output_file_id or "").read_text().splitlines()
    errors = store.file_path(first.error_file_id or "").read_text().splitlines()
    assert [json.loads(text)["custom_id"] for text in output] == ["c0", "c2"]
    assert [json.loads(text)["custom_id"] for text in errors] == ["c1", "c3"]
    assert [record.id for record in store.files(purpose="batch_output")] != []


def test_everything_survives_a_new_store_on_the_same_directory(tmp_path: pathlib.Path) -> None:
    clock = Clock()
    store = Store(tmp_path / "b", now=clock)
    batch_id, lines = stored_batch(store, tmp_path, 2)
    store.record_result(batch_id, lines[0], LineOutcome.COMPLETED, record_text({"custom_id": "c0"}))
    store.close()  # a kill leaves the WAL; a new process opens it the same way
    again = Store(tmp_path / "b", now=clock)
    batch = again.batch(batch_id)
    assert batch is not None and batch.status is BatchStatus.IN_PROGRESS and batch.total == 2
    assert [item.custom_id for item in again.unfinished_lines(batch_id)] == ["c1"]
    assert batch.timestamps["in_progress_at"] == 1000


def test_a_status_moves_only_from_where_it_is_asked(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    batch_id, _ = stored_batch(store, tmp_path, 1)
    assert store.set_status(batch_id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    assert not store.set_status(batch_id, BatchStatus.FINALIZING, only_from=(BatchStatus.IN_PROGRESS,))
    batch = store.batch(batch_id)
    assert batch is not None and batch.status is BatchStatus.CANCELLING and batch.timestamps["cancelling_at"]


def test_a_cancelled_validation_keeps_no_lines(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    upload = tmp_path / "u"
    upload.write_bytes(jsonl(line("a")).getvalue())
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=10,
                               metadata=None, priority=-100, trace_id="1" * 32, span_id="2" * 16)
    store.set_status(batch.id, BatchStatus.CANCELLING)
    assert not store.validated(batch.id, [InputLine(1, "a", 0, 10)], [])
    assert store.unfinished_lines(batch.id) == []


def test_an_input_file_in_use_cannot_be_deleted_until_its_batch_ends(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    batch_id, _ = stored_batch(store, tmp_path, 1)
    batch = store.batch(batch_id)
    assert batch is not None
    with pytest.raises(FileInUse, match=batch_id):
        store.delete_file(batch.input_file_id)
    assert store.set_status(batch_id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    store.end_unfinished(batch_id, LineOutcome.CANCELLED, lambda item: record_text({"custom_id": item.custom_id}))
    assert store.finalize(batch, BatchStatus.CANCELLED) is not None
    assert store.delete_file(batch.input_file_id)
    assert not store.file_path(batch.input_file_id).exists()
    assert not store.delete_file(batch.input_file_id)


def test_an_unusable_directory_names_the_key(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(Exception, match="batches.dir"):
        Store(blocker / "below")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(list(LineOutcome))), max_size=40))
def test_any_order_of_writes_leaves_one_result_per_line(tmp_path_factory: pytest.TempPathFactory,
                                                         writes: list[tuple[int, LineOutcome]]) -> None:
    tmp_path = tmp_path_factory.mktemp("store")
    store = Store(tmp_path / "b")
    batch_id, lines = stored_batch(store, tmp_path, 10)
    first: dict[int, LineOutcome] = {}
    for index, outcome in writes:
        store.record_result(batch_id, lines[index], outcome,
                            record_text({"custom_id": lines[index].custom_id, "o": outcome.value}))
        first.setdefault(index, outcome)
    store.end_unfinished(batch_id, LineOutcome.EXPIRED,
                         lambda item: record_text({"custom_id": item.custom_id, "o": "expired"}))
    batch = store.batch(batch_id)
    assert batch is not None
    final = store.finalize(batch, BatchStatus.EXPIRED)
    written = []
    for file_id in (final.output_file_id, final.error_file_id):
        if file_id:
            written += [json.loads(text) for text in store.file_path(file_id).read_text().splitlines()]
    assert sorted(record["custom_id"] for record in written) == sorted(item.custom_id for item in lines)
    by_id = {record["custom_id"]: record["o"] for record in written}
    for index, outcome in first.items():
        assert by_id[lines[index].custom_id] == outcome.value
    store.close()


def test_strip_without_a_trusted_header_is_said_to_run_lines_at_normal(tmp_path: pathlib.Path) -> None:
    from llamaswap.config import parse_config
    from llamaswap.config.advice import advice

    def keys(document: dict[str, object]) -> list[str]:
        return [problem.path for problem in advice(parse_config(document))]

    stripped = {"batches": {"dir": str(tmp_path)}, "security": {"priority": {"mode": "strip"}}}
    assert keys(stripped) == ["security.priority.mode"]
    assert keys({**stripped, "security": {"priority": {"mode": "strip", "trustedHeader": "x-tier"}}}) == []
    assert keys({"security": {"priority": {"mode": "strip"}}}) == []


def test_a_database_of_the_first_schema_gets_its_counts_from_its_results(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    batch_id, lines = stored_batch(store, tmp_path, 3)
    store.record_result(batch_id, lines[0], LineOutcome.COMPLETED, record_text({"custom_id": "c0"}))
    store.record_result(batch_id, lines[2], LineOutcome.FAILED, record_text({"custom_id": "c2"}))
    with store._lock:  # back to schema 1: no counts in the batch's row
        store._db.execute("DROP INDEX batches_by_status")
        store._db.execute("ALTER TABLE batches DROP COLUMN completed")
        store._db.execute("ALTER TABLE batches DROP COLUMN failed")
        store._db.execute("PRAGMA user_version=1")
    store.close()
    again = Store(tmp_path / "b")
    counts = again.counts(batch_id, 3)
    assert (counts.completed, counts.failed) == (1, 1)
    again.record_result(batch_id, lines[1], LineOutcome.COMPLETED, record_text({"custom_id": "c1"}))
    assert again.counts(batch_id, 3).completed == 2


def test_a_store_that_cannot_start_closes_its_database_and_frees_the_directory(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened.append(real_connect(*args, **kwargs))
        return opened[-1]

    def full(self: Store) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sqlite3, "connect", connect)
    monkeypatch.setattr(Store, "remove_partial_uploads", full)
    with pytest.raises(StoreError, match="No space left on device"):
        Store(tmp_path / "b")
    assert len(opened) == 1
    with pytest.raises(sqlite3.ProgrammingError):  # closed
        opened[0].execute("SELECT 1")
    monkeypatch.undo()
    Store(tmp_path / "b").close()  # the directory's lock went with it
