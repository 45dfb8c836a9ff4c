"""One record as one JSON line (runtime/json_line.py): the same JSON as the standard library's
compact encoder for every kind of value a record holds, ASCII as it always was, and the
standard library's own bytes wherever orjson refuses a document or would write a string
differently; the activity log's lines read back as the records it kept."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Any

import pytest
from flow import Flow, clock, virtual_time
from llamaswap.runtime import activity as activity_module
from llamaswap.runtime import json_line
from llamaswap.runtime.activity import ActivityLog

@dataclasses.dataclass
class Point:
    x: int
    y: int


# Every type a record's values have: str, int, float (a small one, a large one, a whole one,
# a negative one), bool, null, a list of str, a list of objects, an object of ints and lists.
EVERY_TYPE: dict[str, Any] = {
    "event": "request", "time": 1796590041.654, "request_id": "6f1c2a9e-0b7d-4c1e-9a51-000000000001",
    "serial_priority": -100, "serial_score": -99.967, "aging": 5e-06, "tiny": 1e-07,
    "arrival_unix_ms": 1796590041643.556,
    "big_float": 1.2345678901234568e+17, "whole": 2000.0, "zero": 0.0, "negative_zero": -0.0, "max_tokens": 16,
    "largest_int64": 2**63 - 1, "smallest_int64": -(2**63), "streamed": True, "batch_line": False, "trace_id": None,
    "reordered_by": ["aging", "swap_affinity"], "evicted": [{"model": "b", "reason": "lru"}], "empty": [],
    "model_slots": {"a": 2, "b": 1}, "upstreams": [{"name": "gpu0", "models": None, "pinned": []}],
    "quoted": 'say "hi"\\ \n\r\t\b\f \x00 \x1f',
}


def same_json(document: Any) -> None:
    line = json_line.line(document)
    assert isinstance(line, bytes) and line.isascii() and b"\n" not in line
    assert json.loads(line) == json.loads(json.dumps(document))
    assert json.loads(line) == json.loads(json_line.stdlib_line(document))


def test_every_kind_of_value_reads_back_as_the_standard_library_writes_it() -> None:
    same_json(EVERY_TYPE)
    # Strings are the standard library's bytes; only a number's spelling may differ (5e-6 for 5e-06).
    strings = {key: value for key, value in EVERY_TYPE.items() if not isinstance(value, float)}
    assert json_line.line(strings) == json_line.stdlib_line(strings)
    assert json_line.stdlib_line(EVERY_TYPE) == json.dumps(EVERY_TYPE, separators=(",", ":")).encode()


@pytest.mark.parametrize("text", ["modèle-é", "日本語", "emoji \U0001f600", "del \x7f", "line sep \u2028",
                                  "lone \ud800"])
def test_a_string_outside_printable_ascii_is_escaped_as_the_standard_library_escapes_it(text: str) -> None:
    document = {"model": text, "request_id": "r", "n": 1}
    assert json_line.line(document) == json.dumps(document, separators=(",", ":")).encode()
    assert json.loads(json_line.line(document))["model"] == text


@pytest.mark.parametrize("document", [{"tokens": 2**64}, {"tokens": -(2**63) - 1}, {"nested": [{"n": 10**30}]},
                                      {1: "an int key", "b": 2}])
def test_what_orjson_refuses_is_encoded_by_the_standard_library(document: dict[Any, Any]) -> None:
    assert json_line.line(document) == json.dumps(document, separators=(",", ":")).encode()


@pytest.mark.parametrize("value", [object(), datetime.datetime(2026, 12, 6), Point(1, 2), {1, 2}])
def test_what_the_standard_library_refuses_still_fails_as_it_did(value: object) -> None:
    with pytest.raises(TypeError):
        json.dumps(value)
    with pytest.raises(TypeError):
        json_line.line({"a": value})


def test_orjson_where_it_is_installed_the_standard_library_where_it_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import orjson  # noqa: F401 - a dependency: present wherever the package was installed
    except ImportError:
        assert json_line.ENCODER == "json"
    else:
        assert json_line.ENCODER == "orjson"
    # The one difference: a float's spelling, not its value.
    spelt = b'{"aging":5e-6}' if json_line.ENCODER == "orjson" else b'{"aging":5e-06}'
    assert json_line.line({"aging": 5e-06}) == spelt and json.loads(spelt) == {"aging": 5e-06}
    monkeypatch.setattr(json_line, "_dumps", None)  # as without orjson
    assert json_line.line(EVERY_TYPE) == json_line.stdlib_line(EVERY_TYPE)
    assert json_line.line({"aging": 5e-06}) == b'{"aging":5e-06}'


@virtual_time
async def test_lines_written_through_either_encoder_read_back_as_the_records(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The activity log's file, once with the module's encoder (orjson where installed) and once
    with the standard library's: each line reads back as the record kept for GET /activity."""
    for name, encoder in (("line", json_line.line), ("stdlib", json_line.stdlib_line)):
        monkeypatch.setattr(activity_module, "_encode", encoder)
        path = tmp_path / f"{name}.jsonl"
        activity = ActivityLog(clock(), path=str(path))
        flow = Flow({"envoy": {"leaseSeconds": 1000}}, observers=[activity])
        a = await flow.arrive("é-1", "interactive", "modèle")
        b = await flow.arrive("b", "batch", "b")
        await flow.cancel(b)  # gone while it waited: never dispatched
        await flow.advance(0.001)
        await flow.complete(a, 200, first_byte_s=0.000005)
        activity.close()
        written = [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]
        kept = activity.recent()
        assert [record["request_id"] for record in kept] == ["b", "é-1"]
        assert [record for record in written if record["event"] == "request"] == kept
        assert kept[1]["first_byte_ms"] == 0.005 and kept[1]["model"] == "modèle"
        assert (kept[0]["dispatched"], kept[1]["dispatched"]) == (False, True)
