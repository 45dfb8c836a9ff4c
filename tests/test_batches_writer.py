"""The results' writer, exactly: what it keeps while writes fail, that it tries again and
resumes, that a flush never waits out the pause between tries, and what a stop does."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading
from collections.abc import Sequence

import pytest

from llamaswap.batches import writer as writer_module
from llamaswap.batches.lifecycle import BatchStatus, LineOutcome
from llamaswap.batches.store import BatchRecord, Result
from llamaswap.batches.validate import InputLine
from llamaswap.batches.writer import Answered, ResultWriter

BATCH = BatchRecord(id="batch_x", endpoint="/v1/chat/completions", input_file_id="file-x", completion_window="24h",
                    created_at=0, expires_at=3600, status=BatchStatus.IN_PROGRESS, metadata=None, priority=-100,
                    errors=None, output_file_id=None, error_file_id=None, total=3, timestamps={}, trace_id="0",
                    span_id="0")


def answered(line: int, batch: BatchRecord = BATCH) -> Answered:
    return Answered(batch, Result(batch.id, InputLine(line, f"c{line}", 0, 1), LineOutcome.COMPLETED, "{}", 1.0), 200,
                    0)


class Disk:
    """A store's record_results on a disk that is full until told otherwise."""

    def __init__(self) -> None:
        self.full = True
        self.tries = 0
        self.written: list[int] = []

    def record(self, results: Sequence[Result]) -> list[bool]:
        self.tries += 1
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += [result.line.line for result in results]
        return [True] * len(results)


async def test_failed_writes_keep_the_results_block_new_lines_and_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "WRITE_FIRST_S", 0.01)
    monkeypatch.setattr(writer_module, "WRITE_MOST_S", 0.02)
    disk = Disk()
    told: list[tuple[int, bool]] = []
    recovered = asyncio.Event()
    writer = ResultWriter(disk.record, written=lambda a, new: told.append((a.result.line.line, new)),
                          recovered=recovered.set)
    for line in (1, 2):
        writer.add(answered(line))
    assert writer.holds(BATCH.id) and writer.is_unwritten(BATCH.id, 2) and not writer.is_unwritten(BATCH.id, 3)
    while disk.tries < 3:
        await asyncio.sleep(0.01)
    assert writer.failing and writer.blocking and writer.kept() == 2 and told == []
    assert not await writer.flush(BATCH.id)  # at once: it does not wait for the next try
    writer.add(answered(3))  # a line in flight when the disk filled is kept too
    disk.full = False
    await recovered.wait()
    assert not writer.failing and not writer.holds(BATCH.id) and disk.written == [1, 2, 3]
    assert told == [(1, True), (2, True), (3, True)]
    await writer.close()


async def test_a_flush_while_writes_fail_returns_without_waiting_out_the_pause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "WRITE_FIRST_S", 3600.0)
    disk = Disk()
    writer = ResultWriter(disk.record, written=lambda a, new: None, recovered=lambda: None)
    writer.add(answered(1))
    # The flush starts the write, sees it fail and returns: the pause of an hour is the writer's alone.
    assert not await asyncio.wait_for(writer.flush(BATCH.id), timeout=60)
    assert disk.tries == 1 and writer.failing and writer.kept() == 1
    await writer.close()  # one last try at the stop; it fails too and is only logged
    assert disk.tries == 2


async def test_too_many_results_waiting_block_new_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "KEPT_MOST", 2)
    monkeypatch.setattr(writer_module, "RESULTS_S", 3600.0)
    monkeypatch.setattr(writer_module, "RESULTS_LINES", 100)
    disk = Disk()
    disk.full = False
    writer = ResultWriter(disk.record, written=lambda a, new: None, recovered=lambda: None)
    writer.add(answered(1))
    assert not writer.blocking
    writer.add(answered(2))
    assert writer.blocking and not writer.failing
    assert await writer.flush(BATCH.id) and not writer.blocking and disk.written == [1, 2]
    await writer.close()


async def test_a_stop_during_a_write_lets_it_finish_and_tells_of_it() -> None:
    entered, release = threading.Event(), threading.Event()
    written: list[int] = []

    def slow(results: Sequence[Result]) -> list[bool]:
        entered.set()
        release.wait(60)
        written.extend(result.line.line for result in results)
        return [True] * len(results)

    told: list[int] = []
    writer = ResultWriter(slow, written=lambda a, new: told.append(a.result.line.line), recovered=lambda: None)
    writer.add(answered(1))
    flushing = asyncio.create_task(writer.flush(BATCH.id))
    await asyncio.to_thread(entered.wait, 60)
    closing = asyncio.create_task(writer.close())
    await asyncio.sleep(0)
    assert not closing.done()  # it waits for the write under way, not cancelling it
    release.set()
    await closing
    assert await flushing
    assert written == [1] and told == [1] and writer.kept() == 0


async def test_a_flush_of_one_batch_is_not_held_up_by_another_that_keeps_adding_results() -> None:
    # Batch B keeps feeding: each write adds one more of its results (an answer that came while
    # the write ran). A's flush must still end once A's results are written, not wait for B's.
    other = dataclasses.replace(BATCH, id="batch_other")
    loop = asyncio.get_running_loop()
    entered, release = threading.Event(), threading.Event()
    written: list[tuple[str, int]] = []
    extra = iter(range(100, 200))

    def record(results: Sequence[Result]) -> list[bool]:
        if not entered.is_set():
            entered.set()
            release.wait(60)  # the first write (B's alone) is under way when A's result comes
        written.extend((result.batch_id, result.line.line) for result in results)
        loop.call_soon_threadsafe(writer.add, answered(next(extra), other))
        return [True] * len(results)

    writer = ResultWriter(record, written=lambda a, new: None, recovered=lambda: None)
    writer.add(answered(1, other))
    flushing_other = asyncio.create_task(writer.flush(other.id))
    await asyncio.to_thread(entered.wait, 60)
    writer.add(answered(7))
    flushing = asyncio.create_task(writer.flush(BATCH.id))
    release.set()
    assert await asyncio.wait_for(flushing, timeout=60)
    assert (BATCH.id, 7) in written and not writer.holds(BATCH.id)
    assert writer.holds(other.id)  # B still has results waiting: they did not make A's flush fail
    flushing_other.cancel()
    await writer.close()
