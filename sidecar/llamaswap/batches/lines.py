"""An input file's lines read within a bound (pure: bytes in, values out).

Two jobs, both for memory:
- `bounded_lines` reads a file in chunks and yields each line's bytes, except for a line longer
  than the bound: that one is counted to its end and yielded without its bytes, so a 100 MB line
  costs a chunk of memory, not 100 MB;
- `scan_fields` finds the few fields a batch line must have (custom_id, method, url, body.model,
  body.stream, where body lies) by walking the JSON token by token without building it: a long
  line of ten million `{}` costs its bytes and a stack, not ten million objects (json.loads
  would grow by gigabytes). It checks the JSON's grammar as strictly as json.loads (and refuses
  NaN and Infinity, which an upstream's parser would refuse too).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from typing import IO, Any

READ_CHUNK = 1 << 20
# Steps of a scan between two calls of its ``pause``.
PAUSE_STEPS = 256
# Deeper nesting is refused (json.loads stops near Python's recursion limit, 1000).
MAX_DEPTH = 512
_BLANK = b" \t\r\n\x0b\x0c"


@dataclasses.dataclass(frozen=True, slots=True)
class RawLine:
    """One line of a file: its number (1-based), where it starts, its length without its end,
    and its bytes (None: longer than the bound, not kept)."""

    number: int
    offset: int
    length: int
    text: bytes | None
    blank: bool


def bounded_lines(source: IO[bytes], max_line_bytes: int, *, chunk_bytes: int = READ_CHUNK,
                  pause: Callable[[], None] = lambda: None) -> Iterator[RawLine]:
    """Each line of ``source`` (seekable; a final line without its end too); a line's end is \\n
    or \\r\\n. Memory: a chunk, and a line within the bound when it is yielded. A line that spans
    chunks is not gathered as it is read (a line over the bound would be held up to the bound
    before it is known to be over): it is read again from its start once its end is found."""
    number = 0
    offset = 0  # where the current line starts in the file
    length = 0  # its bytes so far
    blank = True
    last = b""  # its last byte so far (a \r before its \n is not part of it)
    position = 0  # where the current chunk starts in the file

    def ended(chunk: bytes, end: int) -> RawLine:
        text_length = length - (1 if last == b"\r" else 0)
        text = None
        if text_length <= max_line_bytes:
            if offset >= position:  # begun in this chunk
                text = chunk[offset - position:offset - position + text_length]
            else:
                here = source.tell()
                source.seek(offset)
                text = source.read(text_length)
                source.seek(here)
        return RawLine(number, offset, text_length, text, blank)

    while chunk := source.read(chunk_bytes):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end < 0 else end
            if stop > start:
                length += stop - start
                last = chunk[stop - 1:stop]
                if blank and chunk[start:stop].strip(_BLANK):
                    blank = False
            if end < 0:
                break
            number += 1
            yield ended(chunk, end)
            offset += length + 1
            length, blank, last = 0, True, b""
            start = end + 1
        position += len(chunk)
        pause()
    if length:
        number += 1
        yield ended(b"", 0)


# Each regex call scans SCAN_STEP bytes at most (it holds the GIL: an event loop beside it waits
# that long, about a millisecond): runs of members, a long string's parts and whitespace are
# matched up to a window's end; a token is short by its pattern (a string of at most ~70 KB, a
# number of at most 4300 digits a part: Python's own bound on int(), which json.loads meets; at
# most 4096 bytes of whitespace before it), and longer strings and whitespace are walked a window
# at a time. A scan pauses once it went SCAN_STEP bytes (or PAUSE_STEPS steps) since its last
# pause: at most 2 * SCAN_STEP bytes between two pauses.
SCAN_STEP = 1 << 17
_WS = rb"[ \t\r\n]*"
_ESCAPE = rb'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})'
_STRING = rb'"[^"\\\x00-\x1f]{0,1024}+(?:' + _ESCAPE + rb'[^"\\\x00-\x1f]{0,1024}+){0,64}+"'
_NUMBER = rb"-?(?:0|[1-9][0-9]{0,4299})(?:\.[0-9]{1,4300})?(?:[eE][+-]?[0-9]{1,4300})?"
# One JSON token after optional whitespace: a (short) string, a number, a literal, or punctuation.
_TOKEN = re.compile(rb"[ \t\r\n]{0,4096}+(?:(" + _STRING + rb")|(" + _NUMBER + rb")|(true|false|null)|([{}\[\],:]))")
# A stretch of a string's characters and escapes (matched within a window: it may stop anywhere
# between two of them, and the next stretch goes on from there).
_STRING_PART = re.compile(rb'[^"\\\x00-\x1f]*+(?:' + _ESCAPE + rb'[^"\\\x00-\x1f]*+)*+')
_BLANKS = re.compile(_WS)
# Runs of simple members (a scalar or an empty container, then a comma) inside a container none
# of whose members is looked for, matched in one call: ten million {} are one regex, not twenty
# million turns of the loop. What ends a run (the last member, anything else) goes token by token.
_SIMPLE = rb"(?:" + _STRING + rb"|" + _NUMBER + rb"|true|false|null|\{" + _WS + rb"\}|\[" + _WS + rb"\])"
# At most RUN_MOST members a call: the regex engine keeps a backtracking entry per member matched.
RUN_MOST = 1024
_ARRAY_RUN = re.compile(rb"(?:" + _WS + _SIMPLE + _WS + rb",){1,%d}" % RUN_MOST)
_OBJECT_RUN = re.compile(rb"(?:" + _WS + _STRING + _WS + rb":" + _WS + _SIMPLE + _WS + rb",){1,%d}" % RUN_MOST)
_LITERALS = {b"true": True, b"false": False, b"null": None}
# Names longer than this cannot be one of the fields looked for: they are not decoded.
_NAME_MOST = 64
_TOP_FIELDS = frozenset({"custom_id", "method", "url", "body"})
_BODY_FIELDS = frozenset({"model", "stream"})


class NotJson(ValueError):
    """The line is not valid JSON (the message says where)."""


class Container:
    """A value that is an object or an array, where only its kind was kept."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"an {self.kind}"


