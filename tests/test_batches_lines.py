"""Reading an input file within a bound: a line over batches.maxLineBytes is refused by its
number without being held, a long line is checked without building its JSON, and the checks
say the same as json.loads wherever both apply."""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamaswap.batches import validate as validate_module
from llamaswap.batches import lines as lines_module
from llamaswap.batches.lines import MAX_DEPTH, SCAN_STEP, NotJson, bounded_lines, fields_of, scan_fields
from llamaswap.batches.validate import count_requests, line_body, validate

ENDPOINT = "/v1/chat/completions"


def request(custom_id: str, **body: Any) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", **body}}).encode()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_lines_are_the_same_whatever_the_chunks(chunk: int) -> None:
    data = b"abc\r\n\n  \n" + b"x" * 50 + b"\r\n" + b"y" * 11 + b"\nlast"
    found = [(raw.number, raw.offset, raw.length, raw.text, raw.blank)
             for raw in bounded_lines(io.BytesIO(data), 11, chunk_bytes=chunk)]
    assert found == [(1, 0, 3, b"abc", False), (2, 5, 0, b"", True), (3, 6, 2, b"  ", True),
                     (4, 9, 50, None, False), (5, 61, 11, b"y" * 11, False), (6, 73, 4, b"last", False)]
    assert [data[offset:offset + length] for _, offset, length, text, _ in found if text is not None] == [
        text for _, _, _, text, _ in found if text is not None]


def test_a_line_over_the_bound_is_refused_by_its_number_and_the_others_are_checked() -> None:
    data = b"\n".join([request("a"), request("b", prompt="p" * 5000), b"", request("c")]) + b"\n"
    result = validate(io.BytesIO(data), endpoint=ENDPOINT, max_requests=10, max_line_bytes=1024)
    assert [(error.code, error.line) for error in result.errors] == [("line_too_long", 2)]
    message = result.errors[0].message
    assert "line 2 has 5" in message and "at most 1024 (batches.maxLineBytes)" in message
    assert [item.custom_id for item in result.lines] == ["a", "c"]
    assert count_requests(io.BytesIO(data)) == 3


def test_a_long_line_is_scanned_and_its_body_read_as_it_lies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate_module, "WHOLE_PARSE_BYTES", 64)  # every line here is "long"
    body = {"model": "m", "messages": [{"role": "user", "content": "h\u00e9llo \"quoted\" \\ " * 20}], "n": 1e3}
    data = json.dumps({"custom_id": "long", "method": "POST", "url": ENDPOINT, "body": body}).encode() + b"\n"
    data = request("short") + b"\n" + data  # the offsets are the file's, not the line's
    result = validate(io.BytesIO(data), endpoint=ENDPOINT, max_requests=10)
    assert result.errors == ()
    short, long = result.lines
    assert short.body_offset is not None and long.body_offset is not None and long.body_length is not None
    assert json.loads(data[long.body_offset:long.body_offset + long.body_length]) == body
    assert json.loads(line_body(data[long.offset:long.offset + long.length])) == body


def test_ten_million_empty_objects_are_checked_without_building_them() -> None:
    # 30 MB, the case: json.loads would build ten million dicts (~250 MB more).
    text = b'{"custom_id":"x","method":"POST","url":"' + ENDPOINT.encode() + b'","body":{"model":"m","x":[' + \
        b",".join([b"{}"] * 200_000) + b"]}}"
    fields = scan_fields(text)
    assert fields.top["custom_id"] == "x" and fields.body == {"model": "m"} and fields.body_span is not None


