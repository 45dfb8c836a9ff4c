"""How batches end when things go wrong: attempts counted before they run (no crash loop), each
batch looked at on its own, output files written by paging, temporary files never left, status
changes that a race cannot cross, every line ending, and one sidecar per batches.dir."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from test_batches_feeder import Answer, Listener, Rig, listeners, ok, wait_until

from llamaswap.batches import feeder as feeder_module
from llamaswap.batches import records as records_module
from llamaswap.batches import validate as validate_module
from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.output import ATTEMPTS_MOST, PAGE_LINES, Stage
from llamaswap.batches.rows import record_text
from llamaswap.batches.store import Result, Store, StoreError
from llamaswap.batches.validate import InputLine


@pytest.fixture
async def listener_with() -> AsyncIterator[Callable[[Answer], Awaitable[Listener]]]:
    async with listeners() as make:
        yield make

ENDPOINT = "/v1/chat/completions"
SIDECAR = pathlib.Path(__file__).resolve().parents[1] / "sidecar"


def child(script: str) -> subprocess.Popen[str]:
    """A second process (another sidecar, as the kernel sees it)."""
    env = {**os.environ, "PYTHONPATH": str(SIDECAR)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# -- no crash loops --------------------------------------------------------------------------


def test_a_batch_whose_validation_kills_the_process_twice_fails_saying_why(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "b"
    store = Store(directory)
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(b'{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}\n')
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=3600,
                               metadata=None, priority=-100, trace_id="0" * 32, span_id="0" * 16)
    store.close()
    # Twice, a sidecar starts validating it and is killed there (SIGKILL: nothing of it runs after).
    for _ in range(ATTEMPTS_MOST):
        marker = tmp_path / "validating"
        process = child(f"""
            import asyncio, pathlib, time
            from llamaswap.batches import feeder
            from llamaswap.batches.feeder import Feeder, FeedSettings
            from llamaswap.batches.store import Store

            def stuck(*args, **kwargs):
                pathlib.Path({str(marker)!r}).write_text("in validate")
                time.sleep(3600)

            feeder.validate = stuck
            store = Store({str(directory)!r})
            asyncio.run(Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 10)).look())
        """)
        deadline = 60.0
        while not marker.exists():
            assert process.poll() is None, process.communicate()
            deadline -= 0.05
            assert deadline > 0, "the child never reached validation"
            threading.Event().wait(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        marker.unlink()
    store = Store(directory)
    assert store.attempts(batch.id)[Stage.VALIDATE] == ATTEMPTS_MOST
    from llamaswap.batches.feeder import Feeder, FeedSettings

    asyncio.run(Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 10)).look())
    failed = store.batch(batch.id)
    assert failed is not None and failed.status is BatchStatus.FAILED and failed.timestamps["failed_at"]
    assert failed.errors is not None and [(e["code"], e["line"]) for e in failed.errors] == [
        ("validation_failed", None)]
    assert "failed 2 times" in failed.errors[0]["message"] and "batches.maxLineBytes" in failed.errors[0]["message"]
    store.close()


async def test_a_batch_whose_finalize_raises_fails_after_two_tries_and_the_others_go_on(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    broken = rig.batch(["x1", "x2"])
    real = rig.store._write_pages

    def write_pages(batch_id: str, temporaries: dict[bool, pathlib.Path]) -> dict[bool, int]:
        if batch_id == broken:
            for temporary in temporaries.values():
                temporary.write_bytes(b"half")  # a temporary file begun, then the failure
            raise RuntimeError("a bug in finalize")
        return real(batch_id, temporaries)

    monkeypatch.setattr(rig.store, "_write_pages", write_pages)
    rig.start()
    await wait_until(lambda: rig.record(broken).status is BatchStatus.FINALIZING, "the broken batch to finalize")
    # A newer batch is not held up by the older one whose finalize raises at every look.
    fine = rig.batch(["y1"])
    assert (await rig.ended(fine)).status is BatchStatus.COMPLETED
    batch = await rig.ended(broken)
    assert batch.status is BatchStatus.FAILED and batch.output_file_id is None
    assert batch.errors is not None and batch.errors[0]["code"] == "finalize_failed"
    assert rig.store.attempts(broken)[Stage.FINALIZE] == ATTEMPTS_MOST
    assert list((rig.store.directory / "files").glob(".upload-*")) == []  # no temporary file left
    assert rig.store.result_page(broken, after=0) == []  # its results are dropped with it
    await rig.close()


async def test_a_batch_whose_finalize_killed_the_process_twice_fails_at_the_next_start(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["a", "b"])
    await rig.feeder.look()  # validated
    rig.store.record_results([Result(batch_id, line, LineOutcome.COMPLETED,
                                     record_text({"custom_id": line.custom_id}), 1.0)
                              for line in rig.store.unfinished_lines(batch_id)])
    assert rig.store.set_status(batch_id, BatchStatus.FINALIZING, only_from=(BatchStatus.IN_PROGRESS,))
    # Two sidecars were killed while finalizing it: each counted its attempt first, then died.
    assert rig.store.begin_attempt(batch_id, Stage.FINALIZE) == 1
    assert rig.store.begin_attempt(batch_id, Stage.FINALIZE) == 2
    await rig.feeder.look()
    batch = rig.record(batch_id)
    assert batch.status is BatchStatus.FAILED and batch.output_file_id is None
    assert batch.errors == [{"code": "finalize_failed", "line": None, "param": None,
                             "message": Stage.FINALIZE.failure[1]}]
    assert "failed 2 times" in Stage.FINALIZE.failure[1]
    assert rig.store.result_page(batch_id, after=0) == [] and listener.requests == []
    await rig.close()


async def test_a_full_disk_while_finalizing_is_waited_out_not_counted(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feeder_module, "IDLE_LOOK_S", 0.05)  # the looks that try again come sooner
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["a"])
    real = rig.store.finalize
    refusals: list[int] = []

    def finalize(batch: Any, status: BatchStatus) -> Any:
        if len(refusals) < ATTEMPTS_MOST + 1:  # more full-disk failures than a batch may fail
            refusals.append(rig.store.attempts(batch_id)[Stage.FINALIZE])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(batch, status)

    monkeypatch.setattr(rig.store, "finalize", finalize)
    rig.start()
    await wait_until(lambda: len(refusals) == ATTEMPTS_MOST + 1, "finalize refused for want of space")
    assert rig.record(batch_id).status is BatchStatus.FINALIZING
    rig.feeder.wake()  # space returns; the next look finalizes it
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED and refusals == [1, 1, 1]  # each counted, then given back
    await rig.close()


# -- the output files, paged -------------------------------------------------------------------


def test_fifty_thousand_lines_are_finalized_a_page_at_a_time(tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "b")
    count = 50_000
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(b"{}\n")
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=3600,
                               metadata=None, priority=-100, trace_id="0" * 32, span_id="0" * 16)
    lines = [InputLine(n, f"c{n}", 0, 2) for n in range(1, count + 1)]
    assert store.validated(batch.id, lines, [])
    for start in range(0, count, 5000):
        store.record_results([Result(batch.id, line, LineOutcome.FAILED if line.line % 10 == 0 else
                                     LineOutcome.COMPLETED,
                                     record_text({"custom_id": line.custom_id, "pad": "p" * 100}), 1.0)
                              for line in lines[start:start + 5000]])
    assert store.set_status(batch.id, BatchStatus.FINALIZING, only_from=(BatchStatus.IN_PROGRESS,))
    pages: list[int] = []
    free_between_pages: list[bool] = []
    real = store.result_page

    def result_page(batch_id: str, *, after: int, limit: int = PAGE_LINES) -> list[tuple[int, bool, str]]:
        # Between pages the store's lock is free: another thread (the event loop) gets it at once.
        got: list[bool] = []
        other = threading.Thread(target=lambda: got.append(store._lock.acquire(blocking=False)
                                                           and (store._lock.release() or True)))
        other.start()
        other.join()
        free_between_pages.append(got == [True])
        page = real(batch_id, after=after, limit=limit)
        pages.append(len(page))
        return page

    monkeypatch.setattr(store, "result_page", result_page)
    final = store.finalize(store.batch(batch.id) or batch, BatchStatus.COMPLETED)
    assert final is not None and final.status is BatchStatus.COMPLETED
    assert max(pages) == PAGE_LINES and sum(pages) == count and all(free_between_pages)
    output = store.file_path(final.output_file_id or "").read_text().splitlines()
    errors = store.file_path(final.error_file_id or "").read_text().splitlines()
    assert [json.loads(text)["custom_id"] for text in output] == [f"c{n}" for n in range(1, count + 1) if n % 10]
    assert [json.loads(text)["custom_id"] for text in errors] == [f"c{n}" for n in range(10, count + 1, 10)]
    # Kept once: the files hold the results now; the counts stay in the batch's row.
    monkeypatch.undo()
    assert store.result_page(batch.id, after=0) == [] and store.unfinished_lines(batch.id) == []
    counts = store.counts(batch.id, final.total)
    assert (counts.completed, counts.failed) == (count - count // 10, count // 10)
    store.close()


def test_results_left_by_a_kill_after_the_end_are_dropped_at_start(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path / "b")
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(b"{}\n")
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=3600,
                               metadata=None, priority=-100, trace_id="0" * 32, span_id="0" * 16)
    store.validated(batch.id, [InputLine(1, "a", 0, 2)], [])
    store.record_result(batch.id, InputLine(1, "a", 0, 2), LineOutcome.COMPLETED, record_text({"custom_id": "a"}))
    # The end committed, the kill came before the results were dropped.
    assert store.set_status(batch.id, BatchStatus.COMPLETED, only_from=(BatchStatus.IN_PROGRESS,))
    store.close()
    again = Store(tmp_path / "b")
    assert again.result_page(batch.id, after=0) == []
    # And a result that comes for an ended batch is not kept.
    assert again.record_results([Result(batch.id, InputLine(1, "a", 0, 2), LineOutcome.COMPLETED, "{}", 1.0)]) == [
        False]
    again.close()


def test_a_failed_finalize_leaves_no_temporary_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "b")
    upload = tmp_path / "in.jsonl"
    upload.write_bytes(b"{}\n")
    record = store.add_file(upload, filename="in.jsonl", purpose="batch")
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=record.id, completion_window="24h", window_s=3600,
                               metadata=None, priority=-100, trace_id="0" * 32, span_id="0" * 16)
    store.validated(batch.id, [InputLine(1, "a", 0, 2), InputLine(2, "b", 0, 2)], [])
    store.record_result(batch.id, InputLine(1, "a", 0, 2), LineOutcome.COMPLETED, record_text({"custom_id": "a"}))
    store.record_result(batch.id, InputLine(2, "b", 0, 2), LineOutcome.FAILED, record_text({"custom_id": "b"}))
    store.set_status(batch.id, BatchStatus.FINALIZING, only_from=(BatchStatus.IN_PROGRESS,))
    real = store.add_file

    def add_file(received: pathlib.Path, **kwargs: Any) -> Any:
        if kwargs.get("purpose") == "batch_output" and "errors" in str(kwargs.get("file_id")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(received, **kwargs)

    monkeypatch.setattr(store, "add_file", add_file)
    current = store.batch(batch.id)
    assert current is not None
    with pytest.raises(OSError, match="No space"):
        store.finalize(current, BatchStatus.COMPLETED)
    assert list((store.directory / "files").glob(".upload-*")) == []
    assert store.status(batch.id) is BatchStatus.FINALIZING and len(store.result_page(batch.id, after=0)) == 2
    monkeypatch.undo()
    final = store.finalize(current, BatchStatus.COMPLETED)  # tried again once space returns: the same files
    assert final is not None and final.output_file_id and final.error_file_id
    store.close()


# -- status changes a race cannot cross --------------------------------------------------------


async def test_a_cancel_during_expiry_ends_cancelled_not_expired(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        await listener.gate.wait()
        return await ok(request, body)

    listener = await listener_with(held)
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["a", "b", "c"])
    rig.start()
    await wait_until(lambda: listener.active == 2, "two lines in flight")
    real = rig.store.finalize

    def finalize(batch: Any, status: BatchStatus) -> Any:
        if status is BatchStatus.EXPIRED:  # the cancel comes while the expiry finalizes
            assert rig.store.set_status(batch_id, BatchStatus.CANCELLING,
                                        only_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS))
        return real(batch, status)

    monkeypatch.setattr(rig.store, "finalize", finalize)
    rig.clock.now += 3600  # the window ends
    rig.feeder.wake()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.CANCELLED
    assert rig.store.attempts(batch_id)[Stage.FINALIZE] == 1  # the one that lost the race is not counted
    assert batch.timestamps["cancelling_at"] and batch.timestamps["cancelled_at"]
    assert batch.timestamps["expired_at"] is None
    assert [r["error"]["code"] for r in rig.lines_of(batch.error_file_id)] == ["batch_expired"] * 3
    await rig.close()


async def test_a_cancel_during_completion_is_refused_and_the_batch_completes(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["a"])
    refused: list[bool] = []
    real = rig.store.finalize

    def finalize(batch: Any, status: BatchStatus) -> Any:
        # the API's cancel, as it asks the store, while the batch finalizes
        refused.append(not rig.store.set_status(batch_id, BatchStatus.CANCELLING,
                                                only_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)))
        return real(batch, status)

    monkeypatch.setattr(rig.store, "finalize", finalize)
    rig.start()
    batch = await rig.ended(batch_id)
    assert refused == [True]
    assert batch.status is BatchStatus.COMPLETED and batch.timestamps["cancelling_at"] is None
    await rig.close()


# -- every line ends -------------------------------------------------------------------------


async def test_a_line_whose_input_is_cut_short_or_gone_ends_with_an_error(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    cut = rig.batch(["a", "b", "c"])
    await rig.feeder.look()  # validated, not yet sent
    path = rig.store.file_path(rig.record(cut).input_file_id)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 20])  # the last line cut short
    rig.start()
    batch = await rig.ended(cut)
    assert batch.status is BatchStatus.COMPLETED and rig.feeder.in_flight(cut) == 0
    assert [r["custom_id"] for r in rig.lines_of(batch.output_file_id)] == ["id-a", "id-b"]
    [error] = rig.lines_of(batch.error_file_id)
    assert error["custom_id"] == "id-c" and error["response"] is None
    assert error["error"]["code"] == "input_line_unreadable" and "cut short" in error["error"]["message"]
    assert len(listener.requests) == 2
    await rig.close()


async def test_a_line_whose_input_file_is_gone_ends_with_an_error(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]]) -> None:
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    batch_id = rig.batch(["a", "b"])
    await rig.feeder.look()  # validated, not yet sent
    rig.store.file_path(rig.record(batch_id).input_file_id).unlink()
    rig.start()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED and batch.output_file_id is None
    assert [(r["custom_id"], r["error"]["code"]) for r in rig.lines_of(batch.error_file_id)] == [
        ("id-a", "input_line_unreadable"), ("id-b", "input_line_unreadable")]
    assert listener.requests == []
    await rig.close()


async def test_a_long_line_is_sent_as_it_lies_in_the_file(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate_module, "WHOLE_PARSE_BYTES", 100)  # every line here is scanned, not parsed
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    contents = ["x" * 500 + "\u00e9\"", "short"]
    batch_id = rig.batch(contents)
    rig.start()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert sorted(body["messages"][0]["content"] for _, body in listener.requests) == sorted(contents)
    assert [r["response"]["body"]["echo"] for r in rig.lines_of(batch.output_file_id)] == contents
    await rig.close()


async def test_a_line_over_64_kb_is_scanned_at_validation_and_never_parsed_when_sent(
        tmp_path: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Parsing a line of a megabyte whole holds the GIL for tens of milliseconds, at validation and
    # at every send: a line over WHOLE_PARSE_BYTES (64 KB) is scanned, and its body sent as it lies.
    parsed_at_send: list[int] = []
    real_line_body = records_module.line_body

    def line_body(text: bytes) -> bytes:
        parsed_at_send.append(len(text))
        return real_line_body(text)

    monkeypatch.setattr(records_module, "line_body", line_body)
    listener = await listener_with(ok)
    rig = Rig(tmp_path, listener)
    contents = ["\u00e9\"" + "x" * 100_000, "short"]
    batch_id = rig.batch(contents)
    await rig.feeder.look()  # validated
    long, short = rig.store.unfinished_lines(batch_id)
    assert long.length > validate_module.WHOLE_PARSE_BYTES >= short.length
    assert long.body_offset is not None and short.body_offset is None  # scanned; parsed whole
    rig.start()
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert parsed_at_send == [short.length]  # the short line's body only
    assert sorted(body["messages"][0]["content"] for _, body in listener.requests) == sorted(contents)
    assert [r["response"]["body"]["echo"] for r in rig.lines_of(batch.output_file_id)] == contents
    await rig.close()


# -- one sidecar per batches.dir ---------------------------------------------------------------


def test_a_second_process_on_the_same_batches_dir_is_refused_with_the_fix(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "b"
    holder = child(f"""
        import sys
        from llamaswap.batches.store import Store
        store = Store({str(directory)!r})
        print("open", flush=True)
        sys.stdin.read()  # held until the test closes stdin
        store.close()
    """)
    assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    with pytest.raises(StoreError) as refused:
        Store(directory)
    message = str(refused.value)
    assert f"batches.dir {directory}" in message and f"pid {holder.pid}" in message
    assert "give each sidecar its own batches.dir" in message
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
    Store(directory).close()  # the lock went with its holder
    # A holder killed outright leaves no stale lock either.
    killed = child(f"""
        import time
        from llamaswap.batches.store import Store
        store = Store({str(directory)!r})
        print("open", flush=True)
        time.sleep(3600)
    """)
    assert killed.stdout is not None and killed.stdout.readline() == "open\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    Store(directory).close()


def test_serve_exits_2_naming_batches_dir_when_another_sidecar_holds_it(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "b"
    holder = Store(directory)  # this process holds it: the serve below is a second process
    config = tmp_path / "llamaswap.yaml"
    config.write_text(json.dumps({"batches": {"dir": str(directory)}, "upstream": {"url": "http://127.0.0.1:9"},
                                  "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"}}))
    env = {**os.environ, "PYTHONPATH": str(SIDECAR)}
    done = subprocess.run([sys.executable, "-m", "llamaswap", "serve", "-c", str(config)],
                          capture_output=True, text=True, env=env, timeout=120)
    holder.close()
    assert done.returncode == 2, done.stderr
    assert f"batches.dir {directory}" in done.stderr and "give each sidecar its own batches.dir" in done.stderr
    assert "Traceback" not in done.stderr
