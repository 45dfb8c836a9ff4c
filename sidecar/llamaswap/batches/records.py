"""What a batch line's result says, and a line's body read back from its input file (pure but
for the read): the output file's record of an answer, the error file's record of a line that
got none, and the ids they carry (the same on every try, so a line sent again is the same record)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from llamaswap.batches.lifecycle import LineOutcome
from llamaswap.batches.rows import BatchRecord, record_text
from llamaswap.batches.validate import InputLine, line_body


def result_id(batch_id: str, line: int) -> str:
    """A line's `id` in the output: the same on every try, so a line sent again is the same record."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{line}".encode()).hexdigest()[:24]


def answer_record(batch_id: str, line: InputLine, status: int, request_id: str, body: bytes) -> str:
    """The output or error file's line for an answer of the upstream. An answer that is JSON on
    one line (llama-server's are) goes in as its bytes are: parsed once, to know it is JSON, and
    never serialised again (a long answer costs one parse, not a parse and a serialisation)."""
    text: str | None
    try:
        text = body.decode("utf-8").strip(" \t\r\n")  # JSON's whitespace around it
        document: Any = json.loads(text)
    except ValueError:  # not UTF-8 (UnicodeDecodeError is a ValueError), or not JSON
        text, document = None, body.decode("utf-8", "replace")
    error = None
    if not 200 <= status < 300:
        detail = document.get("error") if isinstance(document, dict) else None
        message = detail.get("message") if isinstance(detail, dict) else None
        error = {"code": f"http_{status}", "message": message if isinstance(message, str) else
                 f"the upstream answered {status}"}
    if text is None or "\n" in text or "\r" in text:  # not JSON, or not on one line: serialised anew
        return record_text({"id": result_id(batch_id, line.line), "custom_id": line.custom_id,
                            "response": {"status_code": status, "request_id": request_id, "body": document},
                            "error": error})
    return (f'{{"id":{json.dumps(result_id(batch_id, line.line))},"custom_id":{json.dumps(line.custom_id)},'
            f'"response":{{"status_code":{status},"request_id":{json.dumps(request_id)},"body":{text}}},'
            f'"error":{record_text(error) if error is not None else "null"}}}')


def failed_record(batch_id: str, line: InputLine, code: str, message: str) -> str:
    """The error file's line for a line that ended without an answer of the upstream."""
    return record_text({"id": result_id(batch_id, line.line), "custom_id": line.custom_id, "response": None,
                        "error": {"code": code, "message": message}})


class LineUnreadable(Exception):
    """A line's body cannot be read from its input file (gone, cut short, changed)."""


def ended_record(batch_id: str, line: InputLine, outcome: LineOutcome) -> str:
    """The error file's line for a line never answered (expired, cancelled)."""
    message = {LineOutcome.EXPIRED: "the batch's completion window ended before this request ran",
               LineOutcome.CANCELLED: "the batch was cancelled before this request finished"}[outcome]
    return record_text({"id": result_id(batch_id, line.line), "custom_id": line.custom_id, "response": None,
                        "error": {"code": outcome.error_code, "message": message}})


def read_exactly(fd: int, offset: int, length: int, batch: BatchRecord, line: InputLine) -> bytes:
    try:
        data = os.pread(fd, length, offset)
    except OSError as exc:
        raise LineUnreadable(f"line {line.line} cannot be read from the input file {batch.input_file_id}: "
                             f"{exc}") from exc
    if len(data) != length:
        raise LineUnreadable(f"line {line.line} is cut short in the input file {batch.input_file_id} (it has "
                             f"{len(data)} of its {length} bytes)")
    return data


def parsed_body(text: bytes, batch: BatchRecord, line: InputLine) -> bytes:
    try:
        return line_body(text)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise LineUnreadable(f"line {line.line} of the input file {batch.input_file_id} is no longer the request "
                             f"that was validated ({type(exc).__name__})") from exc
