"""A full disk, on a real small filesystem: the batch pauses (no line starts, none is sent
again), keeps the answers it has, and finishes once space is freed, each line asked once."""

from __future__ import annotations

import errno
import json
import pathlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import pytest
from aiohttp import web
from test_batches_feeder import Answer, Listener, Rig, listeners, wait_until

from llamaswap.batches import writer as writer_module
from llamaswap.batches.lifecycle import BatchStatus
from llamaswap.batches.store import Result


@pytest.fixture
async def listener_with() -> AsyncIterator[Callable[[Answer], Awaitable[Listener]]]:
    async with listeners() as make:
        yield make

LINES = 30


@pytest.fixture
def small_disk(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                              text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"no mount command here ({exc}): the full-disk case needs a small filesystem of its own")
    if done.returncode != 0:
        pytest.skip(f"a small filesystem cannot be mounted here (mount -t tmpfs needs root: {done.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def fill(directory: pathlib.Path) -> pathlib.Path:
    """A file that takes every free byte of the filesystem."""
    filler = directory / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as out:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    out.write(block[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


async def test_a_full_disk_pauses_the_batch_and_it_finishes_when_space_returns(
        small_disk: pathlib.Path, listener_with: Callable[[Answer], Awaitable[Listener]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "WRITE_MOST_S", 1.0)
    monkeypatch.setattr(writer_module, "RESULTS_LINES", 1)  # each answer written at once: the failure comes early
    monkeypatch.setattr(writer_module, "KEPT_MOST", 2)  # and no line starts while two wait for a write

    async def padded(request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"echo": body["messages"][0]["content"], "pad": "p" * 16_000})

    listener = await listener_with(padded)
    rig = Rig(small_disk, listener, in_flight=2)
    tries: list[bool] = []
    real = rig.store.record_results

    def record_results(results: Sequence[Result]) -> list[bool]:
        try:
            added = real(results)
        except Exception:
            tries.append(False)
            raise
        tries.append(True)
        return added

    monkeypatch.setattr(rig.store, "record_results", record_results)
    rig.feeder._writer._record = record_results  # the writer was given the store's method at start
    contents = [f"q{n}" for n in range(LINES)]
    batch_id = rig.batch(contents)
    await rig.feeder.look()
    assert rig.record(batch_id).status is BatchStatus.IN_PROGRESS
    filler = fill(small_disk)
    rig.start()
    await wait_until(lambda: rig.feeder.writes_failing, "a write of results to fail")
    # The lines in flight then are answered (and kept); none starts after them.
    await wait_until(lambda: rig.feeder.in_flight(batch_id) == 0, "the lines in flight answered")
    sent = len(listener.requests)
    assert 0 < sent < LINES
    # Paused: the writes are tried again (and fail) while no line starts and none is sent again.
    failed_before = tries.count(False)
    await wait_until(lambda: tries.count(False) >= failed_before + 2, "two more tries of the write")
    assert len(listener.requests) == sent and rig.feeder.in_flight(batch_id) == 0 and rig.feeder.writes_failing
    assert rig.record(batch_id).status is BatchStatus.IN_PROGRESS
    filler.unlink()  # space returns
    batch = await rig.ended(batch_id)
    assert batch.status is BatchStatus.COMPLETED
    assert [listener.tries_of(content) for content in contents] == [1] * LINES  # none sent twice
    output = rig.lines_of(batch.output_file_id)
    assert [record["custom_id"] for record in output] == [f"id-{content}" for content in contents]
    assert [json.loads(json.dumps(record["response"]["body"]))["echo"] for record in output] == contents
    assert list((small_disk / "batches" / "files").glob(".upload-*")) == []
    await rig.close()