def test_deep_nesting_and_constants_are_not_json() -> None:
    with pytest.raises(NotJson, match="nested more than"):
        scan_fields(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    deep = validate(io.BytesIO(b"[" * 100_000 + b"]" * 100_000 + b"\n"), endpoint=ENDPOINT, max_requests=10)
    assert [error.code for error in deep.errors] == ["invalid_json_line"]
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        line = request("c").replace(b'"model": "m"', b'"model": "m", "t": ' + constant)
        result = validate(io.BytesIO(line + b"\n"), endpoint=ENDPOINT, max_requests=10)
        assert [error.code for error in result.errors] == ["invalid_json_line"], constant
        with pytest.raises(NotJson):
            scan_fields(line)


def test_a_long_value_is_cut_short_in_its_message() -> None:
    line = json.dumps({"custom_id": "a", "method": "P" * 10_000, "url": ENDPOINT, "body": {"model": "m"}})
    [error] = validate(io.BytesIO(line.encode()), endpoint=ENDPOINT, max_requests=10).errors
    assert error.code == "invalid_method" and len(error.message) < 200


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["custom_id", "method", "url", "body", "model", "stream", "x"]), inner, max_size=5),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}]))
def test_the_scan_finds_what_json_loads_finds(document: Any, dump: dict[str, Any]) -> None:
    text = json.dumps(document, ensure_ascii=False, **dump).encode()
    scanned, built = scan_fields(text.replace(b"\n", b" ")), fields_of(document)
    assert (scanned.is_object, _plain(scanned.top), _plain(scanned.body)) == (
        built.is_object, _plain(built.top), _plain(built.body))
    if scanned.body_span is not None:
        start, end = scanned.body_span
        assert json.loads(text.replace(b"\n", b" ")[start:end]) == document["body"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet='{}[]",:0123456789.eE-+ tfnrulsa\\', max_size=30).map(str.encode))
def test_the_scan_refuses_what_json_loads_refuses(text: bytes) -> None:
    try:  # as UTF-8 (json.loads would guess UTF-16 from some bytes; a batch file is UTF-8)
        json.loads(text.decode("utf-8"), parse_constant=lambda name: 1 / 0)
        loads_ok = True
    except (ValueError, ZeroDivisionError, RecursionError):
        loads_ok = False
    try:
        scan_fields(text)
        scan_ok = True
    except NotJson:
        scan_ok = False
    assert scan_ok == loads_ok


