"""An input file read into requests, or into errors that name each bad line (pure: bytes in,
values out). A batch is created only from a file with no bad line; otherwise it fails with
every problem listed in `errors.data`, as the OpenAI Batch API does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

# Errors listed per batch: enough to fix a file, not a second copy of a bad one.
MAX_ERRORS = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a batch: where its JSON lies in the input file (the body is read from
    there when the line is sent, so a 200 MB file is not kept twice)."""

    line: int  # 1-based, as editors count
    custom_id: str
    offset: int
    length: int


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


def numbered_lines(data: Iterable[bytes]) -> Iterable[tuple[int, int, bytes]]:
    """(line number, byte offset, line without its end) for each line of a file read in chunks
    of lines (a binary file object iterates so)."""
    offset = 0
    for number, raw in enumerate(data, start=1):
        yield number, offset, raw.rstrip(b"\r\n")
        offset += len(raw)


def validate(data: Iterable[bytes], *, endpoint: str, max_requests: int) -> Validation:
    """Every line of an input file checked for ``endpoint``: a JSON object with a string
    ``custom_id`` unique in the file, ``method`` POST, ``url`` the endpoint, a ``body`` object
    naming a ``model``, not streamed. Blank lines are skipped. More than ``max_requests`` lines
    is one error. Whether the models are served is the caller's to ask (`without_models`)."""
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
    for number, offset, text in numbered_lines(data):
        if not text.strip():
            continue
        count += 1
        if count > max_requests:
            continue
        problem, custom_id, model = _check_line(text, number, endpoint, seen)
        if problem is not None:
            error(problem)
        elif custom_id is not None and model is not None:
            lines.append(InputLine(number, custom_id, offset, len(text)))
            models.setdefault(model, []).append(number)
    if count > max_requests:
        error(LineError("too_many_requests", None,
                        f"the file has {count} requests; a batch may have at most {max_requests} "
                        "(batches.maxRequests): split it into several batches"))
    elif count == 0:
        error(LineError("empty_file", None, "the input file has no requests: one JSON object a line"))
    return Validation(tuple(lines), tuple(errors), more, {model: tuple(numbers) for model, numbers in models.items()})


def _check_line(text: bytes, number: int, endpoint: str,
                seen: set[str]) -> tuple[LineError | None, str | None, str | None]:
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        return LineError("invalid_json_line", number, f"line {number} is not valid JSON: {exc}"), None, None
    if not isinstance(document, dict):
        return LineError("invalid_json_line", number, f"line {number} is not a JSON object"), None, None
    custom_id = document.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError("missing_required_parameter", number,
                         f"line {number} has no custom_id (a non-empty string)", "custom_id"), None, None
    if custom_id in seen:
        return LineError("duplicate_custom_id", number,
                         f"line {number}: the custom_id {custom_id!r} is used by an earlier line; each must be "
                         "unique in the file", "custom_id"), None, None
    seen.add(custom_id)
    method = document.get("method")
    if method != "POST":
        return LineError("invalid_method", number, f"line {number}: method must be POST, got {method!r}",
                         "method"), None, None
    url = document.get("url")
    if url != endpoint:
        return LineError("invalid_url", number, f"line {number}: url must be the batch's endpoint {endpoint}, got "
                         f"{url!r}", "url"), None, None
    body = document.get("body")
    if not isinstance(body, dict):
        return LineError("missing_required_parameter", number, f"line {number} has no body (a JSON object)",
                         "body"), None, None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return LineError("missing_required_parameter", number, f"line {number}: body.model is missing",
                         "body.model"), None, None
    if body.get("stream") is True:
        return LineError("invalid_request", number, f"line {number}: a batch's requests cannot be streamed "
                         "(body.stream must be false or absent)", "body.stream"), None, None
    return None, custom_id, model


def line_body(text: bytes) -> bytes:
    """The request body of an input line (already validated) as sent to the upstream."""
    return json.dumps(json.loads(text)["body"], separators=(",", ":")).encode()
