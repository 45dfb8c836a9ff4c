"""Where the activity log's lines go (runtime/activity.py): to the logger's LineHandlers (what
the CLI sets up) written directly, byte for byte what the logger would have written; to the
file, reopened when logrotate moves it; nowhere, and not encoded, when nothing takes them."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pathlib
from collections.abc import Iterator

import pytest
from flow import Flow, clock, virtual_time
from llamaswap.runtime import activity as activity_module
from llamaswap.runtime import json_line
from llamaswap.runtime.activity import LOGGER_NAME, ActivityLog, LineHandler

CONFIG = {"envoy": {"leaseSeconds": 1000}}


@contextlib.contextmanager
def cli_logger() -> Iterator[io.StringIO]:
    """The activity logger as `configure_logging` sets it up, its stream a StringIO. Entered in
    the test itself: pytest adds its capture handlers to a logger that does not propagate
    during each phase, and with one there the log goes through `logging` (as caplog needs)."""
    logger = logging.getLogger(LOGGER_NAME)
    saved = (logger.handlers[:], logger.propagate, logger.level)
    stream = io.StringIO()
    logger.handlers[:] = [LineHandler(stream)]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])


async def two_requests(activity: ActivityLog) -> None:
    flow = Flow(CONFIG, observers=[activity])
    a = await flow.arrive("a", "interactive", "a")
    b = await flow.arrive("b", "batch", "b")
    await flow.advance(1)
    await flow.complete(a, 200, first_byte_s=0.25)
    await flow.complete(b, 500)


@virtual_time
async def test_the_cli_handler_gets_the_bytes_the_logger_would_write(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    with cli_logger() as stream:
        activity = ActivityLog(clock(), path=str(path))
        assert activity._line_handlers is not None  # written directly, not through `logging`
        await two_requests(activity)
        activity.close()
    records = activity.recent()
    assert [r["request_id"] for r in records] == ["a", "b"]
    written = stream.getvalue()
    assert written == path.read_text(encoding="utf-8")  # the settings line too, in the same order
    # What logging's "%(message)s" StreamHandler wrote for each record: its compact JSON, then "\n".
    formatter = logging.Formatter("%(message)s")
    assert [line for line in written.split("\n") if '"event":"request"' in line] == [
        formatter.format(logging.makeLogRecord({"msg": json_line.line(record).decode()})) for record in records]
    assert written.endswith("}\n") and written.count("\n") == 3


@virtual_time
async def test_a_log_level_above_info_leaves_the_process_log_and_keeps_the_file(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "activity.jsonl"
    with cli_logger() as stream:
        logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)  # --log-level warning
        activity = ActivityLog(clock(), path=str(path))
        await two_requests(activity)
        activity.close()
        assert stream.getvalue() == ""
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert [(r["event"], r.get("request_id")) for r in lines] == [
            ("settings", None), ("request", "a"), ("request", "b")]

        # With no file either, a line has no destination: the record is kept for GET /activity,
        # never encoded.
        encoded: list[object] = []
        monkeypatch.setattr(activity_module, "_encode", lambda record: encoded.append(record) or b"{}")
        quiet = ActivityLog(clock())
        await two_requests(quiet)
        assert [r["request_id"] for r in quiet.recent()] == ["a", "b"]
        assert encoded == []


@virtual_time
async def test_the_file_is_reopened_after_logrotate_moves_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "activity.jsonl"
    activity = ActivityLog(clock(), path=str(path))
    flow = Flow(CONFIG, observers=[activity])
    a = await flow.arrive("a", "interactive", "a")
    await flow.complete(a)
    path.rename(tmp_path / "activity.jsonl.1")  # logrotate's move; the sidecar is not told
    b = await flow.arrive("b", "interactive", "a")
    await flow.complete(b)
    (tmp_path / "activity.jsonl").unlink()  # removed outright: created again at the next line
    c = await flow.arrive("c", "interactive", "a")
    await flow.complete(c)
    activity.close()

    def requests(name: str) -> list[str]:
        lines = (tmp_path / name).read_text(encoding="utf-8").splitlines()
        return [record["request_id"] for record in map(json.loads, lines) if record["event"] == "request"]

    assert requests("activity.jsonl.1") == ["a"]
    assert requests("activity.jsonl") == ["c"]
