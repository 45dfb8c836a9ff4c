"""A line's result as its line of the output or error file: an upstream's JSON answer goes in as
its bytes are (parsed once to check it, never serialised again), anything else is serialised
anew, always on one line; and records reach the store serialised, so its lock is never held
while one is made."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.records import answer_record, ended_record, result_id
from llamaswap.batches.rows import Result, record_text
from llamaswap.batches.store import Store
from llamaswap.batches.validate import InputLine

LINE = InputLine(3, "c-\u00e9\"3", 0, 10)


def parsed(record: str) -> Any:
    assert "\n" not in record and "\r" not in record  # one line of the JSONL file
    return json.loads(record)


def test_a_json_answer_goes_in_as_its_bytes_are(monkeypatch: pytest.MonkeyPatch) -> None:
    # Numbers as an embedding's answer writes them ("1.50" would be 1.5 if serialised again),
    # over 100 KB, with the whitespace an HTTP body may end with.
    body = b'{"object":"list","data":[{"embedding":[' + b",".join([b"1.50", b"-0.250e-3"] * 8000) + b"]}]}\r\n"
    dumped: list[int] = []
    real_dumps = json.dumps

    def dumps(value: Any, **kwargs: Any) -> str:
        dumped.append(len(repr(value)))
        return real_dumps(value, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps)
    record = answer_record("batch_b", LINE, 200, "req-1", body)
    assert body.strip().decode() in record  # verbatim
    assert max(dumped) < 100  # only the short strings around it were serialised
    monkeypatch.undo()
    document = parsed(record)
    assert document == {"id": result_id("batch_b", 3), "custom_id": LINE.custom_id, "error": None,
                        "response": {"status_code": 200, "request_id": "req-1", "body": json.loads(body)}}


def test_an_answer_on_several_lines_is_serialised_onto_one() -> None:
    body = json.dumps({"choices": [{"text": "a\nb"}]}, indent=2).encode()
    assert b"\n" in body
    document = parsed(answer_record("batch_b", LINE, 200, "req-2", body))
    assert document["response"]["body"] == json.loads(body)


def test_an_error_answer_names_its_status_and_message() -> None:
    body = b'{"error":{"message":"context too long","type":"invalid_request_error"}}'
    document = parsed(answer_record("batch_b", LINE, 400, "req-3", body))
    assert document["error"] == {"code": "http_400", "message": "context too long"}
    assert document["response"]["body"] == json.loads(body)


@pytest.mark.parametrize("body", [b"upstream exploded", b"\xff\xfe not utf-8", b"", b"\xef\xbb\xbf{}"])
def test_an_answer_that_is_not_json_goes_in_as_text(body: bytes) -> None:
    document = parsed(answer_record("batch_b", LINE, 500, "req-4", body))
    assert document["response"]["body"] == body.decode("utf-8", "replace")
    assert document["error"] == {"code": "http_500", "message": "the upstream answered 500"}


def test_the_store_holds_its_lock_for_no_serialising(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "b")
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(b"{}\n")
    file = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint="/v1/chat/completions", input_file_id=file.id, completion_window="24h",
                               window_s=3600, metadata=None, priority=-100, trace_id="0" * 32, span_id="0" * 16)
    lines = [InputLine(n, f"c{n}", 0, 2) for n in range(1, 301)]
    assert store.validated(batch.id, lines, [])
    held_while_dumping: list[bool] = []
    real_dumps = json.dumps

    def dumps(value: Any, **kwargs: Any) -> str:
        held_while_dumping.append(store._lock._is_owned())  # type: ignore[attr-defined]
        return real_dumps(value, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps)
    store.record_results([Result(batch.id, line, LineOutcome.COMPLETED, record_text({"custom_id": line.custom_id}),
                                 1.0) for line in lines[:100]])
    # Lines ended unanswered: their records are made a page at a time, each outside the lock.
    assert store.end_unfinished(batch.id, LineOutcome.CANCELLED,
                                lambda line: ended_record(batch.id, line, LineOutcome.CANCELLED)) == 200
    assert store.set_status(batch.id, BatchStatus.CANCELLING, only_from=(BatchStatus.IN_PROGRESS,))
    assert store.finalize(batch, BatchStatus.CANCELLED) is not None
    assert len(held_while_dumping) >= 300 and not any(held_while_dumping)
    assert store.counts(batch.id, 300).completed == 100
    store.close()