def _plain(top: dict[str, Any] | None) -> dict[str, Any] | None:
    """Containers as their kind (the scan keeps only that of a container value)."""
    return None if top is None else {name: ("object" if isinstance(value, dict) else "array" if isinstance(value, list)
                   else getattr(value, "kind", value)) for name, value in top.items()}


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="the peak memory is read from /proc")
def test_a_100_mb_line_is_refused_by_its_number_with_bounded_memory(tmp_path: pathlib.Path) -> None:
    size = 100 * 1024 * 1024
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as out:
        out.write(request("first") + b"\n")
        out.write(b'{"custom_id":"big","method":"POST","url":"' + ENDPOINT.encode() + b'","body":{"model":"m","p":"')
        block = b"a" * (1 << 20)
        for _ in range(100):
            out.write(block)
        out.write(b'"}}\n' + request("last") + b"\n")
    # In a fresh process: its peak memory (VmHWM) is this validation's alone, not the test session's.
    script = textwrap.dedent(f"""
        import json
        from llamaswap.batches.validate import validate

        def peak():
            return next(int(row.split()[1]) * 1024 for row in open("/proc/self/status") if row.startswith("VmHWM:"))

        before = peak()
        with open({str(path)!r}, "rb") as source:
            result = validate(source, endpoint={ENDPOINT!r}, max_requests=10, max_line_bytes=64 * 1024 * 1024)
        print(json.dumps({{"errors": [[e.code, e.line] for e in result.errors],
                           "lines": [l.custom_id for l in result.lines], "grew": peak() - before}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    found = json.loads(out.stdout)
    assert found["errors"] == [["line_too_long", 2]] and found["lines"] == ["first", "last"]
    # A loose memory bound, against the line's size: the line is never held (growth is a chunk or so).
    assert 0 <= found["grew"] < 50 * 1024 * 1024 < size


def test_a_string_of_megabytes_is_walked_in_steps_escapes_and_all() -> None:
    content = ("ab\"c\\d\u00e9\n" + "x" * 997) * 3000  # 3 MB, escapes across every step's edge
    text = json.dumps({"custom_id": "s", "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": content}]}}).encode()
    fields = scan_fields(text)
    assert fields.top["custom_id"] == "s" and fields.body == {"model": "m"} and fields.body_span is not None
    start, end = fields.body_span
    assert json.loads(text[start:end])["messages"][0]["content"] == content
    long_id = json.dumps({"custom_id": "i" * 3_000_000, "body": {"model": "m"}}).encode()
    assert scan_fields(long_id).top["custom_id"] == "i" * 3_000_000
    for broken in (text.replace(b"x" * 997, b"x" * 500 + b"\x01" + b"x" * 496, 1000),
                   text.replace(b"\\u00e9", b"\\u00zz", 2000), text[:len(text) // 2]):
        with pytest.raises(NotJson):
            scan_fields(broken)


@pytest.mark.parametrize("text", [b'[[1,2,]]', b'{"x":{"a":1,}}', b'[[1 2]]', b'[[01,1]]', b'[[1,2,3', b'[["a\\x",1]]',
                                  b'{"x":{"a":1,"b" 2,"c":3}}', b'[[{},{} {}]]', b'[[1.,2]]', b'[[-,1]]',
                                  b'[[' + b"1," * 5000 + b']]', b'{"x":[' + b'{},' * 3000 + b'{}}'])
def test_runs_of_members_refuse_what_json_loads_refuses(text: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(NotJson):
        scan_fields(text)


def test_runs_of_members_accept_what_json_loads_accepts() -> None:
    for text in (b'[[' + b"1, 2.5e3 ,\"s\",true,null,{},[ ]," * 2000 + b'0]]',
                 b'{"x":{' + b"".join(b'"k%d": [],' % n for n in range(3000)) + b'"z":1}, "custom_id": "c"}'):
        json.loads(text)
        assert scan_fields(text).is_object == text.startswith(b"{")
    assert scan_fields(b'{"x":{' + b'"a":1,' * 3000 + b'"b":2},"custom_id":"c"}').top["custom_id"] == "c"


def _escaped(length: int, every: int) -> str:
    """A string's JSON text of about ``length`` bytes with an escape every ``every`` characters."""
    return json.dumps(("y" * every + "\n") * (length // (every + 2)))


@pytest.mark.parametrize("shape", ["strings of 1 MB", "strings of 60 KB", "an object of 60 KB strings",
                                   "8 MB of whitespace", "a looked-for field of 8 MB", "a prompt of short lines"])
def test_a_scan_pauses_after_every_stretch_of_bytes_whatever_the_line(shape: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Between two pauses a scan goes 2 * SCAN_STEP bytes at most, whatever a line is made of: a
    # regex that matched a run of 1 MB strings in one call held the GIL for tens of milliseconds.
    # And it does not pause at every escape (a pause rests half a millisecond: a long prompt of
    # short lines took a pause per line).
    size = 8 << 20
    head, tail = b'{"custom_id":"c","method":"POST","url":"' + ENDPOINT.encode() + b'",', b'"body":{"model":"m"}}'
    if shape == "strings of 1 MB":
        middle = b'"x":[' + ",".join([_escaped(1 << 20, 4090)] * 8).encode() + b"],"
    elif shape == "strings of 60 KB":
        middle = b'"x":[' + ",".join([_escaped(60_000, 1000)] * (size // 60_000)).encode() + b"],"
    elif shape == "an object of 60 KB strings":
        middle = b'"x":{' + ",".join(f'"k{n}":{_escaped(60_000, 1000)}' for n in range(size // 60_000)).encode() + b"},"
    elif shape == "8 MB of whitespace":
        middle = b" " * size
    else:
        every = 4000 if shape == "a looked-for field of 8 MB" else 80
        middle, tail = b"", b'"body":{"model":"m","p":' + _escaped(size, every).encode() + b"}}"
    text = head + middle + tail
    assert len(text) >= size * 0.9
    monkeypatch.setattr(lines_module, "_check_utf8", lambda text, pause: None)  # its own pauses aside
    pauses = []
    fields = scan_fields(text, pause=lambda: pauses.append(1))
    assert fields.top["custom_id"] == "c" and fields.body == {"model": "m"}
    assert len(text) // (2 * SCAN_STEP) <= len(pauses) <= 2 * (len(text) // SCAN_STEP + 1)