@dataclasses.dataclass(slots=True)
class Fields:
    """What a batch line's checks need of its JSON: the top-level value's kind, the values of
    custom_id, method and url, whether body is an object, body.model and body.stream, and where
    body's value lies in the line (bytes, when scanned)."""

    is_object: bool
    top: dict[str, Any] = dataclasses.field(default_factory=dict)
    body: dict[str, Any] | None = None  # body's fields when it is an object
    body_span: tuple[int, int] | None = None  # (start, end) in the line


def fields_of(document: Any) -> Fields:
    """The same from a document json.loads built (a short line)."""
    if not isinstance(document, dict):
        return Fields(is_object=False)
    top = {name: document[name] for name in _TOP_FIELDS if name in document}
    body = top.get("body")
    return Fields(True, top, {name: body[name] for name in _BODY_FIELDS if name in body}
                  if isinstance(body, dict) else None)


def scan_fields(text: bytes, pause: Callable[[], None] = lambda: None) -> Fields:
    """The fields of one line, walking its tokens (memory: the line and a stack of MAX_DEPTH);
    NotJson where json.loads would refuse it (and for NaN, Infinity, deeper than MAX_DEPTH).
    ``pause`` is called after every SCAN_STEP bytes or PAUSE_STEPS steps (a step scans
    SCAN_STEP bytes at most)."""
    _check_utf8(text, pause)
    stack: list[int] = []  # b"{" or b"[" of each open container
    names: list[str | None] = []  # per open object: the name whose value comes next
    expect = "value"  # value | first_value (after [) | name | first_name (after {) | colon | after_value
    found = Fields(is_object=False)
    body_start = -1
    position = 0
    paused_at = 0
    end = len(text)
    steps = 0
    while True:
        steps += 1
        if steps % PAUSE_STEPS == 0 or position - paused_at >= SCAN_STEP:
            pause()
            paused_at = position
        if expect == "after_value" and not stack:
            tail = _blanks_end(text, position, pause)
            if tail != end:
                raise NotJson(f"extra data at byte {tail}")
            return found
        window = min(end, position + SCAN_STEP)  # a run ends at a member's comma: never cut by it
        if stack and stack[-1] == ord("[") and expect in ("value", "first_value"):
            run = _ARRAY_RUN.match(text, position, window)
            if run is not None:
                position, expect = run.end(), "value"
                continue
        elif (stack and expect in ("name", "first_name")
              and not _members_looked_for(stack, names, found)):
            run = _OBJECT_RUN.match(text, position, window)
            if run is not None:
                position, expect = run.end(), "name"
                continue
        match = _TOKEN.match(text, position)
        if match is None:  # long whitespace before the token, or a long string: walked, and matched again
            start = _blanks_end(text, position, pause)
            if start >= end:
                raise NotJson("the line ends too early")
            match = _TOKEN.match(text, start) if start > position else None  # else: matched already
        long_string = None
        if match is not None:
            string, number, literal, punct = match.groups()
            start = match.start(match.lastindex or 0)
            position = match.end()
        else:
            if text[start] != ord('"'):
                raise NotJson(f"unexpected byte at {start}")
            position = _long_string_end(text, start, pause)
            string, number, literal, punct = None, None, None, None
            long_string = (start, position)
        if expect in ("name", "first_name"):
            if long_string is not None:
                names[-1] = None  # too long to be a name looked for
                expect = "colon"
                continue
            if string is not None:
                names[-1] = json.loads(string) if len(string) <= _NAME_MOST else None
                expect = "colon"
                continue
            if punct == b"}" and expect == "first_name":
                expect = _close(stack, names, b"{", start, found, body_start)
                continue
            raise NotJson(f"a name in quotes expected at byte {start}")
        if expect == "colon":
            if punct != b":":
                raise NotJson(f"':' expected at byte {start}")
            expect = "value"
            continue
        if expect == "after_value":
            if punct == b",":
                expect = "name" if stack[-1] == ord("{") else "value"
                continue
            if punct in (b"}", b"]"):
                expect = _close(stack, names, b"{" if punct == b"}" else b"[", start, found, body_start)
                continue
            raise NotJson(f"',' or a closing bracket expected at byte {start}")
        # a value (or, after '[', a ']')
        if punct == b"]" and expect == "first_value":
            expect = _close(stack, names, b"[", start, found, body_start)
            continue
        field = _field(stack, names, found)
        if punct in (b"{", b"["):
            if len(stack) >= MAX_DEPTH:
                raise NotJson(f"nested more than {MAX_DEPTH} deep")
            if not stack:
                found.is_object = punct == b"{"
            elif field is not None:
                _keep(found, field, Container("object" if punct == b"{" else "array"))
                if field == ("top", "body"):
                    body_start = start
                    found.body = {} if punct == b"{" else None
                    found.body_span = None
            stack.append(punct[0])
            names.append(None)
            expect = "first_name" if punct == b"{" else "first_value"
            continue
        if punct is not None:
            raise NotJson(f"a value expected at byte {start}")
        if field is not None:
            if long_string is not None:
                value: Any = json.loads(text[long_string[0]:long_string[1]])
            elif string is not None:
                value = json.loads(string)
            elif literal is not None:
                value = _LITERALS[literal]
            else:
                value = Container("number") if number is None or len(number) > 40 else json.loads(number)
            _keep(found, field, value)
        expect = "after_value"


