"""An input file read into requests, or into errors that name each bad line (pure: bytes in,
values out). A batch is created only from a file with no bad line; otherwise it fails with
every problem listed in `errors.data`, as the OpenAI Batch API does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from llamaswap.batches.lines import Fields, NotJson, bounded_lines, fields_of, scan_fields

# Errors listed per batch: enough to fix a file, not a second copy of a bad one.
MAX_ERRORS = 1000
# batches.maxLineBytes when unset: the listener's envoy.maxRequestBytes (a longer line could not be sent).
MAX_LINE_BYTES_DEFAULT = 64 * 1024 * 1024
# A line up to this is parsed whole (json.loads: tens of microseconds, little memory); a longer one
# is scanned token by token (`lines.scan_fields`, in steps that pause), and its body is sent as it
# lies in the file, never parsed again. Parsing a line of 1 MB held the GIL 45 ms at validation,
# and parsing and serialising it again 70 ms at each send: an event loop beside it waited as long.
WHOLE_PARSE_BYTES = 64 * 1024
# Lines between two calls of validate's ``pause`` (a millisecond's work or so).
PAUSE_LINES = 64
# A value shown in an error message is cut to this many characters.
SHOWN_MOST = 80


@dataclasses.dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a batch: where its JSON lies in the input file (the body is read from
    there when the line is sent, so a 200 MB file is not kept twice)."""

    line: int  # 1-based, as editors count
    custom_id: str
    offset: int
    length: int
    # Where its body's JSON lies in the file, for a line too long to parse whole when it is sent
    # (None: the body is parsed out of the line, `line_body`).
    body_offset: int | None = None
    body_length: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LineError:
    """One problem of an input file, in the shape of the Batch API's `errors.data`."""

    code: str
    line: int | None
    message: str
    param: str | None = None

    def document(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


@dataclasses.dataclass(frozen=True, slots=True)
class Validation:
    lines: tuple[InputLine, ...]
    errors: tuple[LineError, ...]
    more_errors: int = 0  # errors beyond MAX_ERRORS, counted only
    models: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # model -> its lines

    def without_models(self, unserved: Iterable[str]) -> Validation:
        """The same, with each line of a model the node does not serve (asked by the caller, the
        way admission asks) as an error."""
        refused = [LineError("model_not_found", number, f"line {number}: the model {model!r} is not served here "
                             "(GET /v1/models lists what is)", "body.model")
                   for model in unserved for number in self.models.get(model, ())]
        if not refused:
            return self
        errors = sorted([*self.errors, *refused], key=lambda error: (error.line is None, error.line or 0))
        return Validation(self.lines, tuple(errors[:MAX_ERRORS]), self.more_errors + max(0, len(errors) - MAX_ERRORS),
                          self.models)


def count_requests(source: IO[bytes]) -> int:
    """The non-blank lines of a file, read in chunks (a line's bytes are not kept)."""
    return sum(1 for raw in bounded_lines(source, 0) if not raw.blank)


def no_pause() -> None:
    """Between steps of a validation: nothing (the feeder yields its thread's turn there)."""


def validate(source: IO[bytes], *, endpoint: str, max_requests: int,
             max_line_bytes: int = MAX_LINE_BYTES_DEFAULT, pause: Callable[[], None] = no_pause) -> Validation:
    """Every line of an input file checked for ``endpoint``: a JSON object with a string
    ``custom_id`` unique in the file, ``method`` POST, ``url`` the endpoint, a ``body`` object
    naming a ``model``, not streamed. Blank lines are skipped. A line over ``max_line_bytes``
    is an error of its own, not read (batches.maxLineBytes). More than ``max_requests`` lines
    is one error. Whether the models are served is the caller's to ask (`without_models`).

    Memory: a chunk of the file, one line (at most ``max_line_bytes``), the lines found; a line
    over WHOLE_PARSE_BYTES is scanned, not built (`lines.scan_fields`). ``pause`` is called
    between short steps (every PAUSE_LINES lines, and within a long line's scan): run in a
    thread, the caller lets the event loop in there."""
    lines: list[InputLine] = []
    models: dict[str, list[int]] = {}
    errors: list[LineError] = []
    more = 0
    seen: set[str] = set()

    def error(problem: LineError) -> None:
        nonlocal more
        if len(errors) < MAX_ERRORS:
            errors.append(problem)
        else:
            more += 1

    count = 0
    for raw in bounded_lines(source, max_line_bytes, pause=pause):
        if raw.number % PAUSE_LINES == 0:
            pause()
        if raw.blank:
            continue
        count += 1
        if count > max_requests:
            continue
        number = raw.number
        if raw.text is None:
            error(LineError("line_too_long", number, f"line {number} has {raw.length} bytes; a line may have at most "
                            f"{max_line_bytes} (batches.maxLineBytes): make its request smaller"))
            continue
        problem, custom_id, model, span = _check_line(raw.text, number, endpoint, seen, pause)
        if problem is not None:
            error(problem)
        elif custom_id is not None and model is not None:
            body = (raw.offset + span[0], span[1] - span[0]) if span else (None, None)
            lines.append(InputLine(number, custom_id, raw.offset, raw.length, *body))
            models.setdefault(model, []).append(number)
    if count > max_requests:
        error(LineError("too_many_requests", None,
                        f"the file has {count} requests; a batch may have at most {max_requests} "
                        "(batches.maxRequests): split it into several batches"))
    elif count == 0:
        error(LineError("empty_file", None, "the input file has no requests: one JSON object a line"))
    return Validation(tuple(lines), tuple(errors), more, {model: tuple(numbers) for model, numbers in models.items()})


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _fields(text: bytes, pause: Callable[[], None]) -> Fields:
    if len(text) <= WHOLE_PARSE_BYTES:
        try:
            return fields_of(json.loads(text, parse_constant=_refuse_constant))
        except RecursionError as exc:
            raise NotJson("nested too deep") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise NotJson(str(exc)) from exc
    return scan_fields(text, pause)


def _shown(value: Any) -> str:
    """A value in a message, cut short (a field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= SHOWN_MOST else text[:SHOWN_MOST] + "..."


def _check_line(text: bytes, number: int, endpoint: str, seen: set[str], pause: Callable[[], None]
                ) -> tuple[LineError | None, str | None, str | None, tuple[int, int] | None]:
    try:
        fields = _fields(text, pause)
    except NotJson as exc:
        return LineError("invalid_json_line", number, f"line {number} is not valid JSON: {exc}"), None, None, None
    if not fields.is_object:
        return LineError("invalid_json_line", number, f"line {number} is not a JSON object"), None, None, None
    custom_id = fields.top.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError("missing_required_parameter", number,
                         f"line {number} has no custom_id (a non-empty string)", "custom_id"), None, None, None
    if custom_id in seen:
        return LineError("duplicate_custom_id", number,
                         f"line {number}: the custom_id {_shown(custom_id)} is used by an earlier line; each must be "
                         "unique in the file", "custom_id"), None, None, None
    seen.add(custom_id)
    method = fields.top.get("method")
    if method != "POST":
        return LineError("invalid_method", number, f"line {number}: method must be POST, got {_shown(method)}",
                         "method"), None, None, None
    url = fields.top.get("url")
    if url != endpoint:
        return LineError("invalid_url", number, f"line {number}: url must be the batch's endpoint {endpoint}, got "
                         f"{_shown(url)}", "url"), None, None, None
    body = fields.body
    if body is None:
        return LineError("missing_required_parameter", number, f"line {number} has no body (a JSON object)",
                         "body"), None, None, None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return LineError("missing_required_parameter", number, f"line {number}: body.model is missing",
                         "body.model"), None, None, None
    if body.get("stream") is True:
        return LineError("invalid_request", number, f"line {number}: a batch's requests cannot be streamed "
                         "(body.stream must be false or absent)", "body.stream"), None, None, None
    return None, custom_id, model, fields.body_span


def line_body(text: bytes) -> bytes:
    """The request body of an input line (already validated) as sent to the upstream."""
    return json.dumps(json.loads(text)["body"], separators=(",", ":")).encode()