def _field(stack: list[int], names: list[str | None], found: Fields) -> tuple[str, str] | None:
    """Which looked-for field the next value is (None: one not looked for)."""
    if len(stack) == 1 and stack[0] == ord("{") and names[0] in _TOP_FIELDS:
        return ("top", names[0])
    if (len(stack) == 2 and stack[1] == ord("{") and names[0] == "body" and found.body is not None
            and names[1] in _BODY_FIELDS):
        return ("body", names[1])
    return None


def _long_string_end(text: bytes, start: int, pause: Callable[[], None]) -> int:
    """Where the string that opens at ``start`` ends (after its closing quote), walked a
    SCAN_STEP at a time (a pause between two); NotJson when it is not a JSON string."""
    position = start + 1
    while True:
        part = _STRING_PART.match(text, position, min(len(text), position + SCAN_STEP))
        stop = part.end() if part else position
        if stop < len(text) and text[stop] == ord('"'):
            return stop + 1
        if stop == position:  # a window holds a whole escape: no progress is a byte no string has
            raise NotJson("the line ends in a string" if stop >= len(text) else
                          f"a string with an unexpected byte at {stop}")
        position = stop
        pause()


def _blanks_end(text: bytes, position: int, pause: Callable[[], None]) -> int:
    """Where the whitespace from ``position`` ends, walked a SCAN_STEP at a time."""
    while True:
        window = min(len(text), position + SCAN_STEP)
        blanks = _BLANKS.match(text, position, window)
        stop = blanks.end() if blanks else position
        if stop < window:
            return stop
        if window == len(text):
            return window
        position = stop
        pause()


def _members_looked_for(stack: list[int], names: list[str | None], found: Fields) -> bool:
    """Whether a member of the open object may be a looked-for field (the top-level's, body's)."""
    return len(stack) == 1 or (len(stack) == 2 and names[0] == "body" and found.body is not None)


def _keep(found: Fields, field: tuple[str, str], value: Any) -> None:
    where, name = field
    if where == "top":
        found.top[name] = value
        if name == "body" and not isinstance(value, Container):
            found.body, found.body_span = None, None
    elif found.body is not None:
        found.body[name] = value


def _close(stack: list[int], names: list[str | None], opener: bytes, at: int, found: Fields,
           body_start: int) -> str:
    if not stack or stack[-1] != opener[0]:
        raise NotJson(f"a bracket that does not match at byte {at}")
    stack.pop()
    names.pop()
    if len(stack) == 1 and names[0] == "body" and opener == b"{" and found.body is not None:
        found.body_span = (body_start, at + 1)
    return "after_value"


def _check_utf8(text: bytes, pause: Callable[[], None]) -> None:
    """UTF-8 throughout, checked a chunk at a time (a decoded copy of the whole line is not kept)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(text)
    try:
        for start in range(0, len(view), SCAN_STEP):
            decoder.decode(view[start:start + SCAN_STEP], final=False)
            pause()
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise NotJson(f"not UTF-8 ({exc.reason})") from exc
